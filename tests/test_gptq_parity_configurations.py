"""qstats.gptq against llm-compressor 0.14's quantize_weight on configurations tests/test_gptq.py does
not cover: tensor strategy, groups of 64 and 128, actorder "weight", block sizes that do not divide the
columns, dampening 0 and 0.1, uint formats, llm-compressor's mse observer, NVFP4 (tensor_group), FP8
blocks, bf16/fp16 weights, many dead columns, Hessians of very few rows and vmap over experts. The
quantization parameters come from llm-compressor's own weight observers."""

from __future__ import annotations


import pytest
import torch

import qstats
from qstats.gptq_quantize import gptq
from qstats.observers.hessian import HessianState, gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme  # noqa: E402

OUT, IN = 64, 128


def _data(seed=0, rows=240, dead=(7,), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(OUT, IN, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, IN, generator=gen) * torch.linspace(0.05, 2.0, IN)
    x = x + 0.5 * (torch.randn(rows, 8, generator=gen) @ torch.randn(8, IN, generator=gen))  # correlated
    x[:, list(dead)] = 0.0
    return weight, hessian().update(hessian().init(x), x)


def _llmc_qparams(args, weight, observer="memoryless_minmax", **kwargs):
    obs = llmc_observers.Observer.load_from_registry(observer, base_name="weight", args=args.model_copy(deep=True),
                                                     **kwargs)
    obs(weight)
    return obs.get_qparams()


def _as_qstats(found, spec, weight):
    """llm-compressor's observer qparams in qstats' layout (the values as they are)."""
    obs = qstats.minmax(spec)
    shape = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    global_scale = shape.global_scale if found["global_scale"] is None else found["global_scale"].reshape(())
    return shape._replace(scale=found["scale"].reshape(shape.scale.shape).to(shape.scale.dtype),
                          zero_point=found["zero_point"].reshape(shape.zero_point.shape).to(shape.zero_point.dtype),
                          global_scale=global_scale)


def _reference(args, weight, state, found, block_size, dampening):
    gs = found["global_scale"]
    out, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state)[None],
                                                 found["scale"][None], found["zero_point"][None],
                                                 None if gs is None else gs.reshape(1), args, blocksize=block_size,
                                                 percdamp=dampening)
    return out[0], bool(fallback[0])


def _check(args, weight, state, spec=None, block_size=128, dampening=0.01, observer="memoryless_minmax", **kwargs):
    """Asserts qstats' codes equal llm-compressor's (>= 99.9%) and its weight to float32 rounding."""
    spec = spec or qstats.QuantSpec.from_compressed_tensors(args)
    found = _llmc_qparams(args, weight, observer, **kwargs)
    qparams = _as_qstats(found, spec, weight)
    want, fallback = _reference(args, weight, state, found, block_size, dampening)
    got, codes, used = gptq(weight, state, spec, block_size=block_size, dampening=dampening,
                            actorder=args.actorder and "static", qparams=qparams)
    assert got.dtype == want.dtype == weight.dtype
    # a bf16 weight may not requantize to its own code (compressed-tensors' x / scale rounds in bf16):
    # half-precision weights compare the codes of both results
    mine = codes if weight.dtype == torch.float32 else qstats.quantize(got, qparams, spec)
    same = (mine == qstats.quantize(want, qparams, spec)).float().mean()
    assert same >= 0.999, same
    assert (got.float() - want.float()).abs().max() <= 1e-6 + float(qparams.scale.max()) * (same < 1)
    return fallback


@pytest.mark.parametrize("strategy,group", [("tensor", None), ("channel", None), ("group", 64), ("group", 128)])
@pytest.mark.parametrize("bits,symmetric", [(4, False), (8, False), (4, True)])
def test_strategies_and_group_sizes_with_actorder_weight(strategy, group, bits, symmetric):
    weight, state = _data()
    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group, actorder="weight")
    assert not _check(args, weight, state, block_size=48)  # 48 does not divide 128 columns


@pytest.mark.parametrize("dampening", [0.0, 0.1])
@pytest.mark.parametrize("block_size", [7, 100])
def test_dampening_and_block_sizes(dampening, block_size):
    weight, state = _data(1)
    for actorder in (None, "static"):
        args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32, actorder=actorder)
        assert not _check(args, weight, state, block_size=block_size, dampening=dampening)


@pytest.mark.parametrize("bits", [4, 8])
def test_uint_formats_equal_llm_compressor_asymmetric_int(bits):
    """qstats' uint spec is llm-compressor's asymmetric int with its zero point shifted by 2**(bits-1)."""
    weight, state = _data(2)
    args = QuantizationArgs(num_bits=bits, symmetric=False, strategy="group", group_size=32, actorder="static")
    spec = qstats.QuantSpec(dtype=f"uint{bits}", mapping="asymmetric", granularity=qstats.PerGroup(32))
    found = _llmc_qparams(args, weight)
    obs = qstats.minmax(spec)
    qparams = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    qparams = qparams._replace(scale=found["scale"],
                               zero_point=(found["zero_point"].int() + 2 ** (bits - 1)).to(qparams.zero_point.dtype))
    want, _ = _reference(args, weight, state, found, 64, 0.01)
    got, codes, _ = gptq(weight, state, spec, block_size=64, actorder="static", qparams=qparams)
    assert (codes == qstats.quantize(want, qparams, spec)).float().mean() >= 0.999
    assert (got - want).abs().max() <= 1e-6


@pytest.mark.parametrize("fields", [dict(num_bits=4, symmetric=False, strategy="group", group_size=32),
                                    dict(num_bits=4, symmetric=True, strategy="channel")], ids=["group", "channel"])
def test_mse_observer_qparams_equal_llm_compressor_mse(fields):
    weight, state = _data(3)
    args = QuantizationArgs(**fields, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.mse(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    found = _llmc_qparams(args, weight, "memoryless_mse", patience=10**6)
    assert torch.equal(ours.scale, found["scale"].reshape(ours.scale.shape))
    _check(args, weight, state, observer="memoryless_mse", patience=10**6)


@pytest.mark.parametrize("actorder", [None, "static"])
def test_nvfp4_tensor_group_equals_llm_compressor(actorder):
    """llm-compressor GPTQs NVFP4 (scale / global scale per column); gptq refused TensorGroup."""
    weight, state = _data(4)
    args = preset_name_to_scheme("NVFP4", ["Linear"]).weights.model_copy(update={"actorder": actorder})
    _check(args, weight, state, block_size=48)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    _, codes, used = gptq(weight, state, spec)  # no qparams: the weight's min/max, one global scale
    assert torch.equal(used.global_scale, _as_qstats(_llmc_qparams(args, weight), spec, weight).global_scale)


@pytest.mark.parametrize("block", [[32, 32], [16, 64], [128, 128], [8, 16], [48, 32], [100, 48]])
def test_fp8_blocks_equal_llm_compressor(block):
    """llm-compressor's BLOCK strategy (FP8_BLOCK): gptq refused blocks narrower than the row."""
    weight, state = _data(5)
    for actorder in (None, "static"):
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=block,
                                actorder=actorder)
        _check(args, weight, state, block_size=64)


def test_mxfp4_and_fp8_channel_equal_llm_compressor():
    weight, state = _data(6)
    _check(preset_name_to_scheme("MXFP4", ["Linear"]).weights.model_copy(update={"actorder": "static"}), weight, state)
    _check(QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"), weight, state)


def test_groups_not_dividing_the_columns_raise():
    weight, state = _data(7)
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=48)
    with pytest.raises(RuntimeError):  # llm-compressor 0.14's weight observer cannot take them either
        _llmc_qparams(args, weight)
    with pytest.raises(ValueError, match="not a multiple of the group size 48"):
        gptq(weight, state, qstats.QuantSpec.from_compressed_tensors(args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_equal_llm_compressor(dtype):
    weight, state = _data(8, dtype=dtype)
    for fields in (dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
                   dict(num_bits=8, symmetric=True, strategy="channel", actorder="static")):
        args = QuantizationArgs(**fields)
        _check(args, weight, state, spec=qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype))


def test_many_dead_columns_and_rank_deficient_hessians():
    weight, state = _data(9, dead=tuple(range(0, IN, 3)))
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32, actorder="static")
    assert not _check(args, weight, state)
    for rows in (1, 16):  # far fewer rows than columns: positive definite only once dampened
        weight, state = _data(10, rows=rows)
        assert not _check(args, weight, state)
        with pytest.warns(UserWarning, match="not positive definite"):
            assert _check(args, weight, state, dampening=0.0)  # both fall back to round-to-nearest


def test_actorder_group_is_refused_by_both():
    with pytest.raises(ValueError, match="removed"):
        QuantizationArgs(num_bits=4, strategy="group", group_size=32, actorder="group")
    weight, state = _data(11)
    with pytest.raises(ValueError, match="removed"):
        gptq(weight, state, qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(32)), actorder="group")


@pytest.mark.parametrize("fields", [
    dict(num_bits=4, symmetric=False, strategy="group", group_size=32, actorder="static"),
    dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
         scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn, actorder="static"),
], ids=["int4-group", "nvfp4"])
def test_vmap_over_experts_equals_a_loop_of_llm_compressor(fields):
    experts, gen = 4, torch.Generator().manual_seed(12)
    weights = torch.randn(experts, 32, 64, generator=gen) * 0.05
    x = torch.randn(120, 64, generator=gen).expand(experts, 120, 64)
    route = (torch.rand(experts, 120, generator=gen) > 0.5).float()
    stacked = qstats.stacked_observer(hessian(), experts)
    states = stacked.update(stacked.init(x), x, route)
    args = QuantizationArgs(**fields)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    founds = [_llmc_qparams(args, weights[e]) for e in range(experts)]
    qparams = [_as_qstats(found, spec, weights[e]) for e, found in enumerate(founds)]
    stacked_qparams = qstats.QParams(*(torch.stack(field) for field in zip(*qparams)))
    got, codes, _ = torch.vmap(lambda w, s, q: gptq(w, s, spec, block_size=32, actorder="static", qparams=q))(
        weights, states, stacked_qparams)
    for e in range(experts):
        one = HessianState(*(field[e] for field in states))
        want, _ = _reference(args, weights[e], one, founds[e], 32, 0.01)
        assert (codes[e] == qstats.quantize(want, qparams[e], spec)).float().mean() >= 0.999
        assert (got[e] - want).abs().max() <= 1e-6
