"""QParams whose fields compressed-tensors cannot store are refused naming the site: a missing zero
point, a zero point of another shape than the scales (compressed-tensors registers one per scale), and
two-level (NVFP4) qparams with more than one global scale (it registers one). The export raised
AttributeError / RuntimeError from inside the writer, naming nothing."""

from __future__ import annotations

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config, preset_name_to_scheme)

ASYMMETRIC_INT4_GROUPS = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
ASYMMETRIC_INT8_INPUT = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")


def _calibrated(weights: QuantizationArgs, inputs: QuantizationArgs) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 8)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(weights)),
                            qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec.from_compressed_tensors(inputs))])
    states = qstats.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    return model, recipe, qstats.compute_qparams_tree(states, recipe, model)


def _registered(weights: QuantizationArgs, inputs: QuantizationArgs) -> dict:
    """The shapes of the qparams compressed-tensors registers on the same Linear."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 8))
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    return {name: tuple(tensor.shape) for name, tensor in model[0].named_parameters() if name != "bias"}


def _refused(tmp_path, model, qparams, recipe, match) -> None:
    with pytest.raises(ValueError, match=match):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "out"), recipe)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_zero_point_of_other_shape_than_the_scales_or_none_is_refused_naming_the_site(tmp_path):
    registered = _registered(ASYMMETRIC_INT4_GROUPS, ASYMMETRIC_INT8_INPUT)
    assert registered["weight_zero_point"] == registered["weight_scale"] == (8, 2)  # one zero point per scale
    model, recipe, qparams = _calibrated(ASYMMETRIC_INT4_GROUPS, ASYMMETRIC_INT8_INPUT)
    weight, inputs = qparams["0"]["weight"], qparams["0"]["input"]
    # broadcast over the groups: quantize takes it, the checkpoint cannot hold it (was RuntimeError from a reshape)
    broadcast = {"0": {"weight": weight._replace(zero_point=weight.zero_point[:, :1]), "input": inputs}}
    _refused(tmp_path, model, broadcast, recipe, r"0/weight: a zero point of shape \(8, 1\) for scales of shape \(8, 2\)")
    # was AttributeError: 'NoneType' object has no attribute 'reshape'
    missing = {"0": {"weight": weight, "input": inputs._replace(zero_point=None)}}
    _refused(tmp_path, model, missing, recipe, "0/input: qparams without a zero point")


def test_two_level_qparams_with_several_global_scales_are_refused_naming_the_site(tmp_path):
    nvfp4 = preset_name_to_scheme("NVFP4", ["Linear"])
    registered = _registered(nvfp4.weights, nvfp4.input_activations)
    assert registered["input_global_scale"] == registered["weight_global_scale"] == (1,)
    model, recipe, qparams = _calibrated(nvfp4.weights, nvfp4.input_activations)
    inputs = qparams["0"]["input"]
    doubled = {"0": {**qparams["0"], "input": inputs._replace(global_scale=inputs.global_scale.reshape(1).repeat(2))}}
    # was RuntimeError: shape '[1]' is invalid for input of size 2
    _refused(tmp_path, model, doubled, recipe, r"0/input: two-level \(NVFP4\) qparams need one global scale, got \(2,\)")
