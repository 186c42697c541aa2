"""``QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])`` read by
``Recipe.from_compressed_tensors`` on each transformers MoE family of test_moe_families (tiny random
models, one sample), against llm-compressor's ``oneshot``, which linearizes stacked experts into
per-expert Linears (``linearize_moe``): same safetensors keys, tensors bit for bit, same ``ignore``
(gpt-oss' transposed, interleaved, biased stacks too: tests/test_gpt_oss_expert_weights.py)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

from safetensors.torch import load_file  # noqa: E402
from test_moe_families import _model  # noqa: E402

# llm-compressor linearizes their experts (jetmoe and dbrx it leaves as they are, as qstats does).
# Not here: longcat_flash (its router.classifier, called through F.linear on its weight, is written by
# qstats as a weight-only pack-quantized group, by llm-compressor in the W8A8 group; experts equal).
SAME = ("qwen2_moe", "qwen3_moe", "mixtral", "granitemoe", "deepseek_v2", "deepseek_v3", "olmoe", "phimoe", "jamba",
        "ernie4_5_moe", "glm4_moe", "hunyuan_v1_moe", "minimax", "jetmoe", "dbrx", "nemotron_h", "gpt_oss")
W8A8 = dict(targets="Linear", scheme="W8A8", ignore=["lm_head"])


def _saved(family: str, folder: str) -> None:
    model = _model(family)
    if family.startswith("deepseek"):  # multi-head latent attention under eager: as many kv heads as heads
        config = model.config
        config.num_key_value_heads = config.num_attention_heads
        torch.manual_seed(0)
        model = type(model)(config).eval()
    model.save_pretrained(folder)


def _load(folder: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _sample():
    return torch.randint(1, 128, (12,), generator=torch.Generator().manual_seed(1))


def _qstats_export(folder: str, out: str, recipe) -> None:
    model = _load(folder)
    model.set_attn_implementation("eager")
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": _sample()[None]}], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), out, plan)


def _assert_same_checkpoint(ours: str, theirs: str) -> None:
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    # an lm_head tied to the embeddings (ernie 4.5, jetmoe) is left out, as save_pretrained does
    assert set(our_tensors) == set(their_tensors)
    assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    configs = []
    for folder in (ours, theirs):
        with open(os.path.join(folder, "config.json")) as file:
            configs.append(json.load(file)["quantization_config"])
    assert configs[0]["ignore"] == configs[1]["ignore"]


@pytest.mark.parametrize("family", SAME)
def test_linear_w8a8_equals_llm_compressor_oneshot(family, tmp_path, single_thread_quiet):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    _saved(family, saved)
    modifier = QuantizationModifier(**W8A8)
    llm_compressor_oneshot(_load(saved), [_sample()], modifier, theirs)
    _qstats_export(saved, ours, qstats.Recipe.from_compressed_tensors(modifier))
    _assert_same_checkpoint(ours, theirs)


def test_gate_less_experts_equal_llm_compressor_oneshot(tmp_path, single_thread_quiet):
    """Nemotron-H's experts: ``up_proj [E, I, H]`` and ``down_proj``, no gate; llm-compressor
    linearizes them into ``<e>.up_proj`` / ``<e>.down_proj`` (``ExpertMLPWithoutGate``). Their stacked
    sites named here with the W8A8 args, the export unpacks them the same (was: refused, needing
    ``gate_up_proj``), without the mixed-schemes warning (their two projections are all of them)."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "llm_compressor", "qstats"))
    _saved("nemotron_h", saved)
    modifier = QuantizationModifier(**W8A8)
    llm_compressor_oneshot(_load(saved), [_sample()], modifier, theirs)
    linear = qstats.Recipe.from_compressed_tensors(modifier)
    weight, inputs = linear.rules  # the W8A8 weight and dynamic input rules
    experts = [
        qstats.Rule("NemotronHExperts", sites=("up_proj", "down_proj"), observer=weight.observer, spec=weight.spec),
        qstats.Rule("NemotronHExperts", sites=("input", "down_proj.input"), observer=inputs.observer,
                    spec=inputs.spec, dynamic=True),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _qstats_export(saved, ours, qstats.Recipe(experts + list(linear.rules), ignore=linear.ignore))
    assert not [w for w in caught if "fused-MoE" in str(w.message)]  # up_proj and down_proj: one scheme
    written = load_file(os.path.join(ours, "model.safetensors"))
    assert "backbone.layers.0.mixer.experts.7.up_proj.weight_scale" in written
    _assert_same_checkpoint(ours, theirs)
