"""quantize / dequantize / fake_quantize given QParams that do not fit: a zero point of another
shape than the scales (per column instead of per row, or a compressed-tensors ``(out, 1)`` column
beside ``(out,)`` scales), a two-level spec's global scale of one value per row, a missing zero point
or global scale, or no QParams at all, each raise an error naming the problem (they broadcast the
result to another shape, or failed inside torch with a message about tensor sizes). A single zero
point shared by per-row scales still gives torch.ao's per-channel fake quantization."""

from __future__ import annotations

import re

import pytest
import torch

import qstats

ROWS = qstats.QuantSpec(dtype="int8", mapping="asymmetric", granularity=qstats.PerAxis(0))
NVFP4 = qstats.preset("nvfp4")


def _qparams(spec, weight):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)


def _weight(rows=4, columns=32):
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(0))


def _calls(weight, qparams, spec):
    codes = torch.zeros(weight.shape, dtype=qstats.code_dtype(spec)) if not spec.is_float else weight
    return {"quantize": lambda: qstats.quantize(weight, qparams, spec),
            "dequantize": lambda: qstats.dequantize(codes, qparams, spec),
            "fake_quantize": lambda: qstats.fake_quantize(weight, qparams, spec)}


@pytest.mark.parametrize("shape", [(32,), (4, 1)], ids=["per column", "a column"])
@pytest.mark.parametrize("call", ["quantize", "dequantize", "fake_quantize"])
def test_a_zero_point_that_does_not_fit_the_scales_is_named(shape, call):
    weight = _weight(columns=32)
    qparams = _qparams(ROWS, weight)._replace(zero_point=torch.zeros(shape, dtype=torch.int32))
    expected = f"{call}: a zero point of shape {shape} does not fit scales of shape (4,)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        _calls(weight, qparams, ROWS)[call]()


def test_one_zero_point_shared_by_per_row_scales_is_torch_ao_s_per_channel_fake_quantize():
    weight = _weight()
    qparams = _qparams(ROWS, weight)._replace(zero_point=torch.tensor([3], dtype=torch.int32))
    expected = torch.fake_quantize_per_channel_affine(weight, qparams.scale, torch.full((4,), 3, dtype=torch.int32),
                                                      0, -128, 127)
    assert torch.equal(qstats.fake_quantize(weight, qparams, ROWS), expected)


@pytest.mark.parametrize("global_scale", [torch.ones(4), torch.ones(4, 1), None], ids=["per row", "a column", "none"])
@pytest.mark.parametrize("call", ["quantize", "dequantize", "fake_quantize"])
def test_a_two_level_spec_needs_one_global_scale(global_scale, call):
    weight = _weight()
    qparams = _qparams(NVFP4, weight)._replace(global_scale=global_scale)
    with pytest.raises(ValueError, match=f"{call}: a two-level spec .TensorGroup. needs one global scale"):
        _calls(weight, qparams, NVFP4)[call]()


@pytest.mark.parametrize("qparams,words", [(None, "got NoneType"), ("tuple", "got tuple"),
                                           ("no zero point", "got NoneType for its zero_point")])
def test_something_else_than_qparams_is_a_type_error(qparams, words):
    weight = _weight()
    given = _qparams(ROWS, weight)
    qparams = {"tuple": tuple(given), "no zero point": given._replace(zero_point=None)}.get(qparams, qparams)
    with pytest.raises(TypeError, match=f"fake_quantize: qparams must be a QParams.*{words}"):
        qstats.fake_quantize(weight, qparams, ROWS)
