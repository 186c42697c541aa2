"""A compressed-tensors recipe that quantizes q/k/v (a ``kv_cache_scheme``, or a config group targeting
the attention modules) of a model whose config compressed-tensors cannot read the head counts from (OPT:
no ``num_key_value_heads``) is refused by ``Recipe.resolve``, so before ``calibrate`` runs a batch, as
llm-compressor's ``oneshot`` refuses it before calibrating; the export refused it only after calibration.
The reference: ``oneshot`` with the same modifier on the same model."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot, tiny_llama_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

KV = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
PER_HEAD = dict(num_bits=8, type="int", symmetric=True, strategy="attn_head", dynamic=False)


def _opt():
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64)).eval()


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).eval()


def _kv_modifier():
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(scheme="FP8", targets=["Linear"], ignore=["lm_head"],
                                kv_cache_scheme=QuantizationArgs(**KV))


def _attention_modifier(attention: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(config_groups={"attention": QuantizationScheme(
        targets=[attention], input_activations=QuantizationArgs(**PER_HEAD))})


def _oneshot_raises(model, modifier, folder) -> bool:
    """Whether llm-compressor's ``oneshot`` refuses ``model`` (loaded back from ``folder``, as it runs)."""
    model.save_pretrained(str(folder))
    try:
        llm_compressor_oneshot(transformers.AutoModelForCausalLM.from_pretrained(str(folder)), [torch.randint(2, 64, (8,), generator=torch.Generator().manual_seed(0))],
                               modifier)
    except ValueError as error:
        assert "num_key_value_heads" in str(error), error
        return True
    return False



@pytest.mark.parametrize("modifier", [_kv_modifier, lambda: _attention_modifier("OPTAttention")],
                         ids=["kv_cache_scheme", "attention_group"])
def test_q_k_v_of_opt_are_refused_when_resolved_as_oneshot_refuses_them(modifier, tmp_path):
    assert _oneshot_raises(_opt(), modifier(), tmp_path)  # the reference
    model, recipe = _opt(), qstats.Recipe.from_compressed_tensors(modifier())
    with pytest.raises(ValueError) as raised:
        recipe.resolve(model)
    message = str(raised.value)
    for part in ("OPTForCausalLM", "OPTConfig", "'opt'", "get_num_kv_heads", "num_key_value_heads", "oneshot"):
        assert part in message, (part, message)
    assert len(message) < 800  # the config is not dumped into it
    seen = []
    with pytest.raises(ValueError, match="num_key_value_heads"):  # before any batch runs
        qstats.calibrate(model, ({"input_ids": seen.append(1) or torch.ones(1, 4, dtype=torch.long)} for _ in range(2)),
                         recipe, progress=False)
    assert seen == []


def test_llama_kv_cache_resolves_as_oneshot_runs_it(tmp_path):
    assert not _oneshot_raises(_llama(), _kv_modifier(), tmp_path)  # the reference
    plan = qstats.Recipe.from_compressed_tensors(_kv_modifier()).resolve(_llama())
    assert sum(site in ("k", "v") for sites in plan.sites.values() for site in sites) == 2 * 2


def test_native_q_k_v_rules_on_opt_still_resolve():
    """A qstats Rule observing q/k/v is no compressed-tensors scheme: it resolves (the export refuses it)."""
    recipe = qstats.Recipe([qstats.Rule("OPTAttention", sites=("k", "v"), observer=qstats.minmax,
                                        spec=qstats.QuantSpec(dtype="int8"))])
    assert len(recipe.resolve(_opt()).sites) == 2
