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
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import qstats
from _qat_torch_ao_reference import W_SPEC, train_beside_reference, weight_fake_quant


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


def test_parametrized_weights_train_as_torch_ao_fake_quant_modules_without_warnings():
    model, reference = _model(), _model()
    fake_quants = [weight_fake_quant(), weight_fake_quant()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01))
    assert [str(w.message) for w in record] == []
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    state = qat.init(torch.zeros(1, 6))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 6, generator=g) * (step + 1), torch.randn(5, 3, generator=g)) for step in range(3)]

    def expected(x):
        first, second = reference[0], reference[2]
        h = F.relu(F.linear(x, fake_quants[0](first.weight), first.bias))
        return F.linear(h, fake_quants[1](second.weight), second.bias)

    params, state, steps = train_beside_reference(qat, params, state, expected, reference, batches, F.mse_loss)
    assert all(len(grads) == len(dict(reference.named_parameters())) for grads in steps)
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
    fake_quants = [weight_fake_quant(), weight_fake_quant()]
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
    batches = [(torch.randn(5, 2, 4, generator=g) * (step + 1), torch.randn(5, 3, generator=g)) for step in range(2)]

    def expected(x):
        conv, linear = reference[0], reference[3]
        weights = [torch._weight_norm(m.weight_v, m.weight_g, dim) for m, dim in ((conv, 0), (linear, -1))]
        h = F.relu(F.conv1d(x, fake_quants[0](weights[0]), conv.bias)).flatten(1)
        return F.linear(h, fake_quants[1](weights[1]), linear.bias)

    params, state, _ = train_beside_reference(qat, params, state, expected, reference, batches, F.mse_loss)
    torch.testing.assert_close(qat.observed_weight(params, "0"),
                               torch._weight_norm(params["0.weight_v"], params["0.weight_g"], 0), rtol=0, atol=0)
