"""Symmetric integer peaks near float32's limit (`qstats._qparams._clipped`): every code of the
scale dequantizes to a finite float32, for every bit width and for torchao's bfloat16 arithmetic
(peak and scale computed in the input's dtype, which may round them up); below the clip the scale
is torchao's ``choose_qparams_affine``'s, bit for bit."""

import warnings

import pytest
import torch

import qstats

F32_MAX = torch.finfo(torch.float32).max
PEAKS = [1.0, 1e37, 1e38, 1.7e38, 2e38, 2.5e38, 3e38, 3.3e38, 3.39e38, F32_MAX]


def _dequantized_ends(qp, spec):
    """The float32 values of the lowest and the highest code."""
    scale, zero_point = qp.scale.float(), qp.zero_point.float()
    return torch.stack([(spec.qmin - zero_point) * scale, (spec.qmax - zero_point) * scale])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8, 12, 16])
def test_torchao_bfloat16_codes_of_huge_symmetric_peaks_stay_finite(bits, scale_dtype):
    """int8 under input_dtype=bfloat16 with a peak of 2e38 or more: the peak and its scale round up
    in bfloat16 (2.658e36), code -128 dequantized to -3.40e38, past float32 (-Inf); the clip's
    margin for half-precision scales now covers half-precision compute dtypes too."""
    primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    kwargs = dict(mapping_type=primitives.MappingType.SYMMETRIC, block_size=(1, 2), shape=(1, 2), quant_min=qmin,
                  quant_max=qmax, input_dtype=torch.bfloat16, scale_dtype=scale_dtype, zero_point_dtype=torch.int32)
    spec = qstats.QuantSpec.from_torchao(torch.int32, **kwargs)
    for peak in PEAKS:
        for low, high in ((-0.5, peak), (-peak, 0.5)):
            qp = qstats.qparams_from_minmax(torch.tensor([low]), torch.tensor([high]), spec)
            assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all(), (peak, qp.scale)
            assert torch.isfinite(_dequantized_ends(qp, spec)).all(), (peak, qp.scale)
            x = torch.tensor([[low, high]]).to(torch.bfloat16)
            if peak > 3e38 or not torch.isfinite(x).all():
                continue  # within the clip's margin of float32's limit: clipped (docs/differences.md)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scale, _ = primitives.choose_qparams_affine(x, primitives.MappingType.SYMMETRIC, (1, 2), torch.int32,
                                                            qmin, qmax, scale_dtype=scale_dtype,
                                                            zero_point_dtype=torch.int32)
            ends = torch.stack([qmin * scale.float(), qmax * scale.float()])
            if torch.isfinite(ends).all():  # torchao's own codes dequantize finite: its scale
                assert torch.equal(qp.scale.reshape(-1), scale.float().reshape(-1)), (peak, qp.scale, scale)


@pytest.mark.parametrize("peak", [1.0, 100.0, 6e4, 1e6, 1e7, 1e30])
def test_compressed_tensors_scale_dtype_of_the_other_half_precision(peak):
    """A float16 scale computed in bfloat16: compressed-tensors' own clamp to 65504 rounds up to
    65536 in bfloat16, an Inf float16 scale (qstats' was too); qstats now saturates at 65280, the
    largest value both hold, and equals compressed-tensors wherever its scale is finite. A bfloat16
    scale computed in float16 raised RuntimeError (bfloat16's largest value does not convert to
    float16; compressed-tensors raises the same): against its arithmetic without that clamp."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    for compute, scale_dtype in ((torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
        low, high = torch.tensor([-0.5]).to(compute), torch.tensor([peak]).to(compute)
        if not torch.isfinite(high).all():
            continue
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", scale_dtype=scale_dtype)
        spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=compute)
        ours = qstats.qparams_from_minmax(low.float(), high.float(), spec).scale
        assert torch.isfinite(ours.to(scale_dtype)).all() and (ours > 0).all(), (compute, ours)
        if compute == torch.float16:
            expected = (high / torch.tensor(127.5, dtype=compute)).to(scale_dtype)
        else:
            expected, _ = calculate_qparams(low, high, args)
            if not torch.isfinite(expected).all():
                assert float(ours) == 65280.0
                continue
        assert torch.equal(ours, expected.float()), (compute, ours, expected)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_no_clipping_error_peaks_keep_every_code_finite_and_equal_torchao_below(bits):
    """``symmetric_no_clipping_err`` scales a positive peak over ``qmax`` steps while code ``qmin``
    lies one step farther: int8 peaks of 3.378e38 gave a scale whose code -128 dequantized to -Inf
    (the clip assumed the symmetric mapping's 127.5 steps). Below the clip the scale is torchao's
    ``choose_qparams_affine`` with ``SYMMETRIC_NO_CLIPPING_ERR``, bit for bit."""
    primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    mapping = primitives.MappingType.SYMMETRIC_NO_CLIPPING_ERR
    spec = qstats.QuantSpec.from_torchao(torch.int32, mapping_type=mapping, quant_min=qmin, quant_max=qmax,
                                         zero_point_dtype=torch.int32)
    for peak in [*PEAKS, 3.378e38]:
        for low, high in ((-0.5, peak), (-peak, 0.5), (-peak, peak)):
            qp = qstats.qparams_from_minmax(torch.tensor([low]), torch.tensor([high]), spec)
            assert torch.isfinite(_dequantized_ends(qp, spec)).all(), (peak, qp.scale)
            scale, _ = primitives.choose_qparams_affine(torch.tensor([[low, high]]), mapping, (1, 2), torch.int32,
                                                        qmin, qmax, zero_point_dtype=torch.int32)
            if torch.isfinite(torch.stack([qmin * scale, qmax * scale])).all() and peak < 3e38:
                # torchao's own codes dequantize finite (and outside the clip's margin): its scale
                assert torch.equal(qp.scale.reshape(-1), scale.float().reshape(-1)), (peak, qp.scale, scale)
