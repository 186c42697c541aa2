"""Histogram range searches on data whose grid steps lie below float32's eps (1.19e-7).

torch.ao's scale floor is the spec's ``eps`` (``QuantSpec.from_torch_ao(..., eps=1e-12)``, as for
``HistogramObserver(eps=1e-12)``); compressed-tensors floors only a zero scale. The searches rank
their candidates with that floor, so a Gaussian of std 1e-8 keeps its resolution: the error of the
chosen range is compared with torch.ao's own ``HistogramObserver`` and with compressed-tensors' own
min/max qparams and fake quantization (float32 and float16 computation).
"""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from torch.ao.quantization import HistogramObserver

import qstats


def _relative_error(quantized: torch.Tensor, x: torch.Tensor) -> float:
    return float((quantized.double() - x.double()).norm() / x.double().norm())


def _histogram_state(spec, x):
    obs = qstats.histogram(spec)
    return obs.update(obs.init(x), x)


@pytest.mark.parametrize("std", [1e-8, 1e-9])
@pytest.mark.parametrize(
    "dtype, qscheme, qrange",
    [(torch.quint8, torch.per_tensor_affine, (0, 255)), (torch.qint8, torch.per_tensor_symmetric, (-128, 127))],
)
def test_l2_range_with_a_small_eps_quantizes_as_torch_ao_histogram_observer(std, dtype, qscheme, qrange):
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * std
    reference = HistogramObserver(dtype=dtype, qscheme=qscheme, eps=1e-12)
    reference(x)
    ref_scale, ref_zero_point = reference.calculate_qparams()
    ref_error = _relative_error(
        torch.fake_quantize_per_tensor_affine(x, float(ref_scale), int(ref_zero_point), *qrange), x
    )

    spec = qstats.QuantSpec.from_torch_ao(dtype, qscheme, eps=1e-12)
    qp = qstats.compute_qparams(_histogram_state(spec, x), spec, method="l2")
    error = _relative_error(torch.fake_quantize_per_tensor_affine(x, float(qp.scale), int(qp.zero_point), *qrange), x)
    assert ref_error < 0.02
    assert error <= 1.05 * ref_error


@pytest.mark.parametrize("method", ["l2", "mse"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype, std", [(torch.float32, 1e-8), (torch.float16, 1e-4), (torch.float16, 1e-2)])
def test_searched_range_of_a_compressed_tensors_spec_at_small_scale(method, symmetric, dtype, std):
    # float16 computes scales in float16, where the narrowest range's scale underflows to 0 and takes
    # float16's eps: the searches must not read that as a floor of every scale
    args = QuantizationArgs(num_bits=8, symmetric=symmetric, strategy="tensor")
    x = (torch.randn(2000, generator=torch.Generator().manual_seed(1)) * std).to(dtype)
    # compressed-tensors' own qparams of the observed range, and its fake quantization
    ref_scale, ref_zero_point = calculate_qparams(x.min().reshape(1), x.max().reshape(1), args)
    ref_error = _relative_error(fake_quantize(x, ref_scale, ref_zero_point, args), x)

    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    qp = qstats.compute_qparams(_histogram_state(spec, x), spec, method=method)
    error = _relative_error(qstats.fake_quantize(x, qp, spec), x)
    assert ref_error < 0.02
    assert error <= 1.05 * ref_error
