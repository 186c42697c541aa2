"""`qstats.gptq_layerwise` of stacked experts in float and 8-bit weight formats (NVFP4A16,
FP8_DYNAMIC, FP8_BLOCK, W8A8) on a tiny random Qwen3-MoE, against llm-compressor 0.14's ``oneshot``
with a ``GPTQModifier`` (basic and sequential pipelines, checkpoints compared code by code), a plain
loop of `qstats.calibrate` + `qstats.gptq`, other ``experts_at_once`` and two ranks."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _llmc_hessian import llm_compressor_hessian
from _oneshot import saved_random_model, token_samples
from _shared import checkpoint_tensors, fork_ranks, gloo_group, llm_compressor_oneshot, qwen3_moe_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

TOKENS = 16
IGNORE = ["lm_head", "re:.*mlp.gate$"]
# llm-compressor 0.14's sequential pipeline attends both ways on Qwen3-MoE (docs/differences.md):
# this mask gives qstats the same attention, so that its Hessians follow the same activations
BOTH_WAYS = torch.ones(1, 1, TOKENS, TOKENS, dtype=torch.bool)
CAUSAL = torch.ones(1, TOKENS, dtype=torch.long)


@pytest.fixture(scope="module")
def samples():
    return token_samples(4, TOKENS)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    config = qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                              head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    return saved_random_model(tmp_path_factory, "gptq_formats_qwen3_moe", transformers.Qwen3MoeForCausalLM, config)


def _batches(samples, mask=CAUSAL):
    return [{"input_ids": s[None], "attention_mask": mask} for s in samples]


def _recipe(scheme):
    return qstats.Recipe.from_scheme(scheme, ignore=IGNORE, experts="Qwen3MoeExperts")


def _meta(path):
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def _gptq(path, batches, scheme, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qstats.gptq_layerwise(_meta(path), path, batches, _recipe(scheme), progress=False, all_experts=True,
                                     **options)


def _export(path, result, scheme, out):
    """The export of the loaded model holding the GPTQ'd weights; the layerwise export of the meta
    model with ``weights=result.weights`` writes the same tensors."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model.load_state_dict(result.weights, strict=False)
    plan = _recipe(scheme).resolve(model)
    qparams = qstats.compute_qparams_tree(result.states, plan)
    qstats.export.compressed_tensors(model, qparams, f"{out}/loaded", plan)
    meta = _meta(path)
    qstats.export.compressed_tensors_layerwise(meta, path, qstats.compute_qparams_tree(result.states, _recipe(scheme)
                                                                                       .resolve(meta)),
                                               f"{out}/layerwise", _recipe(scheme), weights=result.weights,
                                               progress=False)
    return checkpoint_tensors(f"{out}/loaded"), checkpoint_tensors(f"{out}/layerwise")


def _theirs(path, samples, scheme, pipeline, out):
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme=scheme, ignore=IGNORE), out, pipeline)
    return checkpoint_tensors(out)


def _codes(tensors, name):
    """The stored codes' bytes (NVFP4: two codes a byte) of Linear ``name``."""
    stored = tensors.get(f"{name}.weight_packed", tensors.get(f"{name}.weight"))
    return stored.view(torch.uint8)


def _quantized(tensors):
    return sorted(name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale"))


def _same_codes(ours, theirs, names):
    same = sum(int((_codes(ours, name) == _codes(theirs, name)).sum()) for name in names)
    return same / sum(_codes(theirs, name).numel() for name in names)


def _first_layer(names):
    return [name for name in names if name.startswith("model.layers.0.")]


def _loop_gptq(path, batches, scheme):
    """The same algorithm as a plain loop over the loaded model: per layer, the Hessians of its
    quantized weights (`qstats.calibrate` of the whole model, summed as llm-compressor sums them),
    then `qstats.gptq` of each weight."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    plan = _recipe(scheme).resolve(model)
    weights = {}
    for index in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        attention = tuple(f"{prefix}self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        rules = [qstats.Rule(attention, sites=("input",), observer=llm_compressor_hessian),
                 qstats.Rule(prefix + "mlp.experts", sites=("gate_up_proj.input", "down_proj.input"),
                             observer=llm_compressor_hessian)]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hessians = qstats.calibrate(model, batches, qstats.Recipe(rules), progress=False, all_experts=True)
            states = qstats.calibrate(model, batches[:1], plan, progress=False)  # the weights' states
        qparams = qstats.compute_qparams_tree(states, plan)
        for module_path, sites in hessians.items():
            for hessian_site, state in sites.items():
                site = "weight" if hessian_site == "input" else hessian_site[: -len(".input")]
                parameter = getattr(plan.modules[module_path], site)
                state = state._replace(total=state.total / 2)  # llm-compressor's sum, halved (exact)
                quantized = qstats.gptq(parameter, state, plan.site(module_path, site).spec,
                                        qparams=qparams[module_path][site], actorder="static")[0]
                with torch.no_grad():
                    parameter.copy_(quantized)
                weights[f"{module_path}.{site}"] = quantized
    return weights


# the sequential pipeline's codes over all layers: from the second layer on, the Hessians follow
# the first layer's few differing codes (float rounding of the Hessian sums) through 64 rows of
# 128 columns; FP8 blocks and NVFP4's coarse grid amplify that (measured 0.987 and 0.839; qstats'
# GPTQ of the second layer's q_proj on llm-compressor's own inputs keeps 0.998 of its FP8 block codes);
# FP8 per channel: 0.999 or more on AVX2 CPUs, 0.988 on an AVX-512/AMX one (the matmuls' last bits differ)
ALL_LAYERS = {"NVFP4A16": 0.8, "FP8_DYNAMIC": 0.98, "FP8_BLOCK": 0.98, "W8A8": 0.999}


@pytest.mark.parametrize("scheme", ["NVFP4A16", "FP8_DYNAMIC", "FP8_BLOCK", "W8A8"])
def test_moe_formats_equal_llm_compressor_and_a_plain_loop(moe, samples, tmp_path, scheme, single_thread_quiet):
    """First layer (inputs independent of GPTQ): the codes equal llm-compressor's basic pipeline
    (causal attention) and its sequential pipeline (attention both ways) but for float rounding of
    the Hessian sums (measured >= 0.9995). Every layer: the weights equal a plain loop of
    `qstats.calibrate` + `qstats.gptq` bit for bit, and the sequential pipeline's codes at the rates
    of ``ALL_LAYERS``. Scales equal llm-compressor's; both exports write the same tensors."""
    causal = _gptq(moe, _batches(samples), scheme)
    loop = _loop_gptq(moe, _batches(samples), scheme)
    assert sorted(loop) == sorted(causal.weights) and len(loop) == 2 * 6
    for name, weight in loop.items():
        assert torch.equal(causal.weights[name], weight), name
    ours, layerwise = _export(moe, causal, scheme, str(tmp_path / "causal"))
    assert sorted(ours) == sorted(layerwise) and all(torch.equal(ours[name], layerwise[name]) for name in ours)
    basic = _theirs(moe, samples, scheme, "basic", str(tmp_path / "basic"))
    names = _quantized(basic)
    assert _quantized(ours) == names and len(names) == 2 * (4 + 3 * 4)
    assert _same_codes(ours, basic, _first_layer(names)) >= 0.999

    both_ways = _gptq(moe, _batches(samples, BOTH_WAYS), scheme)
    ours, _ = _export(moe, both_ways, scheme, str(tmp_path / "both_ways"))
    theirs = _theirs(moe, samples, scheme, "sequential", str(tmp_path / "sequential"))
    assert _same_codes(ours, theirs, _first_layer(names)) >= 0.999
    assert _same_codes(ours, theirs, names) >= ALL_LAYERS[scheme]
    for name in theirs:
        if "scale" in name and not (scheme == "FP8_BLOCK" and name.endswith(("gate_proj.weight_scale",
                                                                             "up_proj.weight_scale"))):
            assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


def test_fp8_block_experts_export_as_llm_compressor(moe, samples, tmp_path, single_thread_quiet):
    """FP8_BLOCK on experts whose gate_proj and up_proj are one 128x128 block each: the checkpoint's
    names, dtypes and shapes are llm-compressor's."""
    ours, _ = _export(moe, _gptq(moe, _batches(samples[:1]), "FP8_BLOCK"), "FP8_BLOCK", str(tmp_path / "ours"))
    theirs = checkpoint_tensors(_rtn_theirs(moe, samples[:1], str(tmp_path / "theirs")))
    assert sorted(ours) == sorted(theirs)
    assert all((ours[name].dtype, ours[name].shape) == (theirs[name].dtype, theirs[name].shape) for name in theirs)


def _rtn_theirs(path, samples, out):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(model, samples, QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=IGNORE),
                           out)
    return out


def test_nvfp4_experts_at_once_leaves_the_weights_unchanged(moe, samples, single_thread_quiet):
    """NVFP4 experts GPTQ'd one at a time, three then one, or all four together (where their
    gate_up Hessians, every expert on every token, are equal and factored once): the same bits."""
    whole = _gptq(moe, _batches(samples[:2]), "NVFP4A16")
    for chunk in (1, 3):
        chunked = _gptq(moe, _batches(samples[:2]), "NVFP4A16", experts_at_once=chunk)
        assert sorted(chunked.weights) == sorted(whole.weights)
        for name, weight in whole.weights.items():
            assert torch.equal(chunked.weights[name], weight), (chunk, name)


def _nvfp4_rank(rank: int, port: int, moe: str, samples: list, out: str) -> None:
    with gloo_group(rank, port):
        result = _gptq(moe, _batches(samples[rank::2]), "NVFP4A16", experts_at_once=1, all_reduce=True)
        torch.save(result.weights, os.path.join(out, f"rank{rank}.pt"))


def test_nvfp4_two_ranks_hold_the_weights_of_one(moe, samples, tmp_path, single_thread_quiet):
    """NVFP4 under ``all_reduce`` (each rank half the batches, the GPTQ work shared by expert): both
    ranks hold the same bits, and the weights are one process's over every batch up to the float
    rounding of the Hessian sums' order (measured 0.997-0.9999 in the first layer and 0.88-0.995 in the
    second, where NVFP4 GPTQ follows the first layer's few differing values)."""
    assert fork_ranks(_nvfp4_rank, moe, samples, str(tmp_path), timeout=300) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert sorted(ranks[0]) == sorted(ranks[1])
    assert all(torch.equal(weight, ranks[1][name]) for name, weight in ranks[0].items())
    one = _gptq(moe, _batches(samples), "NVFP4A16")
    assert sorted(one.weights) == sorted(ranks[0])
    for name, weight in one.weights.items():
        same = (ranks[0][name] == weight).float().mean()
        assert same >= (0.995 if name.startswith("model.layers.0.") else 0.8), (name, float(same))


def test_bf16_first_layer_equals_llm_compressor_with_observed_dtype_and_eager_attention(moe, samples, tmp_path,
                                                                                        single_thread_quiet):
    """A bfloat16 checkpoint: llm-compressor computes the qparams and the GPTQ column values in
    bfloat16 and calibrates with eager attention (its ``calibration_forward_context``). With
    ``observed_dtype=torch.bfloat16`` and the meta model's attention eager, the first layer's codes
    equal its basic pipeline's (measured 0.99992); without ``observed_dtype`` a warning names the
    weights, whose codes then drift (measured 0.71)."""
    path = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_pretrained(moe, dtype=torch.bfloat16).save_pretrained(path)
    theirs = _theirs(path, samples, "W8A8", "basic", str(tmp_path / "theirs"))
    first = _first_layer(_quantized(theirs))
    for observed, least, most in ((torch.bfloat16, 0.999, 1.0), (None, 0.0, 0.9)):
        recipe = qstats.Recipe.from_scheme("W8A8", ignore=IGNORE, experts="Qwen3MoeExperts", observed_dtype=observed)
        meta = _meta(path)
        meta.set_attn_implementation("eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = qstats.gptq_layerwise(meta, path, _batches(samples), recipe, progress=False, all_experts=True)
        warned = [str(w.message) for w in caught if "observed_dtype" in str(w.message)]
        assert bool(warned) == (observed is None), warned
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        model.load_state_dict(result.weights, strict=False)
        plan = recipe.resolve(model)
        out = str(tmp_path / f"ours_{observed}")
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), out, plan)
        assert least <= _same_codes(checkpoint_tensors(out), theirs, first) <= most
