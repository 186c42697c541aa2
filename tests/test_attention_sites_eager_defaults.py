"""q/k/v sites of attention modules whose forward passes its own eager function to
``get_interface`` (Llama 4's vision attention: ``vision_eager_attention_forward``, which takes
``scaling=None``; TimesFM's ``simple_eager_attention_forward``, in a modeling file with no
``eager_attention_forward``) run that function behind qstats' hooks under eager attention: the
states are the extremes of what it receives, observing leaves the model's output as it was, and
`qstats.fake_quantized` computes the model with compressed-tensors' ``fake_quantize`` of its q/k/v."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from transformers.models.llama4 import modeling_llama4  # noqa: E402
from transformers.models.timesfm import modeling_timesfm  # noqa: E402

ARGS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")


def _llama4_vision():
    config = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, pixel_shuffle_ratio=0.5,
        attn_implementation="eager")
    model = transformers.Llama4VisionModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [{"pixel_values": torch.randn(2, 3, 32, 32, generator=generator)} for _ in range(2)]
    return model, batches, modeling_llama4, "vision_eager_attention_forward"


class _TimesFmAttention(torch.nn.Module):
    """One TimesFM attention module as a model: hidden states in, attention output out."""

    def __init__(self):
        super().__init__()
        config = transformers.TimesFmConfig(hidden_size=32, head_dim=8, num_attention_heads=4,
                                            attn_implementation="eager")
        self.attention = modeling_timesfm.TimesFmAttention(config, layer_idx=0)
        torch.nn.init.normal_(self.attention.scaling)  # created uninitialised (torch.empty)

    def forward(self, hidden_states):
        return self.attention(hidden_states)[0]


def _timesfm_attention():
    generator = torch.Generator().manual_seed(1)
    return (_TimesFmAttention().eval(), [torch.randn(2, 7, 32, generator=generator) for _ in range(2)], modeling_timesfm,
            "simple_eager_attention_forward")


MODELS = {"llama4-vision": _llama4_vision, "timesfm-attention": _timesfm_attention}


def _output(out):
    return out if torch.is_tensor(out) else out.last_hidden_state


def _run(model, batch):
    with torch.no_grad():
        return _output(model(**batch) if isinstance(batch, dict) else model(batch))


def _recipe():
    return qstats.Recipe([qstats.Rule("re:.*(self_attn|attention)$", sites=("q", "k", "v"), observer=qstats.minmax,
                                      spec=qstats.QuantSpec.from_compressed_tensors(ARGS))])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_observed_q_k_v_are_what_the_modules_own_eager_function_receives(monkeypatch, name):
    torch.manual_seed(0)
    model, batches, modeling, function = MODELS[name]()
    original = getattr(modeling, function)
    paths = {id(module): path for path, module in model.named_modules()}
    seen: dict = {}

    def recording(module, query, key, value, *args, **kwargs):
        for site, x in zip("qkv", (query, key, value)):
            seen.setdefault((paths[id(module)], site), []).append(x.detach())
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling, function, recording)
    expected = [_run(model, batch) for batch in batches]  # the model's own eager attention, recorded
    outputs = []
    handle = model.register_forward_hook(lambda module, args, kwargs, out: outputs.append(out), with_kwargs=True)
    seen_before = {key: list(xs) for key, xs in seen.items()}
    recipe = _recipe()
    try:
        states = qstats.calibrate(model, batches, recipe, progress=False)
    finally:
        handle.remove()
    assert all(torch.equal(_output(out), ours) for out, ours in zip(outputs, expected))
    assert seen_before and all(len(seen[key]) == 2 * len(xs) for key, xs in seen_before.items())
    for (path, site), xs in seen_before.items():
        state = states[path][site]
        assert torch.equal(state.min_val, torch.stack([x.min() for x in xs]).min()), (path, site)
        assert torch.equal(state.max_val, torch.stack([x.max() for x in xs]).max()), (path, site)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fake_quantized_computes_the_modules_own_eager_function_on_fake_quantized_q_k_v(monkeypatch, name):
    torch.manual_seed(0)
    model, batches, modeling, function = MODELS[name]()
    recipe = _recipe()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    with qstats.fake_quantized(model, qparams, recipe):
        ours = _run(model, batches[0])
    float_output = _run(model, batches[0])
    original = getattr(modeling, function)
    paths = {id(module): path for path, module in model.named_modules()}

    def quantizing(module, query, key, value, *args, **kwargs):
        sites = qparams[paths[id(module)]]
        query, key, value = (fake_quantize(x, sites[site].scale.reshape(1), torch.zeros(1, dtype=torch.int8), ARGS)
                             for site, x in zip("qkv", (query, key, value)))
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling, function, quantizing)
    assert not torch.equal(ours, float_output)
    assert torch.equal(ours, _run(model, batches[0]))
