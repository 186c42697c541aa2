"""GPT-2's projections are transformers' ``Conv1D``: a Linear whose weight is stored transposed,
``[in_features, out_features]`` (and a transposed convolution's is ``[in, out / groups, *kernel]``). A weight spec is read on the tensor as stored, so ``PerAxis(0)``,
"per output channel" on a Linear (docs/calibrate.md), gives a Conv1D one scale per input feature,
and groups run along its output features. `calibrate` and `observing` say so, naming the modules and
``PerAxis(1)``, which gives the per-output-channel scales: those of torch.ao's
``PerChannelMinMaxObserver`` on the Linear layout ``weight.T``, and the fake-quantized model's
logits those of ``torch.fake_quantize_per_channel_affine`` applied there by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats

transformers = pytest.importorskip("transformers")

PER_CHANNEL = dict(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    batches = [{"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}]
    return transformers.GPT2LMHeadModel(config).eval(), batches


def _recipe(granularity):
    spec = qstats.QuantSpec.from_torch_ao(**PER_CHANNEL).replace(granularity=granularity)
    return qstats.Recipe([qstats.Rule("Conv1D", sites=("weight",), spec=spec)])


def _transposed_warnings(caught) -> list:
    return [str(w.message) for w in caught if "stored transposed" in str(w.message)]


@pytest.mark.parametrize("granularity", [qstats.PerAxis(0), qstats.PerGroup(8), qstats.PerBlock((8, 8))])
@pytest.mark.parametrize("entry", ["calibrate", "observing"])
def test_a_spec_reading_the_stored_axes_of_conv1d_weights_is_named(granularity, entry):
    model, batches = _gpt2()
    recipe = _recipe(granularity)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if entry == "calibrate":
            states = qstats.calibrate(model, batches, recipe, progress=False)
        else:
            with qstats.observing(model, recipe) as session, torch.no_grad():
                model(**batches[0])
            states = session.states
    (message,) = _transposed_warnings(caught)
    assert f"{entry}: " in message and "'transformer.h.0.attn.c_attn'" in message and "and 5 more" in message
    assert "PerAxis(1)" in message and repr(granularity) in message
    if granularity == qstats.PerAxis(0):  # what it names: one scale per input feature, not per output channel
        weight = model.transformer.h[0].attn.c_attn.weight
        assert states["transformer.h.0.attn.c_attn"]["weight"].max_val.shape == (weight.shape[0],) == (32,)


def test_per_axis_1_gives_conv1d_weights_torch_ao_per_output_channel_scales_and_fake_quantized_logits():
    model, batches = _gpt2()
    recipe = _recipe(qstats.PerAxis(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = qstats.calibrate(model, batches, recipe, progress=False)
    assert not _transposed_warnings(caught)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert len(qparams) == 8
    quantized = {}
    for path, entry in qparams.items():
        linear_weight = model.get_submodule(path).weight.detach().T  # [out, in]
        observer = PerChannelMinMaxObserver(ch_axis=0, **PER_CHANNEL)
        observer(linear_weight)
        scale, zero_point = observer.calculate_qparams()
        assert torch.equal(entry["weight"].scale, scale), path
        quantized[path] = torch.fake_quantize_per_channel_affine(linear_weight, scale, zero_point.int(), 0, -128, 127)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, recipe):
        got = model(**batches[0]).logits
    floats = {path: model.get_submodule(path).weight.data for path in quantized}
    try:
        for path, weight in quantized.items():
            model.get_submodule(path).weight.data = weight.T
        with torch.no_grad():
            want = model(**batches[0]).logits
    finally:
        for path, weight in floats.items():
            model.get_submodule(path).weight.data = weight
    assert torch.equal(got, want)


def test_a_transposed_convolution_is_named_under_per_axis_0_and_per_axis_1_is_torch_ao_per_output_channel():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 6, 3), torch.nn.ReLU(), torch.nn.Conv2d(6, 5, 3)).eval()
    batches = [torch.randn(2, 4, 5, 5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_axis_0 = qstats.QuantSpec.from_torch_ao(**PER_CHANNEL)
        qstats.calibrate(model, batches, qstats.Recipe([qstats.Rule(("ConvTranspose2d", "Conv2d"), sites=("weight",),
                                                                    spec=per_axis_0)]), progress=False)
    (message,) = _transposed_warnings(caught)
    assert "'0'" in message and "'2'" not in message and "PerAxis(1)" in message
    per_axis_1 = qstats.QuantSpec.from_torch_ao(ch_axis=1, **PER_CHANNEL)
    recipe = qstats.Recipe([qstats.Rule("ConvTranspose2d", sites=("weight",), spec=per_axis_1),
                            qstats.Rule("Conv2d", sites=("weight",), spec=per_axis_0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    assert not _transposed_warnings(caught)
    observer = PerChannelMinMaxObserver(ch_axis=1, **PER_CHANNEL)
    observer(model[0].weight.detach())
    scale, zero_point = observer.calculate_qparams()
    assert torch.equal(qparams["0"]["weight"].scale, scale) and scale.shape == (6,)
