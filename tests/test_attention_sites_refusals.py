"""Where the q/k/v of an attention module cannot be read as its attention function's arguments,
calibrate and fake_quantized refuse by name; the model's attention implementation is the user's
again after every call, also after an error; attention modules without a transformers config keep
their projections' outputs as sites; contexts nest (observation after fake quantization)."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import eager_attention_arguments

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

SPEC = qstats.QuantSpec(dtype="fp8_e4m3fn", mapping="symmetric")
RECIPE = qstats.Recipe([qstats.Rule("LlamaAttention", sites=("q", "k", "v"), spec=SPEC)])


def _llama(attention="eager"):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attention)
    return model


BATCHES = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))]


def test_an_implementation_without_a_qstats_counterpart_is_refused_by_name():
    model = _llama()
    model.config._attn_implementation_internal = "flash_attention_2"  # as a GPU model loads
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*'flash_attention_2'.*'sdpa'"):
        qstats.calibrate(model, BATCHES, RECIPE, progress=False)
    assert model.config._attn_implementation == "flash_attention_2"


def test_the_users_implementation_is_back_after_an_error():
    model = _llama("sdpa")
    with pytest.raises(IndexError):
        qstats.calibrate(model, [torch.full((1, 4), 99)], RECIPE, progress=False)  # ids past the vocabulary
    assert model.config._attn_implementation == "sdpa"
    states = qstats.calibrate(model, BATCHES, RECIPE, progress=False)
    assert model.config._attn_implementation == "sdpa"
    qparams = qstats.compute_qparams_tree(states, RECIPE, model)
    with pytest.raises(IndexError), qstats.fake_quantized(model, qparams, RECIPE):
        model(torch.full((1, 4), 99))
    assert model.config._attn_implementation == "sdpa"


class _DirectAttention(modeling_llama.LlamaAttention):
    """A Llama attention computing eager attention itself, not through transformers' AttentionInterface."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = modeling_llama.apply_rotary_pos_emb(query, key, *position_embeddings)
        output, weights = modeling_llama.eager_attention_forward(self, query, key, value, attention_mask,
                                                                 scaling=self.scaling)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), weights


def test_an_attention_module_that_bypasses_the_interface_is_refused_by_name():
    model = _llama()
    layer = model.model.layers[1]
    direct = _DirectAttention(model.config, 1)
    direct.load_state_dict(layer.self_attn.state_dict())
    layer.self_attn = direct
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn.*did not call its attention function"):
        qstats.calibrate(model, BATCHES, RECIPE, progress=False)
    assert model.config._attn_implementation == "eager"


class _PlainAttention(torch.nn.Module):
    """An attention module of the user's, with projections and no transformers config."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


def test_attention_without_a_transformers_config_observes_its_projections():
    torch.manual_seed(0)
    model = _PlainAttention()
    x = torch.randn(2, 5, 8)
    states = qstats.calibrate(model, [x], qstats.Recipe([qstats.Rule("_PlainAttention", sites=("k",), spec=SPEC)]),
                              progress=False)
    assert torch.equal(states[""]["k"].max_val, model.k_proj(x).detach().amax())


def test_calibrating_inside_fake_quantized_observes_the_fake_quantized_keys():
    model = _llama()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, BATCHES, RECIPE, progress=False), RECIPE, model)
    keys = qstats.Recipe([qstats.Rule("LlamaAttention", sites=("k",), spec=SPEC)])
    with qstats.fake_quantized(model, qparams, RECIPE):
        inner = qstats.calibrate(model, BATCHES, keys, progress=False)
        assert model.config._attn_implementation == "qstats:eager"  # the enclosing context's
        seen = eager_attention_arguments(model, BATCHES)
    assert model.config._attn_implementation == "eager"
    float_keys = eager_attention_arguments(model, BATCHES)
    for index in range(2):
        path = f"model.layers.{index}.self_attn"
        state = inner[path]["k"]
        assert torch.equal(state.max_val, seen[path, "k"][0].amax())
        assert torch.equal(state.min_val, seen[path, "k"][0].amin())
        assert not torch.equal(seen[path, "k"][0], float_keys[path, "k"][0])  # they were fake-quantized


def test_a_standalone_attention_module_whose_config_names_no_implementation_runs_eager():
    """transformers reads a config naming no implementation (None) as eager: so do calibrate and
    fake_quantized, and the config names none again after."""
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation_internal = None
    torch.manual_seed(0)
    attention = modeling_llama.LlamaAttention(config, 0).eval()
    x = torch.randn(1, 5, 32)
    batch = (x, modeling_llama.LlamaRotaryEmbedding(config)(x, torch.arange(5)[None]), None)
    keys = qstats.Recipe([qstats.Rule("LlamaAttention", sites=("k",), spec=SPEC)])
    original, seen = modeling_llama.eager_attention_forward, []

    def recording(module, query, key, *args, **kwargs):
        seen.append(key.detach())
        return original(module, query, key, *args, **kwargs)

    modeling_llama.eager_attention_forward = recording
    try:
        states = qstats.calibrate(attention, [batch], keys, progress=False)
    finally:
        modeling_llama.eager_attention_forward = original
    assert config._attn_implementation is None
    assert len(seen) == 1 and torch.equal(states[""]["k"].max_val, seen[0].amax())
