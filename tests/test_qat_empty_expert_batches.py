"""A layer given an empty batch (an expert of a mixture routed no tokens) in a fake-quantizing step. torch.ao's
``FakeQuantize`` returns the empty tensor and leaves its observer as it was; torchao's fake quantizers raise a
TypeError. qstats passes it too, whatever its state saw (before: a ValueError, "fake-quantized from a state that saw
no data", at the first fake-quantizing step in which an expert that had never had a token got none again). Reference:
torch.ao's ``FakeQuantize`` modules around the router's and the experts' inputs and weights, trained step by step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, activation_fake_quant, train_beside_reference, weight_fake_quant


class _Mixture(nn.Module):
    """A router and two Linear experts, each given the rows routed to it (by boolean mask), scaled by its gate."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 3) for _ in range(2)])

    def forward(self, x):
        logits = self.router(x)
        choice = logits.argmax(-1)
        out = x.new_zeros(x.shape[0], 3)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            out = out.index_put((mask,), expert(x[mask]))
        return out * logits.softmax(-1).amax(-1, keepdim=True)


def _mixture() -> _Mixture:
    torch.manual_seed(0)
    model = _Mixture()
    with torch.no_grad():  # every token to expert 0: expert 1 gets empty batches
        model.router.weight.mul_(0.01)
        model.router.bias.copy_(torch.tensor([10.0, -10.0]))
    return model


def test_an_expert_routed_no_tokens_trains_as_torch_ao_fake_quantize_modules():
    model = _mixture()
    layers = ["router", "experts.0", "experts.1"]
    inputs = {name: activation_fake_quant() for name in layers}
    weights = {name: weight_fake_quant() for name in layers}

    def reference_forward(x):
        def call(name, h):
            layer = model.get_submodule(name)
            return F.linear(inputs[name](h), weights[name](layer.weight), layer.bias)

        logits = call("router", x)
        choice = logits.argmax(-1)
        out = x.new_zeros(x.shape[0], 3)
        for index in range(2):
            mask = choice == index
            out = out.index_put((mask,), call(f"experts.{index}", x[mask]))
        return out * logits.softmax(-1).amax(-1, keepdim=True)

    # torch.ao's spec, raising on a state that saw no data as qstats' own specs do (from_torch_ao's falls back to
    # FakeQuantize's scale 1 instead)
    raising = ACT_SPEC.replace(on_uncalibrated="raise")
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(raising, 0.01))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(4)]
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    state = qat.init(batches[0][0])
    # fake-quantizing from the first step, as torch.ao's FakeQuantize by default: expert 1 never sees a token
    params, state, steps = train_beside_reference(qat, params, state, reference_forward, model, batches,
                                                  lambda out, y: F.mse_loss(out, y))
    assert all(torch.equal(step["experts.1.weight"], torch.zeros(3, 4)) for step in steps)
    expert = state.activations["experts.1"]
    assert int(expert.count) == 0 and torch.isinf(inputs["experts.1"].activation_post_process.min_val)
    for name in ("router", "experts.0"):
        observer = inputs[name].activation_post_process
        torch.testing.assert_close(state.activations[name].min_val, observer.min_val)
        torch.testing.assert_close(state.activations[name].max_val, observer.max_val)


def test_an_expert_given_tokens_at_last_fake_quantizes_only_from_what_it_observed():
    model = _mixture()
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(qstats.QuantSpec("uint8", "asymmetric"), 0.01))
    x = torch.randn(6, 4)
    state = qat.init(x)
    _, state = qat.apply(qat.params(), state, x)  # expert 1: an empty batch, nothing to fake-quantize
    params = {**qat.params(), "router.bias": torch.tensor([-10.0, 10.0])}  # every token to expert 1 now
    with pytest.raises(ValueError, match=r"the input of layer 'experts.1' .*saw no data"):
        qat.apply(params, state, x, phase=qstats.QATPhase(observe=False, fake_quantize=True))
    out, state = qat.apply(params, state, x)  # observed, then fake-quantized from this batch's range
    layer = model.experts[1]
    observer = qat.activation_observers["experts.1"]
    x_range = observer.update(observer.init(x), x)
    assert torch.equal(state.activations["experts.1"].max_val, x_range.max_val)
    spec = observer.spec
    w_spec = qat.weight_observers["experts.1"].spec
    w_fq = qstats.fake_quantize(layer.weight, qstats.compute_qparams(state.weights["experts.1"], w_spec), w_spec)
    expert_out = F.linear(qstats.fake_quantize(x, qstats.compute_qparams(x_range, spec), spec), w_fq, layer.bias)
    r_spec = qat.weight_observers["router"].spec
    router_w = qstats.fake_quantize(model.router.weight, qstats.compute_qparams(state.weights["router"], r_spec), r_spec)
    router_x = qstats.fake_quantize(x, qstats.compute_qparams(state.activations["router"], spec), spec)
    gate = F.linear(router_x, router_w, params["router.bias"]).softmax(-1).amax(-1, keepdim=True)
    torch.testing.assert_close(out, expert_out * gate)


def test_an_empty_batch_on_a_dynamic_point_passes_through():
    # a dynamic point observes each batch afresh; an empty one has no value to fake-quantize (before: a ValueError)
    qat = qstats.qat.prepare(nn.Sequential(nn.Linear(4, 2)), None, qstats.minmax(qstats.QuantSpec("uint8", "asymmetric")),
                             dynamic_activations=True)
    out, _ = qat.apply(qat.params(), qat.init(torch.randn(3, 4)), torch.randn(0, 4))
    reference = activation_fake_quant()
    assert out.shape == (0, 2) and reference(torch.randn(0, 4)).shape == (0, 4)
