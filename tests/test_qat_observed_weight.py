"""``QATModel.observed_weight``: a layer's weight as its weight point observes it, to observe the trained
weights once more after training (torch.ao's ``convert_fx`` does).

Reference: torch.ao's ``PerChannelMinMaxObserver`` with ``ch_axis=1`` over each group's rows of a
transposed convolution's weight ``[in, out/groups, *k]`` (per output channel; torch.ao's own QAT keeps
ConvTranspose weights in float), and ``ch_axis=0`` over a convolution's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ao.quantization import PerChannelMinMaxObserver

import qstats

SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, quant_min=-128, quant_max=127)


def _torch_ao_observers(groups: int) -> list:
    return [PerChannelMinMaxObserver(ch_axis=axis, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                     quant_min=-128, quant_max=127) for axis in [1] * groups + [0]]


def _observe(observers, model, groups: int) -> None:
    """torch.ao's observers of ``model``'s weights: one per group of the transposed convolution, then the conv's."""
    for observer, rows in zip(observers, model[0].weight.detach().chunk(groups)):
        observer(rows)
    observers[-1](model[1].weight.detach())


def _torch_ao_scales(observers) -> tuple:
    return torch.cat([o.calculate_qparams()[0] for o in observers[:-1]]), observers[-1].calculate_qparams()[0]


@pytest.mark.parametrize("groups", [1, 2])
def test_trained_weights_observed_once_more_per_output_channel_as_torch_ao(groups):
    # ConvTranspose2d(4, 4 * groups ...): in == out / groups, where the weight as given has the shape of
    # the observed one, so that observing it was silently per input channel
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(4, 4 * groups, 3, groups=groups), nn.Conv2d(4 * groups, 2, 3))
    qat = qstats.qat.prepare(model, qstats.minmax(SPEC), layers=(nn.ConvTranspose2d, nn.Conv2d))
    observers = _torch_ao_observers(groups)
    x = torch.randn(2, 4, 5, 5)
    state = qat.init(x)
    for step in range(3):
        _observe(observers, model, groups)
        _, state = qat.apply(qat.params(), state, x)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # a training step
    _observe(observers, model, groups)
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    scales = [qstats.compute_qparams(qat.weight_observers[layer].update(state.weights[layer],
                                                                         qat.observed_weight(params, layer)), SPEC).scale
              for layer in ("0", "1")]
    for ours, theirs in zip(scales, _torch_ao_scales(observers)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert qat.observed_weight(params, "1") is params["1.weight"]


def test_observed_weight_takes_the_given_tensor_and_names_a_layer_without_weight_observer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose1d(6, 4, 3, groups=2), nn.Linear(5, 3))
    qat = qstats.qat.prepare(model, {nn.ConvTranspose1d: qstats.minmax(SPEC), nn.Linear: None},
                             layers=(nn.ConvTranspose1d, nn.Linear))
    given = torch.randn(6, 2, 3)
    observed = qat.observed_weight({"0.weight": given}, "0")
    # output channel g * 2 + j is column j of group g's rows
    expected = torch.cat([given[:3].transpose(0, 1), given[3:].transpose(0, 1)])
    assert torch.equal(observed, expected)
    assert torch.equal(qat.observed_weight({}, "0"), torch.cat([w.transpose(0, 1) for w in model[0].weight.chunk(2)]))
    with pytest.raises(ValueError, match="'1' has no weight observer"):
        qat.observed_weight({}, "1")


def test_observed_weight_of_a_parametrized_or_tied_weight_is_that_of_the_given_parameters():
    # apply computes a parametrized weight from the given parameters (weight_norm's g and v), and takes a
    # tied weight under any of its names: the observed weight is the one the given parameters make
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.Linear(4, 4))
    model[1].weight = model[0].parametrizations.weight.original1
    qat = qstats.qat.prepare(model, qstats.minmax(SPEC))
    original0 = model[0].parametrizations.weight.original0.detach() * 2
    original1 = torch.randn(4, 4)
    params = {"0.parametrizations.weight.original0": original0, "1.weight": original1}
    reference = torch._weight_norm(original1, original0, dim=0)
    torch.testing.assert_close(qat.observed_weight(params, "0"), reference, rtol=0, atol=0)
    assert torch.equal(qat.observed_weight(params, "1"), original1)
    x = torch.randn(3, 4)
    _, state = qat.apply(params, qat.init(x), x)
    for layer in ("0", "1"):
        assert torch.equal(state.weights[layer].max_val, qat.observed_weight(params, layer).amax(1))
