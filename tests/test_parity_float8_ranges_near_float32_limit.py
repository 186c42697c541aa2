"""Float8 targets on float32 values near float32's largest value, against compressed-tensors and torchao.

compressed-tensors' asymmetric float8 (``type="float", symmetric=False``) divides the span ``max - min``
by 896: a row spanning more than float32 holds ([-3e38, 3e38]) gets an Inf scale there and every
fake-quantized value NaN. qstats clips such a span to half of float32's range, as it does for integer
targets, so the scale is compressed-tensors' own scale of that clipped range. torchao's float8 scale in
bfloat16 (``input_dtype=torch.bfloat16``) rounds ``amax / 240`` up for e4m3fnuz, so its largest code
dequantizes past float32 (Inf) for a float32 input: qstats' values saturate at float32's largest value
and equal torchao's everywhere else.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
llmc_observers = pytest.importorskip("llmcompressor.observers")
qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from torchao.quantization import granularity as tao_granularity  # noqa: E402

FLOAT32_MAX = torch.finfo(torch.float32).max


def _observed(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _rows(peaks, columns=32):
    """One row per peak: ``peak``, ``-0.9 * peak`` and small values between."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(len(peaks), columns, generator=g)
    peaks = torch.tensor(peaks, dtype=torch.float32)[:, None]
    rows[:, 0:1], rows[:, 1:2] = peaks, -0.9 * peaks
    return rows


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_asymmetric_float8_spans_past_float32(strategy):
    peaks = [FLOAT32_MAX, 3e38, 1.8e38, 1.7e38, 1e38, 1.0] if strategy == "channel" else [2e38]
    weight = _rows(peaks)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=False, strategy=strategy)
    observer = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    reference = observer.get_qparams()
    theirs_scale, theirs_zero_point = reference["scale"].reshape(-1), reference["zero_point"].reshape(-1)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=torch.float32)
    qp = _observed(spec, weight)
    ours = qstats.fake_quantize(weight, qp, spec)
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all() and torch.isfinite(ours).all()
    theirs = ct_forward.fake_quantize(weight, reference["scale"], reference["zero_point"], args)
    finite = torch.isfinite(theirs_scale)
    assert not finite.all()  # the rows this test is for: compressed-tensors' scale is Inf, its values NaN
    rows = finite if strategy == "channel" else finite.expand(len(peaks))
    assert torch.equal(qp.scale.reshape(-1)[finite], theirs_scale[finite])
    assert torch.equal(qp.zero_point.reshape(-1).float()[finite], theirs_zero_point[finite].float())
    assert torch.equal(ours[rows], theirs[rows])
    assert torch.isnan(theirs[~rows]).all()
    # the overflowing rows: compressed-tensors' own qparams of the range clipped to half of float32's
    half = FLOAT32_MAX / 2
    reduce = dict(dim=-1, keepdim=True) if strategy == "channel" else {}
    clipped_min = weight.amin(**reduce).clamp(min=-half)
    clipped_max = weight.amax(**reduce).clamp(max=half)
    scale, zero_point = calculate_qparams(clipped_min, clipped_max, args)
    assert torch.equal(qp.scale.reshape(-1)[~finite], scale.reshape(-1)[~finite])
    assert torch.equal(qp.zero_point.reshape(-1).float()[~finite], zero_point.reshape(-1)[~finite].float())
    clipped_values = ct_forward.fake_quantize(weight, scale.reshape(reference["scale"].shape),
                                              zero_point.reshape(reference["zero_point"].shape), args)
    assert torch.equal(ours[~rows], clipped_values[~rows])


@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn, torch.float8_e5m2fnuz])
def test_bfloat16_float8_scales_of_float32_inputs_at_the_limit(float8_dtype):
    """A spec for bf16 inputs (``input_dtype=torch.bfloat16``: scales held in bfloat16) given float32
    values past bfloat16's range: the scale is torchao's float32 ``amax / max`` held in bfloat16, the
    codes and values torchao's ``_quantize_affine_float8`` / ``_dequantize_affine_float8`` of it; where
    that rounds up past float32 (e4m3fnuz: 240 * bfloat16(3.402e38 / 240) is Inf) qstats saturates."""
    x = _rows([3.402e38, 3.4025e38, 3.3e38, 1e38, 1.0])
    spec = qstats.QuantSpec.from_torchao(float8_dtype, granularity=tao_granularity.PerRow(), input_dtype=torch.bfloat16)
    scale = qp_lib._choose_scale_float8(x, [1, x.shape[1]], float8_dtype).to(torch.bfloat16).float()
    codes = qp_lib._quantize_affine_float8(x, scale, float8_dtype)
    theirs = qp_lib._dequantize_affine_float8(codes, scale, torch.float32)
    qp = _observed(spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qstats.quantize(x, qp, spec).view(torch.uint8), codes.view(torch.uint8))
    for ours in (qstats.fake_quantize(x, qp, spec), qstats.dequantize(qstats.quantize(x, qp, spec), qp, spec)):
        assert torch.isfinite(ours).all()
        finite = torch.isfinite(theirs)
        assert torch.equal(ours[finite], theirs[finite])
        assert torch.equal(ours[~finite], theirs[~finite].sign() * FLOAT32_MAX)
    if float8_dtype == torch.float8_e4m3fnuz:
        assert not torch.isfinite(theirs).all()  # the case this test is for
