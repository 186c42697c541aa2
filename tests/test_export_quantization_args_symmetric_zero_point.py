"""`qstats.export.quantization_args` of a symmetric spec whose zero point, moved onto compressed-tensors'
signed range, is not 0 (``symmetric_zero_point``): compressed-tensors' symmetric args always quantize
around zero (its ``calculate_qparams`` gives zero points of 0), so the args would describe another
quantization than the spec's. It is refused, naming the field, as its docstring promises for every spec
compressed-tensors cannot express (it returned the symmetric args); an unsigned symmetric spec centred
as compressed-tensors centres it stays exportable."""

from __future__ import annotations

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402


def _zero_point_of(args: dict) -> torch.Tensor:
    """compressed-tensors' zero point for ``args`` over a range of [-1, 2]."""
    _, zero_point = calculate_qparams(torch.tensor([-1.0]), torch.tensor([2.0]), QuantizationArgs(**args))
    return zero_point


@pytest.mark.parametrize("dtype,zero", [("int8", 1), ("int8", -3), ("uint8", 100), ("int4", 2)])
def test_a_symmetric_zero_point_compressed_tensors_cannot_express_is_refused(dtype, zero):
    spec = qstats.QuantSpec(dtype=dtype, granularity=qstats.PerAxis(0), symmetric_zero_point=zero)
    offset = 0 if spec.is_signed else -(2 ** (spec.bits - 1))
    assert spec.zero_point_of_symmetric + offset != 0
    assert _zero_point_of(dict(num_bits=spec.bits, type="int", symmetric=True, strategy="channel")) == 0
    with pytest.raises(ValueError, match="symmetric_zero_point"):
        qstats.export.quantization_args(spec, "weight")


def test_an_unsigned_symmetric_spec_centred_as_compressed_tensors_centres_it_exports():
    spec = qstats.QuantSpec(dtype="uint8", granularity=qstats.PerAxis(0))  # zero point 128: 0 once signed
    args = qstats.export.quantization_args(spec, "weight")
    assert args["symmetric"] and _zero_point_of(args) == 0
