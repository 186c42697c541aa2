"""`QuantSpec.from_torchao` of float8 arguments whose ``float8_dtype`` / ``weight_dtype`` is no float8
dtype: torchao fails on them (``quantize_`` raises); qstats raised a bare ``KeyError: torch.int8``."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

quant_api = pytest.importorskip("torchao.quantization")
float8_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")


def test_float8_weight_only_config_of_an_integer_dtype_is_refused_naming_it():
    config = quant_api.Float8WeightOnlyConfig(weight_dtype=torch.int8)
    with pytest.raises(TypeError):  # torchao: torch.finfo() of torch.int8
        quant_api.quantize_(torch.nn.Linear(64, 8), config)
    with pytest.raises(ValueError, match="from_torchao: float8 dtype torch.int8 is not one of"):
        qstats.QuantSpec.from_torchao(config)


@pytest.mark.parametrize("dtype", (torch.int8, torch.float8_e8m0fnu), ids=str)
def test_float8_kwargs_of_another_dtype_are_refused_naming_it(dtype):
    """torchao's Float8Tensor.from_hp fails on int8 and takes e8m0 elements (powers of two; differences.md)."""
    kwargs = float8_tensor.QuantizeTensorToFloat8Kwargs(float8_dtype=dtype)
    if dtype == torch.int8:
        with pytest.raises(TypeError):
            float8_tensor.Float8Tensor.from_hp(torch.randn(8, 64), dtype)
    with pytest.raises(ValueError, match=f"from_torchao: float8 dtype {dtype} is not one of"):
        qstats.QuantSpec.from_torchao(kwargs)
