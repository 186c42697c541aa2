"""Per-head q/k/v scales (`PerHead(1)`, compressed-tensors' ``strategy: attn_head``) of a model whose
config compressed-tensors cannot read the head counts from (OPT: no ``num_key_value_heads``) are refused
by the export with a ValueError naming the model family and the strategy, not compressed-tensors' raw
error (which dumps the whole config); nothing is written. The reference: compressed-tensors'
``get_num_kv_heads`` raises on OPT's config, and llm-compressor's ``oneshot`` of the same scheme fails
calibrating it."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

PER_HEAD = dict(num_bits=8, type="int", symmetric=True, strategy="attn_head", dynamic=False)


def _opt(folder) -> str:
    torch.manual_seed(0)
    transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64)).save_pretrained(str(folder))
    return str(folder)


def _oneshot_error(source) -> str:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    modifier = QuantizationModifier(config_groups={"attention": QuantizationScheme(
        targets=["OPTAttention"], input_activations=QuantizationArgs(**PER_HEAD))})
    with pytest.raises(ValueError) as raised:
        llm_compressor_oneshot(model, [torch.randint(2, 64, (8,), generator=torch.Generator().manual_seed(0))], modifier)
    return str(raised.value)


def test_per_head_q_k_v_of_opt_are_refused_naming_the_family_and_strategy(tmp_path):
    from compressed_tensors.utils import get_num_kv_heads

    source = _opt(tmp_path / "source")
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with pytest.raises(ValueError, match="num_key_value_heads"):  # the reference: compressed-tensors cannot
        get_num_kv_heads(model.config.get_text_config(decoder=True))
    assert "num_key_value_heads" in _oneshot_error(source)  # and oneshot fails on it

    spec = qstats.QuantSpec.from_compressed_tensors(PER_HEAD)
    assert spec.granularity == qstats.PerHead(1)
    recipe = qstats.Recipe([qstats.Rule("OPTAttention", sites=("q", "k", "v"), observer=qstats.minmax, spec=spec)])
    batches = [{"input_ids": torch.randint(2, 64, (1, 9), generator=torch.Generator().manual_seed(1))}]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as raised:
            qstats.export.compressed_tensors(model, qparams, str(out), recipe)
    message = str(raised.value)
    assert message.startswith("export.compressed_tensors: "), message
    for part in ("'attn_head'", "'opt'", "OPTConfig", "get_num_kv_heads", "num_key_value_heads", "drop the q/k/v sites"):
        assert part in message, (part, message)
    assert len(message) < 800  # the config is not dumped into it
    assert not out.exists() or not os.listdir(out)  # nothing written
