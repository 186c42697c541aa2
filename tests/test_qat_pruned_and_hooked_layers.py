"""QAT of layers pruned with ``torch.nn.utils.prune`` (a forward pre-hook computes ``weight`` from
``weight_orig`` and ``weight_mask`` before each call), and of layers with other forward hooks.

Reference: torch.ao ``FakeQuantize`` modules wired around the same layers, reading the pruned weight as
prune's hook computes it (``weight_mask * weight_orig``): outputs and the gradients of every parameter,
``weight_orig`` included, over training steps. (The rewritten call ran no hook: the layer read the
product of the pruning-time call, the same whatever ``weight_orig`` was given, and ``weight_orig`` got
no gradient.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, activation_fake_quant, train_beside_reference, weight_fake_quant


def _pruned_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))
    prune.ln_structured(model[0], "weight", amount=0.25, n=2, dim=0)
    prune.l1_unstructured(model[0], "weight", amount=0.3)  # a PruningContainer of two masks
    prune.l1_unstructured(model[3], "weight", amount=0.5)
    prune.random_unstructured(model[3], "bias", amount=0.3)
    return model


def _pruned(module, name):
    return getattr(module, f"{name}_mask") * getattr(module, f"{name}_orig")


class _Reference(nn.Module):
    """The pruned model with torch.ao FakeQuantize modules on each layer's input and pruned weight."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.a_conv, self.a_linear, self.w_conv, self.w_linear = activation_fake_quant(), activation_fake_quant(), weight_fake_quant(), weight_fake_quant()

    def forward(self, x):
        conv, linear = self.model[0], self.model[3]
        h = F.relu(F.conv2d(self.a_conv(x), self.w_conv(_pruned(conv, "weight")), conv.bias)).flatten(1)
        return F.linear(self.a_linear(h), self.w_linear(_pruned(linear, "weight")), _pruned(linear, "bias"))


def test_pruned_layers_train_with_their_masks_as_torch_ao_fake_quant_modules():
    model, reference = _pruned_model(), _Reference(_pruned_model())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                                 qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert not any("hooks" in str(w.message) for w in record)  # pruning's hooks are computed
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    assert {"0.weight_orig", "3.weight_orig", "3.bias_orig"} <= set(params)
    state = qat.init(torch.zeros(1, 2, 4, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 2, 4, 4, generator=g) * (step + 1), torch.randint(0, 3, (5,), generator=g))
               for step in range(3)]
    params, state, steps = train_beside_reference(qat, params, state, reference, reference.model, batches,
                                                  F.cross_entropy)
    assert all(grads["3.weight_orig"].ne(0).sum() > 0 for grads in steps)
    for layer, fq in (("0", reference.w_conv), ("3", reference.w_linear)):
        qp = qstats.compute_qparams(state.weights[layer], W_SPEC)
        torch.testing.assert_close(qp.scale, fq.scale, rtol=1e-6, atol=0)
    observed = qat.observed_weight(params, "3")
    torch.testing.assert_close(observed, model[3].weight_mask * params["3.weight_orig"], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "full_backward_hook", "full_backward_pre_hook"])
def test_layers_whose_hooks_the_rewritten_model_does_not_run_are_named_in_a_warning(kind):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    calls = []
    getattr(model[2], f"register_{kind}")(lambda *args: calls.append(args) and None)
    getattr(model[1], f"register_{kind}")(lambda *args: calls.append(args) and None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    x = torch.randn(3, 4)
    qat.apply(qat.params(), qat.init(x), x)
    assert calls == []  # as the warning says
    assert any("layers ['1', '2'] have forward or backward hooks" in str(w.message) for w in record)


class _Doubled(nn.Linear):
    """A Linear with its own forward: torch.fx traces through it, running its hooks on proxies."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 2


def test_prepare_leaves_a_traced_through_pruned_layer_as_it_was(tmp_path):
    # prune's hook sets module.weight; run on torch.fx's proxies it left a Proxy in the user's model
    # (torch.save of the model raised, module.weight.sum() computed nothing)
    torch.manual_seed(0)
    model = nn.Sequential(_Doubled(4, 4), nn.ReLU(), nn.Linear(4, 2))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    before = model[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hook ran on proxies: the layer's F.linear reads weight_orig * mask
        qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    assert model[0].weight is before
    torch.save(model, tmp_path / "model.pt")
    x = torch.randn(3, 4)
    out, state = qat.apply(qat.params(), qat.init(x), x)
    assert qat.layers == ("0.linear", "2")  # a call of a computed weight, fake-quantized as torch.ao's prepare_qat_fx

    def fake_quantized(weight, key):
        return qstats.fake_quantize(weight, qstats.compute_qparams(state.weights[key], W_SPEC), W_SPEC)

    hidden = F.linear(x, fake_quantized(model[0].weight_orig * model[0].weight_mask, "0.linear"), model[0].bias) * 2
    torch.testing.assert_close(out, F.linear(F.relu(hidden), fake_quantized(model[2].weight, "2"), model[2].bias),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "full_backward_hook", "full_backward_pre_hook"])
def test_traced_through_layers_whose_hooks_the_rewritten_model_does_not_run_are_named_in_a_warning(kind):
    # torch.fx traces through a layer with its own forward (its F.linear is fake-quantized): its hooks run
    # once while tracing, on proxies, and never in the rewritten model; prepare said nothing of them
    model = nn.Sequential(_Doubled(4, 4), nn.ReLU(), nn.Linear(4, 2))
    calls = []
    getattr(model[0], f"register_{kind}")(lambda *args: calls.append(args) and None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    assert "0" in qat.weight_observers  # traced through and quantized
    traced = len(calls)
    x = torch.randn(3, 4, requires_grad=True)
    out, _ = qat.apply(qat.params(), qat.init(x), x)
    out.sum().backward()
    assert len(calls) == traced  # as the warning says
    assert any("layers ['0'] have their own forward, which torch.fx traced through, and hooks" in str(w.message)
               for w in record), [str(w.message) for w in record]


def _record_output(module, inputs, output):
    module.last_output = output


def test_prepare_leaves_a_traced_through_layer_recording_its_output_as_it_was(tmp_path):
    # a forward hook that stores the output on the layer ran on torch.fx's proxies while tracing: the
    # attribute it made is removed, one it replaced gets its earlier value back
    model = nn.Sequential(_Doubled(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].register_forward_hook(_record_output)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hook, which the rewritten model does not run
        qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    assert "last_output" not in vars(model[0])
    torch.save(model, tmp_path / "model.pt")
    x = torch.randn(3, 4)
    model(x)
    earlier = model[0].last_output
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.qat.prepare(model, qstats.minmax(W_SPEC))
    assert model[0].last_output is earlier
    torch.testing.assert_close(earlier, model[0](x), rtol=0, atol=0)
