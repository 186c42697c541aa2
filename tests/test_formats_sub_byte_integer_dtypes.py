"""Sub-byte integer dtypes (torch.int1-int7, uint1-uint7) given where qstats takes a plain integer
dtype: a ValueError naming the argument, not torch.iinfo's TypeError from inside qstats."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams

import qstats
from qstats._formats import integer_dtype_holds
from qstats.torch_ao import QstatsObserver

SUB_BYTE = [getattr(torch, f"{kind}{bits}") for kind in ("int", "uint") for bits in range(1, 8)]


@pytest.mark.parametrize("zp_dtype", [torch.int4, torch.uint4, torch.int2])
def test_compressed_tensors_sub_byte_zp_dtype_is_refused_by_name(zp_dtype):
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, zp_dtype=zp_dtype)
    # compressed-tensors cannot compute qparams with it either (its zero point is rounded through iinfo)
    with pytest.raises(TypeError):
        calculate_qparams(torch.tensor([-1.0]), torch.tensor([2.0]), args)
    with pytest.raises(ValueError, match="zp_dtype"):
        qstats.QuantSpec.from_compressed_tensors(args)


def test_compressed_tensors_plain_zp_dtype_still_taken():
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, zp_dtype=torch.int8)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    lo, hi = torch.tensor([-1.0]), torch.tensor([2.0])
    scale, zero_point = calculate_qparams(lo, hi, args)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(torch.tensor([-1.0, 2.0])), torch.tensor([-1.0, 2.0])), spec)
    assert torch.equal(qp.scale.reshape(-1), scale.reshape(-1).float())
    assert torch.equal(qp.zero_point.reshape(-1).to(torch.int64), zero_point.reshape(-1).to(torch.int64))


def test_torch_ao_observer_sub_byte_dtype_beside_spec_is_refused_by_name():
    with pytest.raises(ValueError, match="dtype torch.int4"):
        QstatsObserver(dtype=torch.int4, spec=qstats.QuantSpec(dtype="int4"))


@pytest.mark.parametrize("dtype", SUB_BYTE)
def test_integer_dtype_holds_is_false_for_sub_byte_dtypes(dtype):
    assert integer_dtype_holds(dtype, (0, 1)) is False
