"""`qstats.export.compressed_tensors` of a model wrapped in ``DistributedDataParallel`` (and
``torch.compile``, either way round) writes the bare model, as ``oneshot`` users pass it and
``save_pretrained(model.module)`` writes it: the same tensor names (no ``module.`` prefix), values and
``config.json`` as the export of the bare model, which transformers loads with no missing or
unexpected key. qparams named by the wrapper's paths (``module.<path>``; calibrate names a wrapper's
sites by the bare model's) are refused, naming ``model.module``. The process group is a one-rank gloo
group in a forked process."""

from __future__ import annotations

import json
import os
import traceback
import warnings
from datetime import timedelta

import pytest
import torch

import qstats
from _shared import exit_rank, fork_ranks, gloo_group

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

RECIPE = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
WRAPPINGS = ("ddp", "compiled_ddp", "ddp_of_compiled")


def _model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _qparams(model):
    batches = [{"input_ids": torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))}]
    return qstats.compute_qparams_tree(qstats.calibrate(model, batches, RECIPE, progress=False), RECIPE, model)


def _wrap(model, wrapping):
    ddp = torch.nn.parallel.DistributedDataParallel
    return {"ddp": lambda: ddp(model), "compiled_ddp": lambda: torch.compile(ddp(model)),
            "ddp_of_compiled": lambda: ddp(torch.compile(model))}[wrapping]()


def _export_wrapped(rank: int, port: int, out: str) -> None:
    """One gloo rank: each wrapping of the calibrated model exported into ``out/<wrapping>``; then the
    export of the wrapper with qparams named by its paths, its error into ``out/error.txt``."""
    try:
        with gloo_group(rank, port, world=1, timeout=timedelta(seconds=60)):
            model = _model()
            qparams = _qparams(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for wrapping in WRAPPINGS:
                    qstats.export.compressed_tensors(_wrap(model, wrapping), qparams, os.path.join(out, wrapping), RECIPE)
                wrapper = _wrap(model, "ddp")
                wrapper_qparams = {f"module.{path}": entry for path, entry in qparams.items()}
                try:
                    qstats.export.compressed_tensors(wrapper, wrapper_qparams, os.path.join(out, "refused"), RECIPE)
                except ValueError as error:
                    with open(os.path.join(out, "error.txt"), "w") as file:
                        file.write(str(error))
    except BaseException:
        traceback.print_exc()
        exit_rank(1)
    exit_rank(0)


def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def test_a_ddp_wrapped_model_is_written_as_the_bare_model(tmp_path):
    assert fork_ranks(_export_wrapped, str(tmp_path), world=1, timeout=300) == [0]
    model = _model()
    bare = str(tmp_path / "bare")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, _qparams(model), bare, RECIPE)
    expected = load_file(os.path.join(bare, "model.safetensors"))
    assert "lm_head.weight" in expected and "lm_head.weight_scale" not in expected  # ignore=["lm_head"] applied
    for wrapping in WRAPPINGS:
        folder = str(tmp_path / wrapping)
        ours = load_file(os.path.join(folder, "model.safetensors"))
        assert ours.keys() == expected.keys(), wrapping
        assert all(torch.equal(ours[name], expected[name]) for name in expected), wrapping
        assert _config(folder) == _config(bare), wrapping
        assert _config(folder)["architectures"] == ["LlamaForCausalLM"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (wrapping, info)


def test_qparams_named_by_the_wrappers_paths_are_refused_naming_the_bare_model(tmp_path):
    assert fork_ranks(_export_wrapped, str(tmp_path), world=1, timeout=300) == [0]
    message = (tmp_path / "error.txt").read_text()
    for part in ("DistributedDataParallel", "LlamaForCausalLM", "module.model.layers.0.", "model.module"):
        assert part in message, (part, message)
    assert not (tmp_path / "refused").exists() or not os.listdir(tmp_path / "refused")  # nothing written
