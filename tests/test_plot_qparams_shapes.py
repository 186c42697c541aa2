"""`qstats.plot.histogram` draws the clipping range of QParams computed from the state drawn: QParams of
another state (another expert count, other channels, per-tensor QParams of a per-channel state) are
refused naming both shapes. They used to be indexed as far as they went, drawing another expert's or
channel's range (or a bare IndexError where the index ran past them). A state of one histogram
refuses an index, which it ignored."""

import re

import pytest
import torch

import qstats

pytest.importorskip("matplotlib")

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def _stacked(experts: int, seed: int):
    observer = qstats.stacked_observer(qstats.histogram(SPEC, buckets_per_octave=8, octaves=16), experts)
    x = torch.randn(experts, 4, 200, generator=torch.Generator().manual_seed(seed))
    x = x * torch.arange(1, experts + 1.0)[:, None, None]
    state = observer.update(observer.init(x), x)
    return x, state, qstats.stacked_qparams(state, SPEC)


def _per_channel(channels: int):
    observer = qstats.histogram(SPEC, buckets_per_octave=8, octaves=16)
    x = torch.randn(channels, 200, generator=torch.Generator().manual_seed(5))
    state = observer.update(observer.init(x), x)
    return state, qstats.compute_qparams(state, SPEC)


def test_the_states_own_qparams_draw_the_selected_range():
    x, state, qp = _stacked(3, seed=0)
    figure = qstats.plot.histogram(state, qp, SPEC, index=(2, 1))
    lines = [line.get_xdata()[0] for line in figure.axes[0].get_lines()]
    scale = float(x[2, 1].abs().max()) / 127.5  # torch.ao's symmetric int8 scale of that row, computed here
    assert lines == [pytest.approx(-128 * scale, rel=1e-6), pytest.approx(127 * scale, rel=1e-6)]


@pytest.mark.parametrize("other", ["5 experts", "2 experts", "per channel", "6 channels", "per tensor"])
def test_qparams_of_another_state_are_refused_naming_both_shapes(other):
    _, state, _ = _stacked(3, seed=0)
    qparams = {
        "5 experts": lambda: _stacked(5, seed=1)[2],
        "2 experts": lambda: _stacked(2, seed=1)[2],
        "per channel": lambda: _per_channel(4)[1],
        "6 channels": lambda: _per_channel(6)[1],
        "per tensor": lambda: qstats.compute_qparams(*_tensor_state()),
    }[other]()
    with pytest.raises(ValueError, match=rf"scale shape {re.escape(str(tuple(qparams.scale.shape)))}.*histograms of shape \(3, 4\)"):
        qstats.plot.histogram(state, {"other": qparams}, SPEC, index=(1, 1))


def _tensor_state():
    spec = qstats.QuantSpec(dtype="int8")
    observer = qstats.histogram(spec, buckets_per_octave=8, octaves=16)
    x = torch.randn(800, generator=torch.Generator().manual_seed(2))
    return observer.update(observer.init(x), x), spec


def test_a_global_scale_of_one_element_in_any_shape_is_shared():
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * 3
    observer = qstats.histogram(spec, buckets_per_octave=16, octaves=16)
    state = observer.update(observer.init(x), x)
    qp = qstats.compute_qparams(state, spec)
    lines = [line.get_xdata()[0] for line in qstats.plot.histogram(state, qp, spec, index=(1, 1)).axes[0].get_lines()]
    reshaped = qp._replace(global_scale=qp.global_scale.reshape(1))  # compressed-tensors' shape (1,)
    again = [line.get_xdata()[0] for line in qstats.plot.histogram(state, reshaped, spec, index=(1, 1)).axes[0].get_lines()]
    assert lines == again


@pytest.mark.parametrize("index", [0, 3, (0,), (1, 2)], ids=str)
def test_a_state_of_one_histogram_refuses_an_index(index):
    """A per-tensor state holds one histogram: an index selected nothing and was ignored in silence."""
    state, spec = _tensor_state()
    qp = qstats.compute_qparams(state, spec)
    for no_index in (None, ()):
        lines = [line.get_xdata()[0] for line in qstats.plot.histogram(state, qp, spec, index=no_index).axes[0].get_lines()]
        scale = float(qp.scale)  # the symmetric int8 grid: codes -128 and 127 around zero point 0
        assert lines == [pytest.approx(-128 * scale), pytest.approx(127 * scale)]
    with pytest.raises(ValueError, match=r"must select one histogram of shape \(\)"):
        qstats.plot.histogram(state, qp, spec, index=index)
