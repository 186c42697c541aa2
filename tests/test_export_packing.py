"""The packing of `qstats.export.packing` against compressed-tensors' own: int32 words of 1-8 bit
codes (``pack_to_int32``, along rows and, for zero points, along columns) and bytes of two fp4 codes
(``pack_fp4_to_uint8``), on shapes of no rows, one row and odd widths; and a Linear without outputs
exported and loaded back by compressed-tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _shared import bit_equal

import qstats
from qstats.export.packing import pack_fp4, pack_int32

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, apply_quantization_config  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SHAPES = [(0, 32), (0, 7), (1, 1), (1, 33), (3, 17), (5, 64), (4, 0)]


@pytest.mark.parametrize("num_bits", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES)
def test_int32_words_equal_compressed_tensors_pack_to_int32(num_bits, shape):
    generator = torch.Generator().manual_seed(num_bits)
    low = -(2 ** (num_bits - 1))
    codes = torch.randint(low, -low, shape, generator=generator, dtype=torch.int8)
    ours = pack_int32(codes, num_bits)
    assert bit_equal(ours, pack_to_int32(codes, num_bits))
    # zero points are packed along the output dimension (packed_dim=0)
    assert bit_equal(pack_int32(codes.t(), num_bits).t(), pack_to_int32(codes, num_bits, packed_dim=0))


@pytest.mark.parametrize("shape", [(0, 16), (1, 2), (3, 34)])
def test_fp4_bytes_equal_compressed_tensors_pack_fp4_to_uint8(shape):
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    generator = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    index = torch.randint(0, 16, shape, generator=generator)
    values = grid[index % 8] * torch.where(index >= 8, -1.0, 1.0)
    codes = (index % 8) | torch.where(index >= 8, 8, 0)  # fp4 e2m1 bits: sign in bit 3
    assert bit_equal(pack_fp4(codes), pack_fp4_to_uint8(values))


class NoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = torch.nn.Linear(32, 0)  # e.g. every head of a projection pruned
        self.full = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.empty(x), self.full(x)


@pytest.mark.parametrize("args", [
    QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
    QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    QuantizationArgs(num_bits=3, type="int", symmetric=False, strategy="channel"),
], ids=["int8-channel", "int4-group-asym", "int3-channel-asym"])
def test_a_linear_without_outputs_exports_and_loads_with_compressed_tensors(tmp_path, args):
    torch.manual_seed(0)
    model = NoOutputs().eval()
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert written["format"] == "pack-quantized"
    with open(os.path.join(str(tmp_path), "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    torch.manual_seed(1)
    fresh = NoOutputs().eval()
    apply_quantization_config(fresh, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    fresh.load_state_dict(load_file(os.path.join(str(tmp_path), "model.safetensors")), strict=True)
    compressor.decompress_model(fresh)
    assert fresh.empty.weight.shape == (0, 32)
    qp, full_spec = qparams["full"]["weight"], recipe.specs(qparams, model)["full"]["weight"]
    expected = qstats.dequantize(qstats.quantize(model.full.weight, qp, full_spec), qp, full_spec)
    assert bit_equal(fresh.full.weight.data, expected)
