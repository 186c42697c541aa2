"""QAT of layers whose weight is computed by a ``torch.nn.utils.parametrize`` parametrization
(``weight_norm``, a user's own).

Reference: torch.ao ``FakeQuantize`` modules wired around the same layers, fake-quantizing the weight the
parametrization computes: outputs and the gradients of the parametrization's parameters. ``prepare``
warns nothing (torch.fx warned of a get_attr node "with no underlying reference" for the property).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, MovingAveragePerChannelMinMaxObserver
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import qstats

W_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)


class _Scaled(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, weight):
        return weight * self.gain[:, None]


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(6, 8)), nn.ReLU(), nn.Linear(8, 3))
    parametrize.register_parametrization(model[2], "weight", _Scaled(3))
    return model


def _weight_fq():
    return FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)


def test_parametrized_weights_train_as_torch_ao_fake_quant_modules_without_warnings():
    model, reference = _model(), _model()
    fake_quants = [_weight_fq(), _weight_fq()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01))
    assert [str(w.message) for w in record] == []
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    state = qat.init(torch.zeros(1, 6))
    g = torch.Generator().manual_seed(1)

    def loss_fn(p, s, x, y):
        out, new_state = qat.apply(p, s, x)
        return F.mse_loss(out, y), new_state

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    for step in range(3):
        x, y = torch.randn(5, 6, generator=g) * (step + 1), torch.randn(5, 3, generator=g)
        first, second = reference[0], reference[2]
        h = F.relu(F.linear(x, fake_quants[0](first.weight), first.bias))
        expected = F.linear(h, fake_quants[1](second.weight), second.bias)
        reference.zero_grad()
        F.mse_loss(expected, y).backward()
        grads, state = grad_fn(params, state, x, y)
        assert len(grads) == len(dict(reference.named_parameters()))
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)
        params = {name: p - 0.1 * grads[name] for name, p in params.items()}
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
    for layer, fq in zip(("0", "2"), fake_quants):
        torch.testing.assert_close(qstats.compute_qparams(state.weights[layer], W_SPEC).scale, fq.scale, rtol=1e-6, atol=0)


def test_deprecated_weight_norm_hook_trains_as_torch_ao_fake_quant_modules():
    # torch.nn.utils.weight_norm (a forward pre-hook computing weight from weight_g and weight_v, as audio
    # models' convolutions use it): the rewritten call ran no hook, so the layer read the weight of the
    # last eager call, and weight_g / weight_v got no gradient
    def model():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its deprecation
            return nn.Sequential(torch.nn.utils.weight_norm(nn.Conv1d(2, 4, 3), dim=0), nn.ReLU(), nn.Flatten(),
                                 torch.nn.utils.weight_norm(nn.Linear(8, 3), dim=None))

    ours, reference = model(), model()
    fake_quants = [_weight_fq(), _weight_fq()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(ours, qstats.moving_average_minmax(W_SPEC, 0.01))
    assert [str(w.message) for w in record] == []
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    params["0.weight_g"] = params["0.weight_g"] * 2  # trained copies, not the model's tensors
    with torch.no_grad():
        reference[0].weight_g.mul_(2)
    state = qat.init(torch.zeros(1, 2, 4))
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x, y = torch.randn(5, 2, 4, generator=g) * (step + 1), torch.randn(5, 3, generator=g)
        conv, linear = reference[0], reference[3]
        weights = [torch._weight_norm(m.weight_v, m.weight_g, dim) for m, dim in ((conv, 0), (linear, -1))]
        h = F.relu(F.conv1d(x, fake_quants[0](weights[0]), conv.bias)).flatten(1)
        reference.zero_grad()
        F.mse_loss(F.linear(h, fake_quants[1](weights[1]), linear.bias), y).backward()
        grads, state = torch.func.grad(lambda p, s: (F.mse_loss((r := qat.apply(p, s, x))[0], y), r[1]),
                                       has_aux=True)(params, state)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)
        params = {name: p - 0.1 * grads[name] for name, p in params.items()}
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
    torch.testing.assert_close(qat.observed_weight(params, "0"),
                               torch._weight_norm(params["0.weight_v"], params["0.weight_g"], 0), rtol=0, atol=0)
