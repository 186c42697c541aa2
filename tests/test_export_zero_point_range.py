"""Zero points of static asymmetric input sites, as `qstats.export.compressed_tensors` writes them, against
compressed-tensors' ``calculate_qparams`` (its zero points are rounded and clamped to the args' range
[q_min, q_max], [-8, 7] for 4 bits): equal where the qparams are qstats' own, and refused (ValueError naming
the site and the range) where a zero point is not a whole number of the args' range. An activation's zero
point went through an int8 cast that wrapped 227 to -29 and truncated 2.5 to 2 and NaN to 0; then only
int8's range was checked, so a 4-bit zero point of 107 was written as it was: a checkpoint whose zero point
no compressed-tensors calibration gives (its int4 codes cannot reach it)."""

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


def _input(bits: int) -> dict:
    return dict(num_bits=bits, type="int", symmetric=False, strategy="tensor", dynamic=False)


def _calibrated(bits: int, shift: float = 3.0, dtype=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4, bias=False)).eval()
    spec = qstats.QuantSpec.from_compressed_tensors(_input(bits))
    if dtype is not None:  # the same range as unsigned codes, moved onto compressed-tensors' signed one
        spec = qstats.QuantSpec(dtype=dtype, granularity=spec.granularity, mapping="asymmetric")
    recipe = qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(WEIGHT)),
        qstats.Rule("Linear", sites=("input",), spec=spec)])
    batch = torch.randn(8, 16) + shift
    states = qstats.calibrate(model, [batch], recipe, progress=False)
    return model, recipe, batch, qstats.compute_qparams_tree(states, recipe, model)


def _export(model, qparams, recipe, folder) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(folder), recipe)
    return load_file(os.path.join(str(folder), "model.safetensors"))


@pytest.mark.parametrize("bits, dtype", [(8, None), (4, None), (4, "uint4"), (2, None)])
@pytest.mark.parametrize("shift", [0.0, 3.0, -3.0])
def test_input_zero_points_equal_compressed_tensors_calculate_qparams(tmp_path, bits, dtype, shift):
    model, recipe, batch, qparams = _calibrated(bits, shift, dtype)
    written = _export(model, qparams, recipe, tmp_path)["0.input_zero_point"]
    zero = torch.zeros(())
    _, reference = calculate_qparams(torch.minimum(batch.min(), zero).reshape(1),
                                     torch.maximum(batch.max(), zero).reshape(1), QuantizationArgs(**_input(bits)))
    assert written.dtype == torch.int8 and torch.equal(written.reshape(-1), reference.to(torch.int8).reshape(-1))


@pytest.mark.parametrize("bits, dtype, zero_point, lo, hi", [
    (4, None, 107, -8, 7), (4, None, -9, -8, 7), (4, None, 8, -8, 7), (4, "uint4", 16, -8, 7),
    (4, "uint4", 107, -8, 7), (2, None, 2, -2, 1), (8, None, 227, -128, 127), (8, None, 2.5, -128, 127),
    (8, None, float("nan"), -128, 127), (8, None, -129, -128, 127)])
def test_input_zero_points_outside_the_args_range_are_refused_naming_the_site(tmp_path, bits, dtype, zero_point, lo,
                                                                              hi):
    """The reference: calculate_qparams' zero points lie in the args' range (checked on a sweep of ranges)."""
    sweep = torch.linspace(-50, 50, 41)
    _, reference = calculate_qparams(torch.minimum(sweep, torch.zeros(())), torch.maximum(sweep + 3, torch.zeros(())),
                                     QuantizationArgs(**_input(bits)))
    assert bool(((reference >= lo) & (reference <= hi)).all())
    model, recipe, _, qparams = _calibrated(bits, dtype=dtype)
    qp = qparams["0"]["input"]
    value = torch.tensor(zero_point, dtype=qp.zero_point.dtype if isinstance(zero_point, int) else torch.float32)
    qparams["0"]["input"] = qp._replace(zero_point=value.reshape(qp.zero_point.shape))
    with pytest.raises(ValueError, match=rf"0/input: .*zero point.*\[{lo}, {hi}\]"):
        _export(model, qparams, recipe, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
