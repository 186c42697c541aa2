"""What llm-compressor 0.14's ``accumulate_hessian`` counts as a sample, against qstats.hessian's rows
(docs/gptq.md): a 3-D input's leading dimension, and one for a 2-D ``[tokens, in]`` input (an MoE
expert's routed tokens), so its normalised Hessian is `gptq_hessian`'s only with one row per sample."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

OUT, IN = 32, 64


def _both(batches):
    """llm-compressor's (normalised Hessian, sample count) and qstats' state over the same batches."""
    layer = torch.nn.Linear(IN, OUT, bias=False)
    own, samples = llmc_helpers.make_empty_hessian(layer), torch.zeros(())
    obs = hessian()
    state = obs.init(batches[0])
    for batch in batches:
        own, samples = llmc_helpers.accumulate_hessian(batch, layer, own, samples)
        state = obs.update(state, batch)
    return own / samples, int(samples), state


def test_a_two_dimensional_input_is_one_sample_and_a_row_per_sample_is_gptq_hessian():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 48, IN, generator=gen)
    normalised, samples, state = _both(list(rows))  # four 2-D [48, in] inputs
    assert samples == 4 and int(state.count) == 192
    torch.testing.assert_close(normalised, 48 * gptq_hessian(state), rtol=1e-5, atol=1e-4)
    normalised, samples, state = _both([batch[:, None] for batch in rows])  # [48, 1, in]: a row per sample
    assert samples == 192 == int(state.count)
    torch.testing.assert_close(normalised, gptq_hessian(state), rtol=1e-5, atol=1e-5)


def test_dead_columns_with_two_dimensional_inputs_make_llm_compressor_depend_on_its_count():
    """Dead columns' diagonal is set to 1 before the dampening's mean: 2-D inputs too (not only 3-D)
    give llm-compressor other codes than on `gptq_hessian`, which are qstats'."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, IN, generator=gen) * 0.05
    x[..., :8] = 0.0
    weight = torch.randn(OUT, IN, generator=gen) * 0.05
    per_call, _, state = _both(list(x))
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.minmax(spec)
    qparams = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    _, codes, _ = qstats.gptq(weight, state, spec, actorder="static", qparams=qparams)

    def llmc_codes(normalised):
        scale, zero_point = qparams.scale.reshape(OUT, -1), qparams.zero_point.reshape(OUT, -1)
        out, _, _ = llmc_gptq.quantize_weight(weight.clone()[None], normalised.clone()[None], scale[None],
                                              zero_point[None], None, args)
        return qstats.quantize(out[0], qparams, spec)

    assert torch.equal(codes, llmc_codes(gptq_hessian(state)))
    assert (codes != llmc_codes(per_call)).float().mean() > 0.01


def test_gptq_layerwise_counts_the_samples_accumulate_hessian_counts():
    """`gptq_layerwise`'s Hessian observer counts llm-compressor's samples beside the rows: a 3-D or
    4-D input's leading dimension, one per 2-D input; under a stacked observer each expert counts
    every call, as llm-compressor's linearized experts call every expert once a forward, on its
    routed tokens, none included (tests/test_gptq_layerwise_routed_sample_count.py)."""
    from qstats.layerwise_gptq import _gptq_inputs

    obs = _gptq_inputs()
    layer = torch.nn.Linear(IN, OUT, bias=False)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(3, 5, IN, generator=gen), torch.randn(7, IN, generator=gen),
               torch.randn(2, 3, 4, IN, generator=gen)]
    state = obs.init(batches[0])
    own, samples = llmc_helpers.make_empty_hessian(layer), torch.zeros(())
    for batch in batches:
        state = obs.update(state, batch)
        own, samples = llmc_helpers.accumulate_hessian(batch, layer, own, samples)
    assert int(state.samples) == int(samples) == 3 + 1 + 2 and int(state.count) == 15 + 7 + 24
    assert torch.equal(state.total, own)  # llm-compressor's sum, bit for bit
    stacked = qstats.stacked_observer(_gptq_inputs(), 3)
    tokens = torch.randn(6, IN, generator=gen).expand(3, 6, IN)
    route = torch.tensor([[1.0] * 6, [1.0, 0, 0, 0, 0, 0], [0.0] * 6])
    expert_state = stacked.update(stacked.update(stacked.init(tokens), tokens, route), tokens, route)
    counts = [llmc_helpers.accumulate_hessian(tokens[0][route[e].bool()], layer, own.clone(), torch.zeros(()))[1]
              for e in range(3)]  # one call each, the unrouted expert's on no row
    assert expert_state.samples.tolist() == [2 * int(c) for c in counts] == [2, 2, 2]
    assert expert_state.count.tolist() == [12, 2, 0]
