"""PhiMoE's routers, ignored, in the ``ignore`` list of a W8A8 export: transformers 5 loads the checkpoint's
``block_sparse_moe.gate.weight`` into ``mlp.router`` (a ``PhimoeTopKRouter``, an ``nn.Linear`` subclass that
compressed-tensors' ``Linear`` target matches). llm-compressor 0.14's ``oneshot`` writes the routers as
compressed-tensors maps module paths (``block_sparse_moe.router``: the checkpoint's renaming is written on
``.gate.weight``), a name transformers' loading does not match, so it quantizes the routers it has no scales
for. qstats writes oneshot's entries and the module paths: transformers loads its routers unquantized."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from test_moe_families import _model  # noqa: E402

IGNORE = ["lm_head", "re:.*router$"]


def _load(folder: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _quantized_routers(folder: str) -> list:
    return [path for path, module in _load(folder).named_modules() if path.endswith("router")
            and getattr(getattr(module, "quantization_scheme", None), "weights", None) is not None]


def test_phimoe_routers_ignored_load_unquantized_unlike_oneshots(tmp_path, single_thread_quiet):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "theirs", "ours"))
    _model("phimoe").save_pretrained(saved)
    sample = torch.randint(1, 128, (12,), generator=torch.Generator().manual_seed(1))
    modifier = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=IGNORE)
    llm_compressor_oneshot(_load(saved), [sample], modifier, theirs)
    model = _load(saved)
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": sample[None]}], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)

    ignored = [json.load(open(os.path.join(folder, "config.json")))["quantization_config"]["ignore"]
               for folder in (ours, theirs)]
    assert ignored[0][:len(ignored[1])] == ignored[1]  # oneshot's list, in its order
    assert ignored[0][len(ignored[1]):] == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    assert _quantized_routers(theirs) == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    assert _quantized_routers(ours) == []
