"""torch.ao arguments of the drop-in that reach torch.ao's side: an ``eps`` given beside ``spec=``
(torch.ao's observer with that eps is the reference), and the number of linear bins of the
histogram entry a histogram drop-in saves for torch.ao's ``HistogramObserver(bins=...)``."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao

warnings.filterwarnings("ignore")

TINY = torch.tensor([0.0, 1e-5])  # a range whose scale torch.ao floors at eps


def test_eps_beside_a_spec_that_disagrees_is_refused_by_name():
    """The eps was dropped silently: the drop-in floored its scale at the spec's eps, torch.ao's
    observer with the same arguments at the eps given."""
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8)
    reference = tq.MinMaxObserver(eps=1e-3)
    reference(TINY)
    assert float(reference.calculate_qparams()[0]) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match=r"eps 0\.001 \(the spec: 1\.19"):
        torch_ao.QstatsObserver(qstats.minmax, spec, eps=1e-3)
    with pytest.raises(ValueError, match="eps"):
        tq.FakeQuantize.with_args(observer=torch_ao.QstatsObserver.with_args(observer=qstats.minmax, spec=spec),
                                  quant_min=0, quant_max=255, dtype=torch.quint8, eps=1e-3)()


@pytest.mark.parametrize("eps", (1e-3, 2**-12, 1e-8))
def test_eps_beside_a_spec_that_agrees_gives_torch_aos_qparams(eps):
    """Compared in float32 (torch.ao's eps buffer): 1e-8 given beside a spec built with 1e-8."""
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, eps=eps)
    ours = torch_ao.QstatsObserver(qstats.minmax, spec, eps=eps)
    reference = tq.MinMaxObserver(eps=eps)
    for observer in (ours, reference):
        observer(TINY)
    assert ours.eps == float(reference.eps)
    assert all(torch.equal(a, b) for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()))


def test_eps_without_a_spec_is_still_torch_aos_argument():
    ours, reference = torch_ao.QstatsObserver(qstats.minmax, eps=1e-3), tq.MinMaxObserver(eps=1e-3)
    for observer in (ours, reference):
        observer(TINY)
    assert all(torch.equal(a, b) for a, b in zip(ours.calculate_qparams(), reference.calculate_qparams()))
    default = torch_ao.QstatsObserver(qstats.minmax)
    assert default.eps == float(tq.MinMaxObserver().eps)


@pytest.mark.parametrize("bins", (100, 256, 1000, 2048, 4096))
def test_histogram_checkpoint_loads_into_torch_ao_with_its_bins(bins):
    """Only HistogramObserver(bins=2048) could load it: other bin counts failed with a size mismatch
    of 'histogram'. The reference sees the data in one batch (no re-binning of its own)."""
    data = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    ours = torch_ao.QstatsObserver(qstats.histogram, torch_ao_bins=bins)
    direct = tq.HistogramObserver(bins=bins)
    for batch in data:
        ours(batch)
    direct(data.flatten())
    loaded = tq.HistogramObserver(bins=bins)
    result = loaded.load_state_dict(ours.state_dict(), strict=False)
    assert "histogram" not in result.missing_keys
    assert float(loaded.histogram.sum()) == data.numel()
    assert torch.equal(loaded.min_val, direct.min_val) and torch.equal(loaded.max_val, direct.max_val)
    difference = (loaded.histogram.cumsum(0) - direct.histogram.cumsum(0)).abs().max()
    assert float(difference) <= 1e-3 * data.numel()
    assert abs(float(loaded.calculate_qparams()[0] / direct.calculate_qparams()[0]) - 1) <= 0.01
    back = torch_ao.QstatsObserver(qstats.histogram)  # torch.ao's bins are not qstats' state
    back.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state, ours.state))


@pytest.mark.parametrize("observer, bins, match", [
    (qstats.histogram, 0, "positive int"),
    (qstats.histogram, 2.5, "positive int"),
    (qstats.minmax, 256, "histogram observers"),
])
def test_torch_ao_bins_refusals_name_it(observer, bins, match):
    with pytest.raises(ValueError, match=match):
        torch_ao.QstatsObserver(observer, torch_ao_bins=bins)


@pytest.mark.parametrize("eps", (1e-50, 1e-40))
def test_an_eps_that_float32_rounds_out_of_the_normal_range_is_named_as_given(eps):
    """torch.ao keeps eps as a float32 buffer: 1e-50 becomes 0 there, and a constant input gets scale 0,
    silently. The drop-in refuses it, naming the eps given (it named only the rounded value, 0.0)."""
    reference = tq.MinMaxObserver(eps=eps)
    reference(torch.zeros(4))
    assert float(reference.calculate_qparams()[0]) < torch.finfo(torch.float32).tiny
    with pytest.raises(ValueError, match=f"eps {eps!r} is .* in float32"):
        torch_ao.QstatsObserver(qstats.minmax, eps=eps)
