"""`QuantSpec.from_torchao` of a ``QuantizeTensorToInt8Kwargs`` / ``QuantizeTensorToFloat8Kwargs``
whose granularity is None: torchao's ``Int8Tensor.from_hp`` / ``Float8Tensor.from_hp`` raise
"Unsupported Granularity: None"; qstats gave a per-tensor spec, quantizing as torchao never does."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

int8_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.int8.int8_tensor")
float8_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")


def test_int8_kwargs_without_granularity_are_refused_as_int8_tensor_refuses_them():
    kwargs = int8_tensor.QuantizeTensorToInt8Kwargs(granularity=None)
    with pytest.raises(ValueError, match="Unsupported Granularity: None"):
        int8_tensor.Int8Tensor.from_hp(torch.randn(8, 64), kwargs.granularity, mapping_type=kwargs.mapping_type)
    with pytest.raises(ValueError, match="from_torchao: QuantizeTensorToInt8Kwargs needs a granularity"):
        qstats.QuantSpec.from_torchao(kwargs)


def test_float8_kwargs_without_granularity_are_refused_as_float8_tensor_refuses_them():
    kwargs = float8_tensor.QuantizeTensorToFloat8Kwargs(float8_dtype=torch.float8_e4m3fn, granularity=None)
    with pytest.raises(ValueError, match="Unsupported Granularity: None"):
        float8_tensor.Float8Tensor.from_hp(torch.randn(8, 64), kwargs.float8_dtype, kwargs.granularity)
    with pytest.raises(ValueError, match="from_torchao: QuantizeTensorToFloat8Kwargs needs a granularity"):
        qstats.QuantSpec.from_torchao(kwargs)
