"""``qstats.export.compressed_tensors`` of llm-compressor's mixed-precision example recipe
(``recipe_nvfp4_fp8_mixed.yaml``: FP8 down projections, NVFP4 attention and gate/up projections whose
fp4 ``dynamic="local"`` inputs give no ``scale_dtype``) against the checkpoint llm-compressor 0.14's
``oneshot`` saves from the same weights and batches: the same ``quantization_config`` (its input args
with ``scale_dtype: null``; our targets are the module paths each group quantizes, theirs the recipe's
regexes, selecting the same modules) and every tensor bit for bit (``input_global_scale`` included),
under the recipe as written (moving-average ``minmax`` inputs, observed per group of features) and
with ``static_minmax`` inputs, of a float32 and a bfloat16 model. transformers loads ours back and
computes qstats' fake-quantized logits."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from _oneshot import calibrated_qparams, load_eager, random_llama, token_samples
from _shared import assert_fake_quantized_logits_equal, bit_equal, llm_compressor_oneshot, load_causal_lm

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402
from test_recipe_nvfp4_fp8_mixed import AS_WRITTEN, STATIC  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """``{dtype: folder}`` of one tiny random Llama saved in float32 and in bfloat16, and the batches."""
    model = random_llama()
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        paths[dtype] = str(tmp_path_factory.mktemp(f"mixed_llama_{str(dtype)[6:]}"))
        model.to(dtype).save_pretrained(paths[dtype])
    return paths, token_samples(3, seed=2)


def _quantization_config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _selects(target: str, path: str) -> bool:
    return re.match(target[3:], path) is not None if target.startswith("re:") else target == path


def _assert_same_config(ours: dict, theirs: dict, modules: list) -> None:
    """Equal but for the targets, which select the same modules in each group."""
    assert list(ours["config_groups"]) == list(theirs["config_groups"])
    for name in theirs["config_groups"]:
        our_group, their_group = dict(ours["config_groups"][name]), dict(theirs["config_groups"][name])
        our_targets, their_targets = our_group.pop("targets"), their_group.pop("targets")
        assert our_group == their_group, name
        selected = [path for path in modules if any(_selects(target, path) for target in their_targets)]
        assert sorted(our_targets) == sorted(selected), name
    assert {**ours, "config_groups": None} == {**theirs, "config_groups": None}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.mark.parametrize("text, dtype", [(AS_WRITTEN, torch.float32), (STATIC, torch.float32),
                                         (AS_WRITTEN, torch.bfloat16)],
                         ids=["as_written", "static_minmax", "as_written-bfloat16"])
def test_export_equals_oneshots_checkpoint(llama, tmp_path, text, dtype):
    """The bfloat16 model loads back (transformers decompresses NVFP4 weights to bfloat16, so a float32
    model's checkpoint, oneshot's too, fails its forward: float != BFloat16) and computes qstats'
    fake-quantized logits."""
    paths, samples = llama
    llm_compressor_oneshot(load_causal_lm(paths[dtype]), samples, text, tmp_path / "oneshot")
    recipe = qstats.Recipe.from_compressed_tensors(text, observed_dtype=dtype)
    model = load_eager(paths[dtype])
    plan = recipe.resolve(model)
    qparams = calibrated_qparams(model, samples, plan)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path / "ours"), recipe)

    theirs = _quantization_config(tmp_path / "oneshot")
    assert written == _quantization_config(tmp_path / "ours")
    inputs = [group["input_activations"] for group in theirs["config_groups"].values()]
    assert {args["strategy"]: args["scale_dtype"] for args in inputs} == {"tensor_group": None, "token": None}
    _assert_same_config(written, theirs, [name for name, _ in model.named_modules()])

    our_tensors = load_file(str(tmp_path / "ours" / "model.safetensors"))
    their_tensors = load_file(str(tmp_path / "oneshot" / "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert sum(name.endswith("input_global_scale") for name in their_tensors) == 12
    for name, tensor in their_tensors.items():
        ours = our_tensors[name]
        assert ours.dtype == tensor.dtype and ours.shape == tensor.shape, name
        assert bit_equal(_as_bytes(ours), _as_bytes(tensor)), name

    if dtype == torch.bfloat16:
        loaded = load_eager(str(tmp_path / "ours"))
        assert_fake_quantized_logits_equal(model, qparams, plan, loaded, samples[0][None])


def test_fp4_weights_with_unrounded_group_scales_are_refused():
    """Group scales stay float32 for activations only (scaled at run time): an NVFP4 checkpoint stores
    a weight's group scales as float8, which its codes would not have been computed with."""
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16), mapping="symmetric",
                            scale_dtype="float32", convention="compressed_tensors",
                            global_scale_formula="range_over_amax", zero_point_domain="none")
    args = qstats.export.config.quantization_args(spec, "input")
    assert (args["scale_dtype"], args["dynamic"], args["strategy"]) == (None, "local", "tensor_group")
    with pytest.raises(ValueError, match="'float32' \\(unrounded run-time group scales\\) for activations; got"):
        qstats.export.config.quantization_args(spec, "weight")
