"""ModelOpt 0.47's preset configs (``mtq.INT8_DEFAULT_CFG``, ...) through ``mtq.quantize`` on CPU, next to
the qstats specs docs/formats.md names for them, and the edges of its integer fake quantizer.

- ``mtq.quantize(model, cfg, forward_loop)`` on a two-Linear model against ``qstats.calibrate`` +
  ``fake_quantized``: every calibrated amax is `qstats.minmax`'s bit for bit, the fake-quantized weights and
  the model's outputs agree to float32 rounding (ModelOpt multiplies by ``maxbound / amax`` and divides by
  it again, qstats multiplies by ``1 / scale`` and by ``scale``). ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``'s
  ``{-1: 128}`` blocks on 200 input features are padded rows: ``PerBlock((1, 128), partial=True)``.
  ``FP8_PER_CHANNEL_PER_TOKEN_CFG``'s dynamic input is a ``Rule(dynamic=True)`` of ``PerToken()``.
- Integer scales: ``get_scaling_factor`` (``amax / maxbound``) is the scale of ``QuantSpec(mapping="narrow",
  eps=finfo(float32).tiny)`` down to channels of amax ``1e-30``; the default ``eps`` floors channels whose
  amax is below ``127 * eps`` (1.5e-5). ModelOpt flushes a channel of amax ``<= 2**-24`` to zero and
  exports scale 1 for an all-zero one.
- ``axis=(0, 1)`` on a Conv weight (one amax per output and input channel) is ``PerBlock((1, 1, kh, kw))``.
- bf16/fp16 weights: codes differ exactly where ``x * maxbound / amax`` is a tie ``k + 0.5`` (ModelOpt's
  ``maxbound / amax`` and qstats' ``1 / (amax / maxbound)`` round to either side of it).
- NVFP4: a tensor of amax below ``2688 * 2**-126`` keeps a subnormal global scale in ModelOpt; qstats
  floors it at ``2**-126`` (docs/differences.md), so its block scales differ there.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export.quant_utils import get_scaling_factor
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

import qstats

pytestmark = pytest.mark.usefixtures("single_thread_quiet")

TINY = torch.finfo(torch.float32).tiny
# the specs docs/formats.md gives for ModelOpt's max-calibrated integer and fp8 quantizers
INT_NARROW = dict(mapping="narrow", eps=TINY)
FP8 = dict(dtype="fp8_e4m3fn", zero_point_domain="none", eps=TINY)


class _TwoLinear(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.up = torch.nn.Linear(features, 96)
        self.down = torch.nn.Linear(96, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _weight(spec):
    return qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax, spec=spec)


def _static_input(spec):
    return qstats.Rule("Linear", sites=("input",), observer=qstats.minmax, spec=spec)


PRESETS = {
    "INT8_DEFAULT_CFG": (64, [_weight(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), **INT_NARROW)),
                              _static_input(qstats.QuantSpec(dtype="int8", **INT_NARROW))]),
    "FP8_DEFAULT_CFG": (64, [_weight(qstats.QuantSpec(**FP8)), _static_input(qstats.QuantSpec(**FP8))]),
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": (64, [
        _weight(qstats.QuantSpec(granularity=qstats.PerAxis(0), **FP8)),
        qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(granularity=qstats.PerToken(), **FP8), dynamic=True)]),
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": (200, [_weight(qstats.QuantSpec(
        dtype="int4", granularity=qstats.PerBlock((1, 128), partial=True), **INT_NARROW))]),
}


def _amax(state):
    return torch.maximum(-state.min_val, state.max_val).reshape(-1)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_config_through_mtq_quantize_is_qstats_calibrate(name):
    features, rules = PRESETS[name]
    torch.manual_seed(0)
    model = _TwoLinear(features).eval()
    batches = [torch.randn(3, 5, features) * (i + 1) for i in range(3)]
    test = torch.randn(2, 4, features)  # within the calibrated ranges: ModelOpt's extra code -128 stays unused
    theirs = mtq.quantize(copy.deepcopy(model), copy.deepcopy(getattr(mtq, name)), lambda m: [m(b) for b in batches])
    recipe = qstats.Recipe(rules)
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with torch.no_grad():
        expected = theirs(test)
        with qstats.fake_quantized(model, qparams, recipe):
            ours = model(test)
            for path in ("up", "down"):
                module, quantized = getattr(theirs, path), getattr(model, path)
                assert torch.equal(module.weight_quantizer.amax.reshape(-1), _amax(states[path]["weight"]))
                if qparams[path].get("input") is not None:  # a static input (dynamic ones have no amax)
                    assert torch.equal(module.input_quantizer.amax.reshape(-1), _amax(states[path]["input"]))
                torch.testing.assert_close(quantized.weight, module.weight_quantizer(module.weight), rtol=2.0**-22, atol=0)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def _max_quantizer(x, **config):
    quantizer = TensorQuantizer(QuantizerAttributeConfig(**config))
    quantizer.enable_calib()
    quantizer.disable_quant()
    with torch.no_grad():
        quantizer(x)
    quantizer.load_calib_amax()
    quantizer.disable_calib()
    quantizer.enable_quant()
    return quantizer


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def test_int_scales_of_tiny_zero_and_flushed_channels():
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1.0, 1e-3, 1e-5, 1e-6, 1e-8, 1e-12, 1e-30, 0.0])
    x = torch.randn(8, 64, generator=g) * magnitudes[:, None]
    quantizer = _max_quantizer(x, num_bits=8, axis=0, narrow_range=True)
    exported = get_scaling_factor(quantizer).reshape(-1)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), **INT_NARROW)
    qp = _observe(spec, x)
    assert torch.equal(exported[:-1], qp.scale[:-1])
    assert exported[-1] == 1 and qp.scale[-1] == TINY  # all-zero channel: ModelOpt exports 1
    default_eps = qstats.QuantSpec(dtype="int8", mapping="narrow", granularity=qstats.PerAxis(0))
    floored = _observe(default_eps, x).scale != exported
    assert floored.tolist() == [False, False, False, True, True, True, True, True]  # amax < 127 * eps

    with torch.no_grad():
        expected = quantizer(x)
    ours = qstats.fake_quantize(x, qp, spec)
    flushed = quantizer.amax.reshape(-1) <= 2.0**-24  # ModelOpt: every value of such a channel 0
    assert flushed.tolist() == [False] * 4 + [True] * 4
    assert not expected[flushed].any() and ours[4:7].count_nonzero() > 0
    torch.testing.assert_close(ours[~flushed], expected[~flushed], rtol=2.0**-22, atol=0)


def test_conv_axis_0_1_is_per_block_of_the_kernel():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 4, 3, 3, generator=g) * torch.logspace(-2, 2, 4)[None, :, None, None]
    quantizer = _max_quantizer(w, num_bits=8, axis=(0, 1), narrow_range=True)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerBlock((1, 1, 3, 3)), **INT_NARROW)
    qp = _observe(spec, w)
    assert torch.equal(get_scaling_factor(quantizer).reshape(6, 4), qp.scale.reshape(6, 4))
    with torch.no_grad():
        codes = torch.round(quantizer(w) / qp.scale)
    assert torch.equal(codes, qstats.quantize(w, qp, spec).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_weights_differ_only_at_exact_ties(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 512, generator=g).to(dtype)
    for bits, config, granularity in ((8, {"axis": 0}, qstats.PerAxis(0)),
                                      (4, {"block_sizes": {-1: 128}}, qstats.PerGroup(128))):
        quantizer = _max_quantizer(w, num_bits=bits, narrow_range=True, **config)
        spec = qstats.QuantSpec(dtype=f"int{bits}", granularity=granularity, **INT_NARROW)
        qp = _observe(spec, w)
        with torch.no_grad():
            differ = quantizer(w) != qstats.fake_quantize(w, qp, spec)
        maxbound = 2 ** (bits - 1) - 1
        blocks = quantizer.amax.numel() // 256
        amax = quantizer.amax.double().reshape(256, blocks, 1).expand(256, blocks, 512 // blocks).reshape(w.shape)
        exact = w.double() * maxbound / amax
        ties = exact - exact.floor() == 0.5
        assert differ.any() and bool(ties[differ].all())


def test_nvfp4_global_scale_of_a_tiny_tensor_is_floored():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    spec = qstats.preset("nvfp4")
    for amax, floored in ((1e-30, False), (1e-36, True)):
        tiny = x / x.abs().max() * amax
        _, block_scales, global_scale = NVFP4QTensor.quantize(tiny.clone(), 16)
        qp = _observe(spec, tiny)
        assert bool(qp.global_scale != global_scale) == floored
        if floored:  # ModelOpt: amax / 2688, subnormal; qstats: 2**-126
            assert 0 < global_scale < TINY == qp.global_scale
        else:
            assert torch.equal(block_scales.float(), qp.scale)


@pytest.mark.parametrize("magnitude", [1.0, 1e-5])
def test_fp8_qtensor_of_fp16_weights_is_fp16_arithmetic(magnitude):
    # as for bf16 (test_modelopt_formats): ModelOpt computes amax / 448 and x / scale in the weight's dtype
    from modelopt.torch.quantization.qtensor import FP8QTensor

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 256, generator=g) * magnitude).half()  # 1e-5: fp16 subnormal scales
    packed, scale = FP8QTensor.quantize(x.clone())
    spec = qstats.QuantSpec(convention="compressed_tensors", compute_dtype="float16", **FP8)
    qp = _observe(spec, x)
    assert scale.dtype == torch.float16 and torch.equal(qp.scale.reshape(()), scale.float().reshape(()))
    codes = qstats.quantize(x, qp, spec)
    # equal values; the bytes differ where x is -0.0 (ModelOpt keeps the sign, compressed-tensors' +0.0 drops it)
    assert torch.equal(codes.float(), packed._quantized_data.float())
    assert torch.equal(qstats.fake_quantize(x, qp, spec), packed.dequantize(torch.float16, scale=scale))
    fp32_arithmetic = qstats.QuantSpec(**FP8)
    assert not torch.equal(qstats.quantize(x, _observe(fp32_arithmetic, x), fp32_arithmetic), codes)


def test_gradients_against_modelopts_straight_through():
    # ModelOpt 0.47 passes every gradient (pass_through_bwd=True, its default) or, with pass_through_bwd=False,
    # those of |x| <= amax; qstats passes those whose unclamped code lies in the range: for fp8 |x| <= amax,
    # for int8 narrow also (amax, 127.5 / 127 * amax), which rounds to code 127
    x = torch.tensor([0.5, 1.0, 1.002, 1.0039, 1.0041, 2.0, -1.002, -1.0041])
    inside = x.abs() <= 1.0
    for bits, spec in (((4, 3), qstats.QuantSpec(**FP8)), (8, qstats.QuantSpec(dtype="int8", **INT_NARROW))):
        grads = {}
        for pass_through in (True, False):
            quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=bits, narrow_range=True,
                                                                 pass_through_bwd=pass_through))
            quantizer.amax = torch.tensor(1.0)
            given = x.clone().requires_grad_()
            quantizer(given).sum().backward()
            grads[pass_through] = given.grad
        assert bool((grads[True] == 1).all()) and torch.equal(grads[False], inside.float())
        given = x.clone().requires_grad_()
        qstats.fake_quantize(given, qstats.qparams_from_minmax(-torch.tensor(1.0), torch.tensor(1.0), spec), spec).sum().backward()
        rounds_inside = inside | ((x.abs() < 127.5 / 127) if bits == 8 else torch.zeros_like(inside))
        assert torch.equal(given.grad, rounds_inside.float())
