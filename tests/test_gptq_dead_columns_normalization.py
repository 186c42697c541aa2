"""Dead input columns (a Hessian diagonal of zero: ReLU units that never fire on the calibration set)
against llm-compressor 0.14's ``accumulate_hessian`` and ``quantize_weight`` (docs/gptq.md).

Both set a dead column's diagonal to 1 before the dampening takes the mean diagonal, a value that
does not scale with the Hessian. llm-compressor divides the sum by its sample count (one per
sequence of a 3-D input), qstats by the rows: with dead columns llm-compressor's codes then depend
on how the same rows are grouped into sequences, qstats' do not; a state whose ``count`` is
llm-compressor's sample count gives llm-compressor's codes."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

OUT, IN, ROWS, DEAD = 64, 128, 36 * 128, 16
ARGS = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=64, actorder="static")


def _relu_rows(scale: float):
    """``[ROWS, IN]`` ReLU activations whose first DEAD units never fire, and a weight."""
    gen = torch.Generator().manual_seed(0)
    pre = torch.randn(ROWS, 16, generator=gen) @ torch.randn(16, IN, generator=gen) * 0.3
    x = torch.relu(pre + torch.randn(ROWS, IN, generator=gen)) * scale
    x[:, :DEAD] = 0.0
    return x, torch.randn(OUT, IN, generator=gen) * IN**-0.5


def _qparams(weight, spec):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)


def _llmc_codes(weight, x, qparams, spec, **spec_fields):
    """llm-compressor's codes over the batch ``x`` (``[sequences, tokens, IN]``), one call."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    total, samples = llmc_helpers.accumulate_hessian(x, layer, llmc_helpers.make_empty_hessian(layer), torch.zeros(()))
    args = QuantizationArgs(**{**ARGS.model_dump(), **spec_fields})
    out, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], (total / samples)[None], qparams.scale[None],
                                                 qparams.zero_point[None], None, args)
    assert not fallback[0]
    return qstats.quantize(out[0], qparams, spec)


def _codes(weight, state, qparams, spec):
    return qstats.gptq(weight, state, spec, qparams=qparams, actorder="static")[1]


def test_llm_compressor_codes_depend_on_the_sequence_length_and_qstats_codes_do_not():
    """The same rows as 36 sequences of 128 tokens or 72 of 64: llm-compressor's Hessians differ
    by a factor 2 on the live columns and not on the dead ones, so its dampening and codes differ;
    qstats' states and codes are the same. Without dead columns its codes do not change."""
    x, weight = _relu_rows(0.01)
    spec = qstats.QuantSpec.from_compressed_tensors(ARGS)
    qparams = _qparams(weight, spec)
    long, short = x.reshape(36, 128, IN), x.reshape(72, 64, IN)
    ours = [_codes(weight, hessian().update(hessian().init(x), batch), qparams, spec) for batch in (long, short)]
    assert torch.equal(ours[0], ours[1])
    theirs = [_llmc_codes(weight, batch, qparams, spec) for batch in (long, short)]
    assert (theirs[0] != theirs[1]).float().mean() > 0.005
    live, live_weight = x[:, DEAD:], weight[:, DEAD:]  # 112 columns, groups of 16
    spec_live = qstats.QuantSpec.from_compressed_tensors({**ARGS.model_dump(), "group_size": 16})
    live_qparams = _qparams(live_weight, spec_live)
    same = [_llmc_codes(live_weight, live.reshape(*shape, IN - DEAD), live_qparams, spec_live, group_size=16)
            for shape in ((36, 128), (72, 64))]
    assert (same[0] == same[1]).float().mean() > 0.999


@pytest.mark.parametrize("scale", [0.01, 0.1])
def test_a_count_of_samples_gives_llm_compressor_codes_with_dead_columns(scale):
    """``state._replace(count=samples)``: qstats.gptq normalises the sum by llm-compressor's sample
    count (36 sequences), and its codes are llm-compressor's; with the row count they differ."""
    x, weight = _relu_rows(scale)
    spec = qstats.QuantSpec.from_compressed_tensors(ARGS)
    qparams = _qparams(weight, spec)
    batch = x.reshape(36, 128, IN)
    state = hessian().update(hessian().init(batch), batch)
    theirs = _llmc_codes(weight, batch, qparams, spec)
    per_sample = _codes(weight, state._replace(count=torch.tensor(36)), qparams, spec)
    assert torch.equal(per_sample, theirs)
    assert (_codes(weight, state, qparams, spec) != theirs).float().mean() > 0.005
