"""Calibrating through decode steps (a cache holding earlier tokens, as ``generate`` runs): the k/v sites
observe each call's new key and value once, where compressed-tensors' kv cache reads them (its
``QuantizedKVCache`` at the cache update), not the whole cache the attention function receives at
every step. k_scale and v_scale equal llm-compressor's observer fed the keys and values each call hands
the cache, recorded by a wrapper of the cache's ``update`` (not by qstats)."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
INT8_HEAD = dict(INT8, symmetric=False, strategy="attn_head")


def _model(implementation):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(implementation)
    return model


def _decode(model, cache_class, steps=4):
    """A prompt, then ``steps`` greedy decode steps, each with the cache of the earlier ones."""
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = (transformers.StaticCache(config=model.config, max_cache_len=16) if cache_class == "static"
             else transformers.DynamicCache(config=model.config))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        for step in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            position = torch.tensor([ids.shape[1] + step])
            out = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position)


def _cache_updates(model, cache_class, monkeypatch):
    """``{layer index: [(key, value), ...]}`` each call hands the cache's ``update``."""
    handed: dict = {}
    cls = transformers.StaticCache if cache_class == "static" else transformers.DynamicCache
    update = cls.update

    def recording(self, key, value, layer_idx, *args, **kwargs):
        handed.setdefault(layer_idx, []).append((key.clone(), value.clone()))
        return update(self, key, value, layer_idx, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(cls, "update", recording)
        _decode(model, cache_class)
    return handed


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
@pytest.mark.parametrize("args", [INT8, INT8_HEAD], ids=["tensor", "attn_head"])
def test_decode_steps_observe_each_new_key_and_value_once(monkeypatch, implementation, cache_class, args):
    from llmcompressor.observers import Observer

    model = _model(implementation)
    plan = qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": args}).resolve(model)
    handed = _cache_updates(model, cache_class, monkeypatch)
    with qstats.observing(model, plan) as session:
        _decode(model, cache_class)
    qparams = qstats.compute_qparams_tree(session.states, plan)
    assert len(handed) == 2 and all(len(calls) == 5 for calls in handed.values())
    for layer, calls in handed.items():
        for index, site in enumerate("kv"):
            # llm-compressor's observer for static activations without one named: "minmax" (a moving average)
            observer = Observer.load_from_registry("minmax", base_name=site, args=QuantizationArgs(**args))
            for call in calls:
                observer(call[index])
            reference = observer.get_qparams()
            ours = qparams[f"model.layers.{layer}.self_attn"][site]
            assert torch.equal(ours.scale.reshape(-1), reference["scale"].reshape(-1)), (layer, site)
            if not args["symmetric"]:
                assert torch.equal(ours.zero_point.reshape(-1).to(torch.int8),
                                   reference["zero_point"].reshape(-1).to(torch.int8)), (layer, site)


def test_latent_attention_k_v_stay_the_attention_functions_with_a_cache(tmp_path):
    """DeepSeek-V3 hands its cache the compressed latent (`qstats._attention.LATENT_CACHE`): its k/v sites
    stay the key and value its attention function receives, a cache passed or not (recorded by a wrapper
    of the modeling file's eager function, not by qstats)."""
    from _shared import eager_attention_arguments
    from test_attention_sites_fused_projections import _base, _samples

    _base(str(tmp_path), "deepseek_v3")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    model.set_attn_implementation("eager")
    spec = qstats.QuantSpec("int8", granularity=qstats.PerHead(1))
    plan = qstats.Recipe([qstats.Rule("re:.*self_attn$", sites=("k", "v"), observer=qstats.minmax,
                                      spec=spec)]).resolve(model)
    samples = [s[None] for s in _samples()]
    seen = eager_attention_arguments(model, samples)
    states = qstats.calibrate(model, samples, plan, progress=False)  # use_cache: a DynamicCache each batch
    for (path, site), xs in seen.items():
        if site in states[path]:
            assert torch.equal(states[path][site].max_val, torch.stack([x.amax(dim=(0, 2, 3)) for x in xs]).amax(0))
