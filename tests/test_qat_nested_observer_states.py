"""QAT with an observer whose state nests a NamedTuple (as `qstats.observers.kit` allows) under a
schedule of tensor steps (bool-tensor phase flags: one compiled graph): equal to torch.ao's
``FakeQuantize`` modules toggled by the same schedule (the tensor flags raised a bare TypeError from
``torch.where`` on the nested state)."""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, MinMaxObserver

import qstats
from qstats.observers import kit

WEIGHT_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_symmetric, quant_min=-128, quant_max=127)
ACT_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine, quant_min=0, quant_max=255)


@kit.register_state
class NestedExtremes(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


@kit.register_state
class NestedMinMaxState(NamedTuple):
    extremes: NestedExtremes
    count: torch.Tensor


@kit.register_range_rule(NestedMinMaxState)
def _nested_rule(state, spec):
    return kit.Range(state.extremes.low, state.extremes.high, state.count)


def nested_minmax(spec: qstats.QuantSpec) -> kit.Observer:
    """Running min/max (torch.ao's MinMaxObserver) kept in a nested NamedTuple."""
    spec = kit.check_spec(spec)

    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return NestedMinMaxState(NestedExtremes(torch.full(shape, float("inf")), torch.full(shape, -float("inf"))),
                                 torch.zeros(shape, dtype=torch.int64))

    def update_fn(state, x, weight: Optional[torch.Tensor] = None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, spec.granularity, state.count.shape, "nested_minmax.update").float()
        low, high = view.amin(dim=(0, -1)), view.amax(dim=(0, -1))
        return NestedMinMaxState(
            NestedExtremes(torch.minimum(state.extremes.low, low), torch.maximum(state.extremes.high, high)),
            state.count + torch.isfinite(view).sum(dim=(0, -1)))

    def merge_fn(a, b):
        return NestedMinMaxState(
            NestedExtremes(torch.minimum(a.extremes.low, b.extremes.low),
                           torch.maximum(a.extremes.high, b.extremes.high)), a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="nested_minmax")


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


class _TorchAo(nn.Module):
    """The MLP with torch.ao FakeQuantize modules on each Linear's input and weight."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.points = nn.ModuleList(
            FakeQuantize(observer=MinMaxObserver, quant_min=low, quant_max=high, dtype=dtype, qscheme=qscheme)
            for _ in range(2)
            for low, high, dtype, qscheme in ((0, 255, torch.quint8, torch.per_tensor_affine),
                                              (-128, 127, torch.qint8, torch.per_tensor_symmetric)))

    def toggle(self, phase):
        for point in self.points:
            point.enable_observer(bool(phase.observe))
            point.enable_fake_quant(bool(phase.fake_quantize))

    def forward(self, x):
        first, second = self.mlp[0], self.mlp[2]
        h = F.relu(F.linear(self.points[0](x), self.points[1](first.weight), first.bias))
        return F.linear(self.points[2](h), self.points[3](second.weight), second.bias)


def test_nested_state_observer_under_tensor_steps_trains_as_torch_ao_fake_quantize():
    torch.manual_seed(0)
    model, reference = _mlp(), _TorchAo(_mlp())
    reference.mlp.load_state_dict(model.state_dict())
    qat = qstats.qat.prepare(model, nested_minmax(WEIGHT_SPEC), nested_minmax(ACT_SPEC))
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    state = qat.init(torch.zeros(1, 6))
    schedule = qstats.QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)

    def loss_fn(p, s, x, y, phase):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return F.cross_entropy(out, y), new_state

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(5, 6, generator=g) * 2, torch.randint(0, 3, (5,), generator=g)
        phase = schedule(torch.tensor(step))
        assert isinstance(phase.observe, torch.Tensor)
        reference.toggle(phase)
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        grads, state = grad_fn(params, state, x, y, phase)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.mlp.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for p in reference.mlp.parameters():
                p -= 0.1 * p.grad
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
    for key, point in (("0", reference.points[0]), ("2", reference.points[2])):
        extremes = state.activations[key].extremes
        assert torch.equal(extremes.low, point.activation_post_process.min_val)
        assert torch.equal(extremes.high, point.activation_post_process.max_val)
        assert torch.equal(qstats.compute_qparams(state.activations[key], ACT_SPEC).scale.reshape(1), point.scale)
