"""What the torch_ao convention (QuantSpec's default) accepts: torch.ao's fixed symmetric zero points
only where torch.ao's observers build them, and float32 computation only.

References: torch.ao's observers (their ``calculate_qparams``), which give a symmetric signed target
the zero point 0 and compute in float32 whatever the input's dtype."""

import pytest
import torch
from torch.ao.quantization import HistogramObserver, MinMaxObserver

import qstats


@pytest.mark.parametrize("dtype", ["int4", "int8", "uint4"])
def test_a_fixed_zero_point_outside_a_range_torch_ao_never_pairs_it_with_is_refused(dtype):
    # before: accepted, compute_qparams returned zero point 128 outside the range and quantize raised later
    with pytest.raises(ValueError, match=r"symmetric_zero_point 128 lies outside the range"):
        qstats.QuantSpec(dtype=dtype, symmetric_zero_point=128)


@pytest.mark.parametrize("dtype", ["int4", "int8", "int16"])
def test_uint16s_fixed_zero_point_on_a_signed_range_is_refused(dtype):
    # torch.ao gives 2**15 to torch.uint16 only, whose ranges are unsigned; a signed target's is 0
    with pytest.raises(ValueError, match=r"symmetric_zero_point 32768 lies outside the range"):
        qstats.QuantSpec(dtype=dtype, symmetric_zero_point=2**15)


def test_quint8_reduced_range_keeps_torch_ao_histogram_observer_zero_point_128():
    # codes 0-127 with zero point 128: HistogramObserver builds it (MinMaxObserver refuses it)
    theirs = HistogramObserver(dtype=torch.quint8, qscheme=torch.per_tensor_symmetric, reduce_range=True)
    theirs(torch.randn(64))
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_symmetric, reduce_range=True)
    assert spec.qrange == (theirs.quant_min, theirs.quant_max) == (0, 127)
    assert spec.symmetric_zero_point == int(theirs.calculate_qparams()[1]) == 128


@pytest.mark.parametrize("dtype, reduce_range, quant_range", [
    (torch.uint16, False, (None, None)),    # zero point 2**15
    (torch.uint16, False, (0, 1000)),       # 2**15 outside a custom range
])
def test_the_fixed_zero_points_torch_ao_builds_still_equal_its_qparams(dtype, reduce_range, quant_range):
    quant_min, quant_max = quant_range
    x = torch.randn(64) * 3
    theirs = MinMaxObserver(dtype=dtype, qscheme=torch.per_tensor_symmetric, reduce_range=reduce_range,
                            quant_min=quant_min, quant_max=quant_max)
    theirs(x)
    scale, zero_point = theirs.calculate_qparams()
    spec = qstats.QuantSpec.from_torch_ao(dtype, torch.per_tensor_symmetric, reduce_range=reduce_range,
                                          quant_min=quant_min, quant_max=quant_max)
    obs = qstats.minmax(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    assert torch.equal(ours.scale.reshape(-1), scale) and torch.equal(ours.zero_point.reshape(-1).long(), zero_point.long())


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float16"])
def test_a_half_precision_compute_dtype_is_refused_as_torch_ao_computes_in_float32(compute_dtype):
    # before: accepted and ignored: the qparams of a bf16 input were torch.ao's float32 ones, not bf16 ones
    x = torch.randn(64).bfloat16()
    theirs = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    theirs(x)
    assert theirs.calculate_qparams()[0].dtype == torch.float32
    with pytest.raises(ValueError, match=rf"compute_dtype '{compute_dtype}': the torch_ao convention computes in float32"):
        qstats.QuantSpec(dtype="int8", compute_dtype=compute_dtype)
    # the conventions that compute in it take it
    qstats.QuantSpec(dtype="int8", compute_dtype=compute_dtype, convention="compressed_tensors")
