"""from_compressed_tensors reads a dict of fields' ``block_structure`` as QuantizationArgs parses it: the
``"128x128"`` string that older configs hold (compressed-tensors keeps it for backward compatibility)
is ``[128, 128]``; it was read character by character and refused as a block of ('1', '2', '8', 'x',
...). What QuantizationArgs refuses (not two positive ints) is refused, naming the field."""

from __future__ import annotations

import pytest
import torch

import qstats

ct_quantization = pytest.importorskip("compressed_tensors.quantization")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")

QuantizationArgs = ct_quantization.QuantizationArgs


@pytest.mark.parametrize("structure", ("128x128", "64x32", "1x128"))
def test_block_structure_string_equals_compressed_tensors(structure):
    fields = dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=structure)
    args = QuantizationArgs(**fields)
    rows, cols = args.block_structure
    spec = qstats.QuantSpec.from_compressed_tensors(fields)
    assert spec == qstats.QuantSpec.from_compressed_tensors(args)
    assert spec.granularity.block_shape == (rows, cols)

    w = torch.randn(256, 320, generator=torch.Generator().manual_seed(0))  # 320: partial edge blocks under 128 and 64
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    padded = torch.nn.functional.pad(w, (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).transpose(1, 2)
    scale, zero_point = ct_helpers.calculate_qparams(blocks.amin((-2, -1)), blocks.amax((-2, -1)), args)
    assert torch.equal(qp.scale, scale)
    assert torch.equal(qstats.fake_quantize(w, qp, spec), ct_forward.fake_quantize(w, scale, zero_point, args))


@pytest.mark.parametrize("structure", ("128,128", "0x128", "128x128x2", "ax128", [128], [16, 16, 16], [0, 128]))
def test_block_structures_compressed_tensors_refuses_are_refused_naming_the_field(structure):
    with pytest.raises(ValueError):
        QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=structure)
    with pytest.raises(ValueError, match="block_structure"):
        qstats.QuantSpec.from_compressed_tensors(dict(num_bits=8, type="float", strategy="block",
                                                      block_structure=structure))
