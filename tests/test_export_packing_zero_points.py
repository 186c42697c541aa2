"""The int8 zero points of a static asymmetric input site, as `qstats.export.compressed_tensors` writes
them, against compressed-tensors' ``calculate_qparams`` of the same observed range (its zero points are
rounded and clamped to the args' range, so always whole int8 values): equal where the qparams are
qstats' own, and refused (ValueError) where a zero point is not a whole number of int8's range. A
weight's zero points were checked (by quantize); an activation's went through an int8 cast that
wrapped 227 to -29 and truncated 2.5 to 2 and NaN to 0, writing a checkpoint of other qparams."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

WEIGHT = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
INPUT = dict(num_bits=8, type="int", symmetric=False, strategy="tensor", dynamic=False)


def _calibrated(shift: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False)).eval()
    recipe = qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(WEIGHT)),
        qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec.from_compressed_tensors(INPUT))])
    batch = torch.randn(8, 16) + shift
    states = qstats.calibrate(model, [batch], recipe, progress=False)
    return model, recipe, batch, qstats.compute_qparams_tree(states, recipe, model)


def _export(model, qparams, recipe, folder) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(folder), recipe)
    return load_file(os.path.join(str(folder), "model.safetensors"))


@pytest.mark.parametrize("shift", [0.0, 3.0, -3.0])
def test_input_zero_points_equal_compressed_tensors_calculate_qparams(tmp_path, shift):
    model, recipe, batch, qparams = _calibrated(shift)
    written = _export(model, qparams, recipe, tmp_path)["0.input_zero_point"]
    zero = torch.zeros(())
    _, reference = calculate_qparams(torch.minimum(batch.min(), zero).reshape(1),
                                     torch.maximum(batch.max(), zero).reshape(1), QuantizationArgs(**INPUT))
    assert written.dtype == torch.int8 and torch.equal(written.reshape(-1), reference.to(torch.int8).reshape(-1))


@pytest.mark.parametrize("zero_point", [227, 2.5, float("nan"), -129])
def test_input_zero_points_outside_int8_are_refused(tmp_path, zero_point):
    model, recipe, _, qparams = _calibrated(3.0)
    qp = qparams["0"]["input"]
    value = torch.tensor(zero_point, dtype=qp.zero_point.dtype if isinstance(zero_point, int) else torch.float32)
    qparams["0"]["input"] = qp._replace(zero_point=value.reshape(qp.zero_point.shape))
    with pytest.raises(ValueError, match="zero point"):
        _export(model, qparams, recipe, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
