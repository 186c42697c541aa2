"""Config groups drawn at random (seeded) from the targets real recipes write (class names, exact paths,
``re:`` prefixes and anchors, attention modules, experts), with ignore lists and kv-cache schemes: a
Recipe read from the llm-compressor modifier gives every module and site the spec, ``dynamic`` and
observer llm-compressor 0.14 gives it (``initialize_quantization`` and ``start_calibration`` on the
model it linearizes), or both refuse the config, or qstats refuses it for a reason docs/recipes.md and
docs/differences.md name (stacked experts split between schemes, every cached attention module
ignored under a kv-cache scheme). Ignored attention modules keep no kv-cache site in a Recipe where
llm-compressor saves their scales uncalibrated, without an observer (differences.md): those are left out."""

import copy
import random
import re
import warnings

import pytest
import torch

import qstats
from _shared import qwen3_moe_config
from test_recipe_observers_attached import _STACKED, _llm_compressors, _ours, started_copy

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import is_cached_attention_module  # noqa: E402
from compressed_tensors.quantization.utils import KV_CACHE_TARGETS  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402

WEIGHTS = [{"num_bits": 8, "strategy": "channel"}, {"num_bits": 4, "strategy": "group", "group_size": 16},
           {"num_bits": 8, "type": "float", "strategy": "tensor"}, {"num_bits": 4, "symmetric": False, "strategy": "channel"}]
INPUTS = [{"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
          {"num_bits": 8, "strategy": "token", "dynamic": True},
          {"num_bits": 8, "symmetric": False, "strategy": "tensor", "dynamic": False, "observer": "mse"}]
TARGETS = ["Linear", "re:.*q_proj", "re:.*proj$", "re:.*mlp.*", "re:model.layers.0.*", "re:.*layers.1.self_attn$",
           "model.layers.0.self_attn.k_proj", "LlamaAttention", "Qwen3MoeAttention", "re:.*self_attn.(k|v)_proj",
           "re:.*down_proj", "re:.*experts.*", "re:.*gate_proj", "lm_head", "re:.*mlp$", "Embedding",
           "re:model.layers.1.mlp"]
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*layers.1.*", "re:.*o_proj", "model.layers.0.mlp.down_proj",
          "re:.*experts.*down_proj", "re:.*up_proj", "LlamaMLP", "re:.*embed.*", "re:model.layers.0.mlp",
          "re:.*self_attn.q"]  # the last two match from the start of the path only
# refusals of qstats alone that docs/recipes.md states
DOCUMENTED = ("different schemes", "ignore skips every one")


def _group(rng) -> dict:
    group = {"targets": rng.sample(TARGETS, rng.randint(1, 3))}
    if rng.random() < 0.2:  # input args alone: an attention group where it narrowly names one
        group["input_activations"] = rng.choice([INPUTS[0], INPUTS[2]])
    else:
        group["weights"] = rng.choice(WEIGHTS)
        if rng.random() < 0.5:
            group["input_activations"] = rng.choice(INPUTS)
    if "input_activations" in group and "Embedding" in group["targets"]:  # token ids: differences.md
        group["targets"] = [t for t in group["targets"] if t != "Embedding"] or ["Linear"]
    return group


def _configs(seed: int, count: int) -> list:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        groups = {f"group_{i}": _group(rng) for i in range(rng.randint(1, 3))}
        kv = rng.choice([None, None, {"num_bits": 8, "type": "float", "strategy": rng.choice(["tensor", "attn_head"]),
                                      "dynamic": False}])
        out.append((groups, rng.sample(IGNORE, rng.randint(0, 2)), kv))
    return out


def _theirs(model, modifier) -> dict:
    """``{path: {site: (spec, dynamic, observer)}}`` as llm-compressor gives them (uncalibrated kv-cache
    sites of ignored attention modules left out)."""
    model = started_copy(model, modifier)
    out: dict = {}
    for path, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if is_cached_attention_module(module):
            names = ("k", "v") if scheme.targets == KV_CACHE_TARGETS else ("q", "k", "v")
            sites = {site: scheme.input_activations for site in names}
        else:
            sites = {site: getattr(scheme, key) for key, site in
                     (("weights", "weight"), ("input_activations", "input"), ("output_activations", "output"))
                     if getattr(scheme, key) is not None}
        entry = {site: (qstats.QuantSpec.from_compressed_tensors(args), args.dynamic is True,
                        _llm_compressors(getattr(module, f"{site}_observer", None), site))
                 for site, args in sites.items()}
        expert = re.fullmatch(r"(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)", path)
        if expert:
            path, entry = expert.group(1), {_STACKED[expert.group(2), site]: v for site, v in entry.items()}
        # an ignored attention module's kv-cache sites: observed by no observer, saved uncalibrated
        entry = {site: v for site, v in entry.items() if not (site in ("k", "v") and v[2] is None and not v[1])}
        out.setdefault(path, {}).update(entry)
    return out


def _recipes(model, modifier) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    out = {}
    for path, entry in plan.sites.items():
        out[path] = {}
        for site, found in entry.items():
            spec = found.spec
            if site == "gate_up_proj" and isinstance(spec.granularity, qstats.PerBlock):  # gate and up: one scale each
                spec = spec.replace(granularity=qstats.PerTensor())
            out[path][site] = (spec, found.rule.dynamic, _ours(found))
    return out


@pytest.fixture(scope="module")
def models():
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return {"llama": transformers.LlamaForCausalLM(llama).eval(),
            "qwen3_moe": transformers.AutoModelForCausalLM.from_config(
                qwen3_moe_config(hidden_size=64, moe_intermediate_size=32, intermediate_size=128)).eval()}


@pytest.mark.parametrize("model_name", ["llama", "qwen3_moe"])
def test_random_configs_give_llm_compressors_sites_specs_and_observers(models, model_name):
    model = models[model_name]
    compared = 0
    for groups, ignore, kv in _configs(seed=11 if model_name == "llama" else 12, count=25):
        modifier = QuantizationModifier(config_groups=copy.deepcopy(groups), ignore=ignore, kv_cache_scheme=kv)
        try:
            theirs = _theirs(model, modifier)
        except ValueError as error:  # compressed-tensors refuses the config: so does the Recipe
            with pytest.raises(ValueError, match="compressed-tensors refuses"):
                _recipes(model, modifier)
            assert "attention" in str(error)
            continue
        try:
            ours = _recipes(model, modifier)
        except ValueError as error:
            assert any(reason in str(error) for reason in DOCUMENTED), (groups, ignore, kv, error)
            continue
        assert {p: e for p, e in ours.items() if e} == {p: e for p, e in theirs.items() if e}, (groups, ignore, kv)
        compared += 1
    assert compared >= 10
