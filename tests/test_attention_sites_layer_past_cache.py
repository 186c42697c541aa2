"""Attention modules handed their cache as ``layer_past`` (GPT-NeoX's, GPTBigCode's), not
``past_key_values``: through decode steps the k/v sites observe each call's new key and value once, at
the cache update, as for Llama (``test_attention_sites_decode_steps``), not the whole cache their
attention function receives at every step. A moving-average observer's k_scale and v_scale equal
llm-compressor's ``minmax`` observer (a moving average) fed the keys and values each call hands the
cache, recorded by a wrapper of the cache's ``update`` (not by qstats)."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
FAMILIES = {
    "gpt_neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rotary_pct=0.5)), "GPTNeoXAttention", "gpt_neox.layers.{}.attention"),
    "gpt_bigcode": (lambda: transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)), "GPTBigCodeAttention", "transformer.h.{}.attn"),
}


def _decode(model, steps=4):
    """A prompt, then ``steps`` greedy decode steps, each with the cache of the earlier ones."""
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_steps_observe_each_new_key_and_value_once(monkeypatch, family):
    from llmcompressor.observers import Observer

    make, module_class, path = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    handed: dict = {}
    update = transformers.DynamicCache.update

    def recording(self, key, value, layer_idx, *args, **kwargs):
        handed.setdefault(layer_idx, []).append((key.clone(), value.clone()))
        return update(self, key, value, layer_idx, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(transformers.DynamicCache, "update", recording)
        _decode(model)
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**INT8))
    recipe = qstats.Recipe([qstats.Rule(module_class, sites=("k", "v"), observer=qstats.moving_average_minmax, spec=spec)])
    plan = recipe.resolve(model)
    with qstats.observing(model, plan) as session:
        _decode(model)
    qparams = qstats.compute_qparams_tree(session.states, plan)
    assert len(handed) == 2 and all(len(calls) == 5 for calls in handed.values())
    for layer, calls in handed.items():
        for index, site in enumerate("kv"):
            observer = Observer.load_from_registry("minmax", base_name=site, args=QuantizationArgs(**INT8))
            for call in calls:
                observer(call[index])
            reference = observer.get_qparams()["scale"].reshape(-1)
            assert torch.equal(qparams[path.format(layer)][site].scale.reshape(-1), reference), (layer, site)
