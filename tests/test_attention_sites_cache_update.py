"""Attention modules whose forward compares the name of its attention implementation (GPT-2 under
eager: its ``reorder_and_upcast_attn`` path is taken only ``if config._attn_implementation ==
"eager"``; MiniMax-M3's sparse indexer mask ``in ("eager", "sdpa")``) keep their implementation:
renamed to qstats' counterpart they would compute something else. Their k/v sites are read where
compressed-tensors' kv cache (``QuantizedKVCache``) reads them, as the forward hands them to its
cache's ``update``; their q, which reaches no cache, is refused naming the module. The references
are recorded here by wrapping the modeling code (not through qstats), and compressed-tensors' kv
cache or its ``fake_quantize`` at the cache update."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import eager_attention_arguments, tiny_minimax_m3_sparse

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStatus  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


def _gpt2(reorder: bool, **options):
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                     eos_token_id=0, reorder_and_upcast_attn=reorder, **options)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    return model


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (1, length), generator=generator) for length in (12, 7)]


def _recipe(sites=("k", "v")):
    return qstats.Recipe([qstats.Rule("re:.*attn$", sites=sites, observer=qstats.minmax,
                                      spec=qstats.QuantSpec("int8"))])


def _upcast_arguments(monkeypatch) -> dict:
    """``{(module path, site): [tensor]}``: the key and value GPT-2's upcast path receives, recorded
    by wrapping ``GPT2Attention._upcast_and_reordered_attn``."""
    seen: dict = {}
    original = modeling_gpt2.GPT2Attention._upcast_and_reordered_attn

    def recording(self, query, key, value, attention_mask=None):
        path = f"transformer.h.{self.layer_idx}.attn"
        seen.setdefault((path, "k"), []).append(key.detach())
        seen.setdefault((path, "v"), []).append(value.detach())
        return original(self, query, key, value, attention_mask)

    monkeypatch.setattr(modeling_gpt2.GPT2Attention, "_upcast_and_reordered_attn", recording)
    return seen


def _assert_extremes(states, seen) -> None:
    assert seen
    for (path, site), xs in seen.items():
        if site == "q":
            continue
        state = states[path][site]
        assert torch.equal(state.min_val, torch.stack([x.amin() for x in xs]).amin()), (path, site)
        assert torch.equal(state.max_val, torch.stack([x.amax() for x in xs]).amax()), (path, site)


@pytest.mark.parametrize("reorder", [False, True])
def test_gpt2_under_eager_observes_the_key_and_value_its_attention_receives(monkeypatch, reorder):
    """With ``reorder_and_upcast_attn`` the upcast path runs inside `calibrate` too (it was refused)."""
    model, batches = _gpt2(reorder), _batches()
    if reorder:
        seen = _upcast_arguments(monkeypatch)
        states = qstats.calibrate(model, [{"input_ids": x} for x in batches], _recipe(), progress=False)
        assert len(seen["transformer.h.0.attn", "k"]) == len(batches)  # the path the user's model takes
        seen.clear()
        with torch.no_grad():
            for batch in batches:
                model(batch)
    else:
        states = qstats.calibrate(model, [{"input_ids": x} for x in batches], _recipe(), progress=False)
        seen = eager_attention_arguments(model, batches, modeling_gpt2)
    assert model.config._attn_implementation == "eager"
    _assert_extremes(states, seen)


def _compressed_tensors_kv_cache(model, qparams: dict, args: dict):
    """``model`` with compressed-tensors' kv cache on each GPT-2 attention module, attached as its
    ``apply_quantization_config`` attaches it (which skips GPT-2: no k_proj/v_proj child), holding
    ``qparams``' k/v scales."""
    from compressed_tensors.modeling.kvcache import initialize_hooked_kv_cache
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    scheme = QuantizationScheme(targets=["GPT2Attention"], input_activations=QuantizationArgs(**args))
    for path, module in model.named_modules():
        if isinstance(module, modeling_gpt2.GPT2Attention):
            module.quantization_scheme = scheme
            initialize_hooked_kv_cache(model, module)
            for site in ("k", "v"):
                initialize_qparams(module, site, scheme.input_activations, observed_shape=(4, None, 8),
                                   observed_dtype=torch.float32, force_zero_point=False)
                getattr(module, f"{site}_scale").data.copy_(qparams[path][site].scale.reshape(1))
            module.quantization_status = QuantizationStatus.FROZEN
    return model


def test_gpt2_fake_quantized_logits_equal_compressed_tensors_kv_cache():
    model, batches = _gpt2(True), _batches()
    plan = _recipe().resolve(model)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": x} for x in batches], plan,
                                                           progress=False), plan)
    reference = _compressed_tensors_kv_cache(_gpt2(True), qparams, INT8)
    with torch.no_grad():
        float_logits = model(batches[0]).logits
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(batches[0]).logits
        theirs = reference(batches[0]).logits
    assert not torch.equal(ours, float_logits)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    assert model.config._attn_implementation == "eager" and "update" not in vars(model.transformer)


def test_gpt2_observed_inside_fake_quantized_sees_the_quantized_key(monkeypatch):
    """Contexts nest as on the counterpart: the enclosing one's hooks run first."""
    model, batches = _gpt2(True), _batches()
    plan = _recipe().resolve(model)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": x} for x in batches], plan,
                                                           progress=False), plan)
    seen = _upcast_arguments(monkeypatch)
    with qstats.fake_quantized(model, qparams, plan):
        states = qstats.calibrate(model, [{"input_ids": x} for x in batches], plan, progress=False)
    _assert_extremes(states, seen)
    key = torch.cat([x.flatten() for x in seen["transformer.h.0.attn", "k"]])
    scale = qparams["transformer.h.0.attn"]["k"].scale
    assert torch.equal(key, fake_quantize(key, scale, torch.zeros_like(scale, dtype=torch.int8),
                                          QuantizationArgs(**INT8)))


def test_gpt2_q_site_under_eager_is_refused_naming_the_module():
    model = _gpt2(False)
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn' \(GPT2Attention\) has a q site.*compares"):
        qstats.calibrate(model, [{"input_ids": _batches()[0]}], _recipe(("q", "k", "v")), progress=False)
    assert model.config._attn_implementation == "eager"


def test_gpt2_without_a_cache_is_refused_naming_the_module():
    model = _gpt2(True, use_cache=False)
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn' \(GPT2Attention\) handed no key.*past_key_values"):
        qstats.calibrate(model, [{"input_ids": _batches()[0]}], _recipe(), progress=False)


def _cache_updates(monkeypatch, quantize=None) -> dict:
    """``{(module path, site): [tensor]}``: the key and value each layer hands ``DynamicCache.update``
    (recorded by wrapping it), replaced by ``quantize(path, site, x)`` first when given."""
    seen: dict = {}
    original = transformers.DynamicCache.update

    def recording(self, key, value, layer_idx, *args, **kwargs):
        path = f"model.layers.{layer_idx}.self_attn"
        if quantize is not None:
            key, value = quantize(path, "k", key), quantize(path, "v", value)
        seen.setdefault((path, "k"), []).append(key.detach())
        seen.setdefault((path, "v"), []).append(value.detach())
        return original(self, key, value, layer_idx, *args, **kwargs)

    monkeypatch.setattr(transformers.DynamicCache, "update", recording)
    return seen


def _kv_cache_plan(model, args=FP8):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    modifier = QuantizationModifier(config_groups={}, kv_cache_scheme=args)
    return qstats.Recipe.from_compressed_tensors(modifier).resolve(model)


def test_minimax_sparse_attention_kv_cache_observes_the_sparse_models_keys(monkeypatch):
    """The keys of its second layer are those of the sparse model (the dense model's differ:
    `test_attention_sites_implementation_name_branches`), as compressed-tensors' kv cache sees them."""
    pytest.importorskip("llmcompressor")
    model = tiny_minimax_m3_sparse()
    batches = [torch.randint(1, 64, (1, n), generator=torch.Generator().manual_seed(1)) for n in (16, 12)]
    plan = _kv_cache_plan(model, {**FP8, "observer": "static_minmax"})
    states = qstats.calibrate(model, [{"input_ids": x} for x in batches], plan, progress=False)
    seen = _cache_updates(monkeypatch)
    with torch.no_grad():
        for batch in batches:
            model(batch)
    assert len(seen) == 4
    _assert_extremes(states, seen)


def test_minimax_fake_quantized_logits_equal_compressed_tensors_fake_quantize_at_the_cache_update(monkeypatch):
    """compressed-tensors' own kv cache cannot run this model (its ``QuantizedKVCache`` drops the cache
    after ``update``, where the sparse indexer reads ``past_key_values.layers``): the reference is its
    ``fake_quantize`` applied where that cache applies it."""
    pytest.importorskip("llmcompressor")
    model, batch = tiny_minimax_m3_sparse(), torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    plan = _kv_cache_plan(model)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": batch}], plan, progress=False), plan)
    with torch.no_grad():
        float_logits = model(batch).logits
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(batch).logits
        args = QuantizationArgs(**FP8)

        def quantize(path, site, x):
            scale = qparams[path][site].scale
            return fake_quantize(x, scale, torch.zeros_like(scale, dtype=torch.float8_e4m3fn), args)

        _cache_updates(monkeypatch, quantize)
        theirs = model(batch).logits
    assert not torch.equal(ours, float_logits)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
