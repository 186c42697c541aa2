"""Exporting Linears inside `qstats.fake_quantized` (their weights parametrized with the fake
quantization) writes the codes compressed-tensors' compressor writes from the float weights and our
scales: the export re-quantized the fake-quantized weight, so a tiny negative weight, -0.0 once fake
quantized, got the +0 code where compressed-tensors (and llm-compressor's checkpoint) writes -0
(NVFP4: 4 of 256 fp4 codes on this model; FP8 likewise)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, compressed_tensors_applied

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    with torch.no_grad():  # weights that round to a zero code: -0.0 once fake-quantized
        model[0].weight[:, :2] = -1e-9
    return model


def _compressed_by_compressed_tensors(model, qparams, folder) -> dict:
    """compressed-tensors' compressor on the float model, given the qparams the export wrote."""
    reference = compressed_tensors_applied(model, folder)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            path, _, attribute = name.rpartition(".")
            site, _, field = attribute.partition("_")
            if field in ("scale", "global_scale") and site in qparams.get(path, {}):
                param.copy_(getattr(qparams[path][site], field).to(param.dtype).reshape(param.shape))
    with open(os.path.join(folder, "config.json")) as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    ModelCompressor(quantization_config=config).compress_model(reference)
    return reference.state_dict()


@pytest.mark.parametrize("preset", ["NVFP4A16", "FP8"])
def test_export_inside_fake_quantized_writes_compressed_tensors_codes_of_the_float_weights(tmp_path, preset):
    model = _model()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    rules = [qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(scheme.weights))]
    if scheme.input_activations is not None:
        rules.append(qstats.Rule("Linear", sites=("input",),
                                 spec=qstats.QuantSpec.from_compressed_tensors(scheme.input_activations)))
    recipe = qstats.Recipe(rules)
    states = qstats.calibrate(model, [torch.randn(4, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    folder = str(tmp_path / "inside")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with qstats.fake_quantized(model, qparams, recipe):
            qstats.export.compressed_tensors(model, qparams, folder, recipe)
    ours = load_file(os.path.join(folder, "model.safetensors"))
    theirs = _compressed_by_compressed_tensors(model, qparams, folder)
    assert sorted(ours) == sorted(theirs)
    assert [name for name in ours if not bit_equal(ours[name], theirs[name])] == []
