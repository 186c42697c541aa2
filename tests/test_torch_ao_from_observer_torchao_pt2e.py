"""`qstats.torch_ao.from_observer` of torchao PT2E's observers (``torchao.quantization.pt2e``: copies of
torch.ao's classes, not subclasses), as a PT2E-calibrated model holds them: observing on in qstats
gives the torchao observer's qparams bit for bit, as for torch.ao's own."""

import warnings

import pytest
import torch

import qstats
from qstats import torch_ao

pt2e = pytest.importorskip("torchao.quantization.pt2e")
warnings.filterwarnings("ignore")

OBSERVERS = [
    pt2e.MinMaxObserver.with_args(dtype=torch.int8, quant_min=-128, quant_max=127, eps=2**-12),
    pt2e.MinMaxObserver.with_args(dtype=torch.int16, quant_min=-(2**15), quant_max=2**15 - 1,
                                  qscheme=torch.per_tensor_symmetric),
    pt2e.PerChannelMinMaxObserver.with_args(dtype=torch.int8, quant_min=-127, quant_max=127,
                                            qscheme=torch.per_channel_symmetric, eps=2**-12),
    pt2e.PerChannelMinMaxObserver.with_args(ch_axis=1),
    pt2e.MovingAverageMinMaxObserver.with_args(averaging_constant=0.2, dtype=torch.int8, quant_min=-128,
                                               quant_max=127),
    pt2e.MovingAveragePerChannelMinMaxObserver.with_args(averaging_constant=0.2, ch_axis=1),
]


@pytest.mark.parametrize("constructor", OBSERVERS, ids=lambda c: f"{c.p.func.__name__}-{sorted(c.p.keywords.items())}")
def test_torchao_pt2e_observer_imports_and_observes_on_bit_for_bit(constructor):
    """They were refused: 'cannot import a MinMaxObserver; expected a MinMaxObserver, ...'."""
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(6, 7, generator=generator) * (i + 1) for i in range(4)]
    reference = constructor()
    for batch in data[:2]:
        reference(batch)
    observer, spec, state = torch_ao.from_observer(reference)
    for batch in data[2:]:
        reference(batch)
        state = observer.update(state, batch)
    scale, zero_point = reference.calculate_qparams()
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale.reshape(scale.shape), scale)
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).long(), zero_point.long())


def test_torchao_pt2e_histogram_imports_its_counts_and_extremes():
    data = torch.randn(4, 4096, generator=torch.Generator().manual_seed(0))
    reference = pt2e.HistogramObserver()
    for batch in data:
        reference(batch)
    _, _, state = torch_ao.from_observer(reference)
    assert int(state.counts.sum() + state.underflow.sum() + state.overflow.sum()) == int(reference.histogram.sum())
    assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)


def test_other_torchao_pt2e_observers_are_refused_naming_their_module():
    with pytest.raises(TypeError, match="torchao.quantization.pt2e.observer.PlaceholderObserver"):
        torch_ao.from_observer(pt2e.PlaceholderObserver())
