"""qstats.gptq on edge inputs, against llm-compressor 0.14's quantize_weight: Hessians whose
float32 form over- or underflows (a float64 sum of huge rows, rows of 1e-20), a weight without
input columns or output rows, and dead columns under llm-compressor's sample-count normalization."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import qstats
from qstats.gptq_quantize import gptq
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

OUT, IN = 32, 64


def _minmax_qparams(weight, spec):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)


def _llmc(weight, normalized_hessian, qparams, args):
    """llm-compressor's quantize_weight on a batch of one (group scales ``[rows, groups]``)."""
    scale, zero_point = qparams.scale.reshape(OUT, -1), qparams.zero_point.reshape(OUT, -1)
    out, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], normalized_hessian.clone()[None],
                                                 scale[None], zero_point[None], None, args)
    return out[0], bool(fallback[0])


@pytest.mark.parametrize("magnitude,dtype", [(1e20, torch.float64), (1e-20, torch.float32), (1e-30, torch.float64)])
def test_a_hessian_out_of_float32_range_is_gptq_of_it_scaled_by_a_power_of_4(magnitude, dtype):
    """Rows of 1e20 (a float64 sum, as the hessian docstring advises: its mean passes float32's
    range) or of 1e-20 (a subnormal float32 Hessian): llm-compressor fails there (an Inf Hessian, a
    Cholesky error); GPTQ does not depend on a positive factor of the Hessian, so the result is
    llm-compressor's on the same Hessian times an exact power of 4 that brings it near 1. Before:
    round-to-nearest with a 'not positive definite' warning."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(300, IN, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
    weight = torch.randn(OUT, IN, generator=gen) * 0.05
    obs = hessian(dtype=dtype)
    state = obs.update(obs.init(x), x)
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=16, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, codes, _ = gptq(weight, state, spec, actorder="static", qparams=qparams)
    mean = 2.0 * state.total.double() / int(state.count)
    power = 4.0 ** -round(torch.log(mean.diagonal().max()).item() / torch.log(torch.tensor(4.0)).item())
    reference, fallback = _llmc(weight, (mean * power).float(), qparams, args)
    assert not fallback
    assert torch.equal(codes, qstats.quantize(reference, qparams, spec))
    assert not torch.equal(codes, qstats.quantize(weight, qparams, spec))  # not round-to-nearest


def test_a_weight_without_input_columns_is_a_clear_error():
    obs = hessian()
    state = obs.init(torch.zeros(1, 0))
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerRow())
    with pytest.raises(ValueError, match="no input column"):  # before: RuntimeError from torch.stack
        gptq(torch.zeros(4, 0), state, spec)


@pytest.mark.parametrize("granularity", [qstats.PerGroup(32), qstats.PerRow(), qstats.PerBlock((16, 16))], ids=repr)
def test_a_weight_without_output_rows_takes_its_given_qparams_as_llm_compressor(granularity):
    """A ``[0, in]`` weight with its (empty) qparams gives empty results, as llm-compressor's
    quantize_weight of a ``[1, 0, in]`` batch does (a RuntimeError reshaping the group scales)."""
    x = torch.randn(50, IN, generator=torch.Generator().manual_seed(2))
    state = hessian().update(hessian().init(x), x)
    spec = qstats.QuantSpec(dtype="int4", granularity=granularity)
    weight = torch.zeros(0, IN)
    qparams = _minmax_qparams(weight, spec)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    want, _, fallback = llmc_gptq.quantize_weight(weight[None], gptq_hessian(state)[None], torch.ones(1, 0, 2),
                                                  torch.zeros(1, 0, 2, dtype=torch.int8), None, args)
    fake_quantized, codes, used = gptq(weight, state, spec, qparams=qparams)
    assert fake_quantized.shape == codes.shape == want[0].shape == (0, IN) and not bool(fallback[0])
    assert codes.dtype == qstats.quantize(weight, qparams, spec).dtype and used is not None


def test_dead_columns_make_llm_compressor_depend_on_its_sample_count():
    """llm-compressor sets a dead column's Hessian diagonal to 1 before its dampening takes the
    mean diagonal: with dead columns its codes depend on the Hessian's scale, 2 / samples there,
    2 / rows in qstats (docs/gptq.md). qstats' codes are llm-compressor's on ``gptq_hessian``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, IN, generator=gen) * 0.05
    x[..., :8] = 0.0
    weight = torch.randn(OUT, IN, generator=gen) * 0.05
    layer = torch.nn.Linear(IN, OUT, bias=False)
    own, samples = llmc_helpers.make_empty_hessian(layer), torch.zeros(())
    obs = hessian()
    state = obs.init(x)
    for batch in x:
        own, samples = llmc_helpers.accumulate_hessian(batch[None], layer, own, samples)
        state = obs.update(state, batch)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    _, codes, _ = gptq(weight, state, spec, actorder="static", qparams=qparams)
    same_hessian, _ = _llmc(weight, gptq_hessian(state), qparams, args)
    per_sample, _ = _llmc(weight, own / samples, qparams, args)
    assert torch.equal(codes, qstats.quantize(same_hessian, qparams, spec))
    assert (codes != qstats.quantize(per_sample, qparams, spec)).float().mean() > 0.01


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_bad_given_global_scale_raises(value):
    """NVFP4's global scale given NaN or 0 made every GPTQ'd value NaN, Inf or -1 every value 0,
    silently (the scales themselves were checked); now a ValueError as for a bad scale."""
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(OUT, IN, generator=gen) * 0.1, torch.randn(100, IN, generator=gen)
    state = hessian().update(hessian().init(x), x)
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                            scale_dtype=torch.float8_e4m3fn)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    assert torch.isfinite(gptq(weight, state, spec, qparams=qparams)[0]).all()
    with pytest.raises(ValueError, match="global scale"):
        gptq(weight, state, spec, qparams=qparams._replace(global_scale=torch.tensor(value)))


@pytest.mark.parametrize("block_size", [np.int64(24), np.int32(200)])
def test_a_numpy_block_size_is_the_int_it_holds_as_llm_compressor_takes_it(block_size):
    """A block size read from an array or a config (``np.int64(24)``) was refused as 'must be a
    positive int'; llm-compressor's ``range(0, columns, blocksize)`` takes it."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(200, IN, generator=gen), torch.randn(OUT, IN, generator=gen) * 0.05
    state = hessian().update(hessian().init(x), x)
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=16)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    qparams = _minmax_qparams(weight, spec)
    scale, zero_point = qparams.scale.reshape(OUT, -1), qparams.zero_point.reshape(OUT, -1)
    want, _, _ = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state)[None], scale[None],
                                           zero_point[None], None, args, blocksize=block_size)
    got, codes, _ = gptq(weight, state, spec, block_size=block_size, qparams=qparams)
    assert (codes == qstats.quantize(want[0], qparams, spec)).float().mean() >= 0.999
    assert torch.equal(got, gptq(weight, state, spec, block_size=int(block_size), qparams=qparams)[0])
    with pytest.raises(ValueError, match="block_size"):
        gptq(weight, state, spec, block_size=np.int64(0))


@pytest.mark.parametrize("actorder", [None, "static"])
def test_a_meta_weight_and_state_give_meta_results_of_the_shapes_and_dtypes_on_the_cpu(actorder):
    """Sizing a model's GPTQ on the meta device (as compressed-tensors' qparams on meta): a 2-D
    weight took the stacked path of experts with equal Hessians there (its meta 'all equal' flag
    read as true) and raised IndexError 'slice() cannot be applied to a 0-dim tensor'."""
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(100, IN, generator=gen), torch.randn(OUT, IN, generator=gen)
    state = hessian().update(hessian().init(x), x)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=4, strategy="group", group_size=16))
    on_cpu = gptq(weight, state, spec, actorder=actorder)
    on_meta = gptq(weight.to("meta"), type(state)(*(field.to("meta") for field in state)), spec, actorder=actorder)
    for cpu, meta in zip((*on_cpu[:2], *on_cpu[2]), (*on_meta[:2], *on_meta[2])):
        assert meta.device.type == "meta" and (meta.shape, meta.dtype) == (cpu.shape, cpu.dtype)
