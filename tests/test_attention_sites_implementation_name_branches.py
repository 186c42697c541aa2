"""Attention modules whose forward, or a method it calls, branches on the name of their attention
implementation (MiniMax-M3's sparse indexer mask is applied only ``if config._attn_implementation in
("eager", "sdpa")``; GLM-5-Next's top-k mask is boolean only for ``"sdpa"``): under qstats' counterpart (``"qstats:eager"``) they would compute dense attention, so
`calibrate` would observe keys and values the user's model never produces. Their q sites are
refused, naming the module (their k/v are read at the cache update:
`test_attention_sites_cache_update`); the keys such a model hands its attention function are
recorded here from the modeling file, not through qstats."""

from __future__ import annotations

import importlib

import pytest
import torch

import qstats
from _shared import eager_attention_arguments, tiny_minimax_m3_sparse

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


def _modifier():
    from llmcompressor.modifiers.quantization import QuantizationModifier

    # an attention group: q, k and v under its input args
    return QuantizationModifier(config_groups={"attention": {"targets": ["re:.*self_attn$"], "input_activations": FP8}})


def test_the_sparse_mask_changes_the_keys_of_later_layers():
    """The premise: under another implementation name the model skips its sparse mask, and the
    keys its second layer's attention receives change."""
    pytest.importorskip("llmcompressor")
    model = tiny_minimax_m3_sparse()
    batch = torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    sparse = eager_attention_arguments(model, [batch], modeling)[("model.layers.1.self_attn", "k")][0]
    importlib.import_module("qstats._attention_functions")  # registers qstats' counterparts
    model.config._attn_implementation_internal = "qstats:eager"  # its name, as inside calibrate
    dense = eager_attention_arguments(model, [batch], modeling)[("model.layers.1.self_attn", "k")][0]
    assert not torch.equal(sparse, dense)


def test_calibrating_q_k_v_of_a_module_branching_on_the_implementation_name_is_refused_naming_it():
    pytest.importorskip("llmcompressor")
    model = tiny_minimax_m3_sparse()
    plan = qstats.Recipe.from_compressed_tensors(_modifier()).resolve(model)
    batches = [{"input_ids": torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(1))}]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*MiniMaxM3VLAttention.*compares"):
        qstats.calibrate(model, batches, plan, progress=False)
    assert model.config._attn_implementation == "eager"  # the user's setting, back


def test_modules_that_do_not_branch_on_it_are_not_refused():
    """Llama's attention forward reads the implementation's name only to look its function up."""
    from qstats._attention import _compares_implementation

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    attention = transformers.LlamaForCausalLM(config).model.layers[0].self_attn
    assert not _compares_implementation(attention, "eager") and not _compares_implementation(attention, "sdpa")
    assert _compares_implementation(tiny_minimax_m3_sparse().model.layers[0].self_attn, "eager")


def _tiny_glm5_next():
    """A tiny GLM-5-Next text model (eval mode, sdpa) whose attention builds its top-k mask in a method,
    ``build_attention_mask_from_topk``, that returns it boolean under ``"sdpa"`` and additive otherwise."""
    modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    config = modeling.Glm5NextTextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, v_head_dim=16, qk_nope_head_dim=16, index_topk=4, index_head_dim=16,
        index_n_heads=2, index_kpool=2, linear_head_dim=16, linear_num_heads=4, hc_mult=2, pad_token_id=0,
        max_position_embeddings=64, layer_types=["full_attention"] * 2, indexer_types=["full"] * 2)
    torch.manual_seed(0)
    model = modeling.Glm5NextTextModel(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def _left_padded_batch() -> dict:
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "use_cache": True}


def test_a_comparison_in_a_method_the_forward_calls_keeps_the_users_implementation(monkeypatch):
    """GLM-5-Next compares the implementation's name in ``build_attention_mask_from_topk``, not in its
    forward: under sdpa renamed ``"qstats:sdpa"`` it built the additive mask, and the padded rows'
    hidden states moved by up to 0.97 inside ``observing``. Its k/v are now read at the cache update, the
    model computing what it computes without qstats; their extremes are those of the keys and values
    handed to ``DynamicCache.update`` (recorded by a wrapper, not by qstats); its q is refused by name."""
    model, batch = _tiny_glm5_next(), _left_padded_batch()
    handed: dict = {}
    update = transformers.DynamicCache.update

    def recording(self, key, value, layer_idx, *args, **kwargs):
        handed.setdefault(layer_idx, []).append((key.clone(), value.clone()))
        return update(self, key, value, layer_idx, *args, **kwargs)

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(transformers.DynamicCache, "update", recording)
        expected = model(**batch).last_hidden_state
    recipe = qstats.Recipe([qstats.Rule("Glm5NextTextAttention", sites=("k", "v"), observer=qstats.minmax,
                                        spec=qstats.QuantSpec("int8"))])
    with qstats.observing(model, recipe) as session, torch.no_grad():
        inside = model(**batch).last_hidden_state
    assert torch.equal(inside, expected)
    assert sorted(handed) == [0, 1]
    for layer, ((key, value),) in handed.items():
        for site, x in (("k", key), ("v", value)):
            state = session.states[f"layers.{layer}.self_attn"][site]
            assert torch.equal(state.min_val.reshape(()), x.min()) and torch.equal(state.max_val.reshape(()), x.max())
    query = qstats.Recipe([qstats.Rule("Glm5NextTextAttention", sites=("q", "k", "v"), observer=qstats.minmax,
                                       spec=qstats.QuantSpec("int8"))])
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn.*Glm5NextTextAttention.*compares"):
        qstats.calibrate(model, [batch], query, progress=False)
    assert model.config._attn_implementation == "sdpa"
