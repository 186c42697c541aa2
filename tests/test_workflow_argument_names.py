"""The verbs a user chains after calibrating take the recipe under one name: ``recipe``, as a keyword
too. `qstats.export.compressed_tensors` named it ``specs_or_recipe``, so ``recipe=r``, which
`compressed_tensors_layerwise`, `fake_quantized` and `report` take, raised a TypeError there."""

import inspect
import json
import os

import torch
from safetensors.torch import load_file

import qstats

VERBS = (qstats.calibrate, qstats.observing, qstats.compute_qparams_tree, qstats.fake_quantized, qstats.report,
         qstats.calibrate_layerwise, qstats.gptq_layerwise, qstats.export.compressed_tensors,
         qstats.export.compressed_tensors_layerwise)


def test_every_verb_names_its_recipe_argument_recipe():
    for verb in VERBS:
        assert "recipe" in inspect.signature(verb).parameters, verb.__name__


def test_export_takes_the_recipe_as_a_keyword_and_writes_what_fake_quantized_computes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    batches = [torch.randn(4, 32) for _ in range(2)]
    recipe = qstats.Recipe.from_scheme("W8A8")
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    by_keyword = qstats.export.compressed_tensors(model, qparams, str(tmp_path / "keyword"), recipe=recipe)
    positional = qstats.export.compressed_tensors(model, qparams, str(tmp_path / "positional"), recipe)
    assert by_keyword == positional
    written = load_file(os.path.join(tmp_path, "keyword", "model.safetensors"))
    # independent of qstats' quantizer: int8 codes times the written per-channel scale
    with qstats.fake_quantized(model, qparams, recipe):
        fake = model[0].weight.detach().clone()
    assert torch.equal(written["0.weight"].float() * written["0.weight_scale"], fake)
    with open(os.path.join(tmp_path, "keyword", "config.json")) as file:
        assert json.load(file)["quantization_config"] == by_keyword
