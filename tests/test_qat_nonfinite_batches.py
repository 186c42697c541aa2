"""A QAT step on a batch of NaN/Inf activations. torch.ao's ``FakeQuantize`` (moving-average observer) takes them
into its range: NaN or Inf for good, so every later step fake-quantizes to NaN. qstats' observers leave them out
and count them (docs/differences.md): the range is the finite batches', and a layer whose state has seen nothing
else raises, naming the layer and saying why (docs/qat.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qstats
from _qat_torch_ao_reference import activation_fake_quant

SPEC = qstats.QuantSpec("uint8", "asymmetric")
WEIGHTS = qstats.memoryless_minmax(qstats.QuantSpec("int8", granularity=qstats.PerAxis(0)))


def _qat():
    torch.manual_seed(0)
    return qstats.qat.prepare(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), WEIGHTS,
                              qstats.moving_average_minmax(SPEC, 0.01))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_first_batch_of_non_finite_values_only_raises_naming_the_layer_and_why(bad):
    qat = _qat()
    x = torch.full((5, 4), bad)
    reference = activation_fake_quant()
    reference(x)  # torch.ao's range takes the NaN or Inf: a NaN or Inf scale
    assert not torch.isfinite(reference.scale).all()
    # before: "saw no data; observe it first: steps with phase.observe=True", on a step that observed
    with pytest.raises(ValueError, match=r"the input of layer '0' .*saw no data \(no finite value: observers leave NaN "
                                         r"and \+-Inf out, counting them in the state's nonfinite\)"):
        qat.apply(qat.params(), qat.init(torch.zeros(1, 4)), x)
    # observed alone, then fake-quantized from that state: the same error
    _, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    assert int(state.activations["0"].nonfinite) == x.numel() and int(state.activations["0"].count) == 0
    with pytest.raises(ValueError, match=r"the input of layer '0' .*no finite value"):
        qat.apply(qat.params(), state, torch.randn(5, 4), phase=qstats.QATPhase(observe=False, fake_quantize=True))


def test_a_non_finite_batch_after_finite_ones_leaves_the_range_of_the_finite_ones():
    qat = _qat()
    g = torch.Generator().manual_seed(1)
    clean = [torch.randn(5, 4, generator=g) for _ in range(3)]
    state = qat.init(clean[0])
    reference = activation_fake_quant()
    for x in clean[:2]:
        reference(x)
        _, state = qat.apply(qat.params(), state, x)
    torch.testing.assert_close(state.activations["0"].min_val, reference.activation_post_process.min_val)
    torch.testing.assert_close(state.activations["0"].max_val, reference.activation_post_process.max_val)
    dirty = clean[2].clone()
    dirty[0, 0] = float("nan")
    reference(dirty)
    _, after = qat.apply(qat.params(), state, dirty)
    assert torch.isnan(reference.scale).all()  # torch.ao: NaN for good
    finite = dirty[torch.isfinite(dirty)]  # qstats: the moving average of the finite values
    for field, extreme in (("min_val", finite.min()), ("max_val", finite.max())):
        expected = getattr(state.activations["0"], field) + 0.01 * (extreme - getattr(state.activations["0"], field))
        torch.testing.assert_close(getattr(after.activations["0"], field), expected)
    assert int(after.activations["0"].nonfinite) == 1
    out, _ = qat.apply(qat.params(), after, clean[2])
    assert torch.isfinite(out).all()
