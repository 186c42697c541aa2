"""qstats.calibrate / observing / compute_qparams_tree / fake_quantized on transformers families no
other test calibrates: vision (ViT, Swin, ResNet's Conv2d and batch norm, ConvNeXt's depthwise Conv2d),
audio (Wav2Vec2's Conv1d feature encoder and its weight-normed positional Conv1d) and state space
(Mamba, also inside ``model.generate``), each against torch.ao's observers fed by plain forward hooks
and ``torch.fake_quantize_per_*`` applied by hand: every Linear/Conv site observed, the same ranges,
qparams and fake-quantized outputs, the model as it was after each context.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver
from torch.nn.utils import parametrize

import qstats

transformers = pytest.importorskip("transformers")

WEIGHT = dict(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
ACTIVATION = dict(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)


def _recipe(ignore=()):
    classes = tuple(layer.__name__ for layer in LAYERS)
    return qstats.Recipe([
        qstats.Rule(classes, sites=("weight",), spec=qstats.QuantSpec.from_torch_ao(**WEIGHT)),
        qstats.Rule(classes, sites=("input", "output"), spec=qstats.QuantSpec.from_torch_ao(**ACTIVATION)),
    ], ignore=list(ignore))  # fmt: skip


def _layers(model, ignore=()):
    return {path: module for path, module in model.named_modules() if isinstance(module, LAYERS) and path not in ignore}


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return next((t for t in map(_first_tensor, value) if t is not None), None) if isinstance(value, tuple) else None


def _torch_ao_observers(model, batches, run, ignore=()):
    """{(path, site): torch.ao observer} over ``run(model, batch)`` for every batch, from plain forward
    hooks on the layers (the input: their first positional argument), weights observed once."""
    observers, handles = {}, []

    def feed(observer, x):
        if x is not None and x.is_floating_point():
            observer(x.detach())

    for path, layer in _layers(model, ignore).items():
        observers[path, "weight"] = PerChannelMinMaxObserver(**WEIGHT)
        observers[path, "weight"](layer.weight.detach())
        observers[path, "input"] = before = MinMaxObserver(**ACTIVATION)
        observers[path, "output"] = after = MinMaxObserver(**ACTIVATION)
        handles.append(layer.register_forward_pre_hook(lambda _, args, o=before: feed(o, args[0])))
        handles.append(layer.register_forward_hook(lambda _, args, out, o=after: feed(o, _first_tensor(out))))
    with torch.no_grad():
        for batch in batches:
            run(model, batch)
    for handle in handles:
        handle.remove()
    return {key: observer for key, observer in observers.items() if torch.isfinite(observer.min_val).all()}


class _HandFakeQuantizedWeight(torch.nn.Module):
    def __init__(self, scale, zero_point):
        super().__init__()
        self.scale, self.zero_point = scale, zero_point

    def forward(self, weight):
        return torch.fake_quantize_per_channel_affine(weight, self.scale, self.zero_point.int(), 0, -128, 127)


def _hand_fake_quantized_output(model, batch, observers, run, ignore=()):
    """``run(model, batch)``'s first tensor with every observed layer's weight (a parametrization after
    the model's own, as weight norm's) and input/output fake-quantized by torch's own ops."""

    def activation(key):
        scale, zero_point = observers[key].calculate_qparams()
        return lambda x: torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, 255)

    handles, parametrized = [], []
    for path, layer in _layers(model, ignore).items():
        if (path, "weight") in observers:
            parametrize.register_parametrization(layer, "weight", _HandFakeQuantizedWeight(*observers[path, "weight"].calculate_qparams()))
            parametrized.append(layer)
        if (path, "input") in observers:
            quantize = activation((path, "input"))
            handles.append(layer.register_forward_pre_hook(lambda _, args, q=quantize: (q(args[0]), *args[1:])))
        if (path, "output") in observers:
            quantize = activation((path, "output"))
            handles.append(layer.register_forward_hook(lambda _, args, out, q=quantize: q(out)))
    try:
        with torch.no_grad():
            return _first_tensor(run(model, batch))
    finally:
        for handle in handles:
            handle.remove()
        for layer in parametrized:
            del layer.parametrizations["weight"][-1]
            if not len(layer.parametrizations["weight"]):
                parametrize.remove_parametrizations(layer, "weight", leave_parametrized=False)


def _model_as_it_is(model):
    return ({key: value.clone() for key, value in model.state_dict().items()},
            [(name, id(p)) for name, p in model.named_parameters()],
            {path: (type(m).__name__, len(m._forward_hooks), len(m._forward_pre_hooks)) for path, m in model.named_modules()})  # fmt: skip


def _assert_same_model(before, after):
    assert list(before[0]) == list(after[0])
    assert all(torch.equal(before[0][key], after[0][key]) for key in before[0])
    assert before[1:] == after[1:]


def _forward(model, batch):
    return model(**batch)


def _generate(model, batch):
    out = model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    return torch.stack(out.scores)


def _images():
    generator = torch.Generator().manual_seed(1)
    return [{"pixel_values": torch.randn(2, 3, 32, 32, generator=generator)} for _ in range(2)]


def _family(name):
    """(model, batches, run, layers the recipe ignores, sites no call reaches) of a tiny random model."""
    torch.manual_seed(0)
    if name == "vit":
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                        image_size=32, patch_size=8)
        return transformers.ViTModel(config), _images(), _forward, (), ()
    if name == "swin":
        config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                         window_size=4)
        return transformers.SwinModel(config), _images(), _forward, (), ()
    if name == "resnet":
        config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                           layer_type="basic")
        return transformers.ResNetModel(config), _images(), _forward, (), ()
    if name == "convnext":
        config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)
        return transformers.ConvNextModel(config), _images(), _forward, (), ()
    if name == "wav2vec2":
        config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                             num_conv_pos_embedding_groups=2)
        generator = torch.Generator().manual_seed(1)
        audio = [{"input_values": torch.randn(2, 400, generator=generator)} for _ in range(2)]
        return transformers.Wav2Vec2Model(config), audio, _forward, (), ()
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2,
                                      intermediate_size=64, conv_kernel=4, time_step_rank=4, use_mambapy=False)
    generator = torch.Generator().manual_seed(1)
    ids = [{"input_ids": torch.randint(2, 64, (2, 7), generator=generator)} for _ in range(2)]
    # the slow (CPU) mixer reads conv1d's and dt_proj's weights without calling the modules
    unseen = {f"backbone.layers.{i}.mixer.{layer}.{site}" for i in range(2) for layer in ("conv1d", "dt_proj")
              for site in ("input", "output")}  # fmt: skip
    return transformers.MambaForCausalLM(config), ids, _generate if name == "mamba generate" else _forward, ("lm_head",), unseen


@pytest.mark.parametrize("name", ["vit", "swin", "resnet", "convnext", "wav2vec2", "mamba", "mamba generate"])
def test_every_layer_calibrates_and_fake_quantizes_as_torch_ao_and_torch_fake_quantize(name):
    torch.set_num_threads(1)
    model, batches, run, ignore, unseen = _family(name)
    model.eval()
    recipe = _recipe(ignore)
    before = _model_as_it_is(model)
    observers = _torch_ao_observers(model, batches, run, ignore)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with qstats.observing(model, recipe) as session, torch.no_grad():
            for batch in batches:
                run(model, batch)
    named = " ".join(str(w.message) for w in caught if issubclass(w.category, qstats.UncalibratedWarning))
    assert all(site in named for site in unseen) and (named == "") == (not unseen)
    states = session.states
    assert {(path, site) for path, entry in states.items() for site in entry} == set(observers)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for (path, site), observer in observers.items():
        assert torch.equal(states[path][site].min_val, observer.min_val), (path, site)
        assert torch.equal(states[path][site].max_val, observer.max_val), (path, site)
        scale, zero_point = observer.calculate_qparams()
        assert torch.equal(qparams[path][site].scale.reshape(scale.shape), scale), (path, site)
        assert torch.equal(qparams[path][site].zero_point.reshape(zero_point.shape).long(), zero_point.long()), (path, site)
    _assert_same_model(before, _model_as_it_is(model))
    with torch.no_grad(), qstats.fake_quantized(model, qparams, recipe):
        got = _first_tensor(run(model, batches[0]))
    _assert_same_model(before, _model_as_it_is(model))
    want = _hand_fake_quantized_output(model, batches[0], observers, run, ignore)
    assert torch.equal(got, want)
