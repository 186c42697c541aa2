"""`qstats.report`'s ``sqnr_db`` against torch.ao's numeric suite (``torch.ao.ns.fx.utils.compute_sqnr``,
``20 log10(|x| / |x - y|)``) of the tensor and compressed-tensors' fake-quantized tensor: weights of
float32, bfloat16 and float16 models under per-channel, per-group, per-block and NVFP4 schemes, and
an input site over several batches (one SQNR of all of them together). An all-zero tensor is the
one deliberate difference: torch.ao's 0/0 is NaN, the report's +inf (no error)."""

import math
import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")
ns_utils = pytest.importorskip("torch.ao.ns.fx.utils")
quantization = pytest.importorskip("compressed_tensors.quantization")
forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
schemes = pytest.importorskip("compressed_tensors.quantization.quant_scheme")

ARGS = {
    "int8_channel": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "int4_group": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    "fp8_block": dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[16, 16]),
    "nvfp4": None,
}


def _args(name):
    if ARGS[name] is None:
        return schemes.NVFP4["weights"]
    return quantization.QuantizationArgs(**ARGS[name])


def _fake_quantized(x, qp, args):
    """compressed-tensors' fake quantization of ``x``, rounded to ``x``'s dtype (as a model stores it)."""
    scale, zero_point = qp.scale, qp.zero_point
    if args.strategy == "channel":
        scale, zero_point = scale[:, None], zero_point[:, None]
    global_scale = qp.global_scale.reshape(1) if args.strategy == "tensor_group" else None
    return forward.fake_quantize(x, scale, zero_point, args, global_scale=global_scale).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(ARGS))
def test_weight_sqnr_is_torch_ao_ns_compute_sqnr(name, dtype):
    args = _args(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40)).to(dtype).eval()  # 40 rows: a partial 16x16 block
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(2, 48, dtype=dtype)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams, model, recipe).rows
    weight = model[0].weight.detach()
    quantized = _fake_quantized(weight, qparams["0"]["weight"], args)
    expected = float(ns_utils.compute_sqnr(weight.float(), quantized.float()))  # it takes float32 only
    assert math.isfinite(expected) and row.sqnr_db == pytest.approx(expected, rel=1e-5)


def test_input_sqnr_over_batches_is_compute_sqnr_of_all_of_them():
    args = quantization.QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)])
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(6, 8, generator=generator)]
    held_out = [torch.randn(5, 8, generator=generator) * (1 + i) for i in range(3)]  # some values clipped
    states = qstats.calibrate(model, calibration, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams, model, recipe, held_out).rows
    qp = qparams["0"]["input"]
    x = torch.cat(held_out)
    quantized = forward.fake_quantize(x, qp.scale.reshape(1), qp.zero_point.reshape(1), args)
    assert row.sqnr_db == pytest.approx(float(ns_utils.compute_sqnr(x, quantized)), rel=1e-5)
    assert row.clipped_fraction > 0


def test_an_all_zero_weight_is_inf_where_torch_ao_ns_gives_nan():
    model = torch.nn.Sequential(torch.nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[0].weight.zero_()
    recipe = qstats.Recipe.from_scheme("W8A8")
    states = qstats.calibrate(model, [torch.randn(2, 16)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    rows = {row.site: row for row in qstats.report(states, qparams, model, recipe)}
    weight = model[0].weight.detach()
    assert math.isnan(float(ns_utils.compute_sqnr(weight, weight)))
    assert rows["weight"].sqnr_db == math.inf and rows["weight"].clipped_fraction == 0.0
