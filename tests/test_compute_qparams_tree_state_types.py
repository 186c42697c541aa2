"""`compute_qparams_tree` against states of another observer than the recipe's: states calibrated
under a minmax recipe, computed under an mse recipe, gave minmax's quantization parameters silently
(and the export then wrote ``"observer": "mse"``); QParams passed as states failed with "no range rule"."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.kit import Observer

SPEC = qstats.QuantSpec(dtype="int4")


def _recipe(observer):
    return qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"), spec=SPEC, observer=observer)])


def _calibrated(observer):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    batches = [torch.randn(16, 64) for _ in range(2)]
    batches[0][0, 0] = 40.0  # an outlier the mse search clips, which min/max keeps
    return net, qstats.calibrate(net, batches, _recipe(observer), progress=False)


def test_states_of_another_observer_are_refused_naming_the_site_and_both_types():
    net, minmax_states = _calibrated(qstats.minmax)
    _, mse_states = _calibrated(qstats.mse)
    mse_qparams = qstats.compute_qparams_tree(mse_states, _recipe(qstats.mse), net)
    minmax_qparams = qstats.compute_qparams_tree(minmax_states, _recipe(qstats.minmax), net)
    # what the silent answer was: the minmax scales, not the mse recipe's
    assert float(minmax_qparams["0"]["input"].scale) > float(mse_qparams["0"]["input"].scale)
    with pytest.raises(TypeError, match=r"compute_qparams_tree\['0'\]\['(weight|input)'\]: the recipe observes this "
                                        r"site with mse \(states of type MSEState\), got a MinMaxState"):
        qstats.compute_qparams_tree(minmax_states, _recipe(qstats.mse), net)
    with pytest.raises(TypeError, match=r"with memoryless_minmax \(states of type MemorylessMinMaxState\), got a "
                                        "MinMaxState"):
        qstats.compute_qparams_tree(minmax_states, _recipe(qstats.memoryless_minmax), net)


def test_qparams_passed_as_states_are_named():
    net, states = _calibrated(qstats.minmax)
    qparams = qstats.compute_qparams_tree(states, _recipe(qstats.minmax), net)
    with pytest.raises(TypeError, match=r"\['0'\]\['(weight|input)'\]: got QParams where a state is expected"):
        qstats.compute_qparams_tree(qparams, _recipe(qstats.minmax), net)
    with pytest.raises(TypeError, match="compute_qparams: got QParams"):
        qstats.compute_qparams(qparams["0"]["weight"], SPEC)


def test_every_factory_declares_its_states_class_and_stacking_keeps_it():
    x = torch.randn(8, 16)
    for factory in (qstats.minmax, qstats.memoryless_minmax, qstats.moving_average_minmax, qstats.mse,
                    qstats.histogram, qstats.moments, qstats.hessian, qstats.imatrix):
        observer = factory(SPEC) if factory not in (qstats.hessian, qstats.imatrix) else factory()
        assert type(observer.init(x)) is observer.state_type, factory.__name__
        stacked = qstats.stacked_observer(observer, 3)
        assert type(stacked.init(x.expand(3, 8, 16))) is stacked.state_type, factory.__name__


def test_an_observer_without_a_declared_state_type_is_not_checked():
    """A user's Observer built without ``state_type`` (None) keeps working as before."""

    def plain(spec):
        base = qstats.minmax(spec)
        return Observer(base.init, base.update, base.merge, base.exact, spec, "plain_minmax")

    assert plain(SPEC).state_type is None
    net, states = _calibrated(qstats.minmax)
    got = qstats.compute_qparams_tree(states, _recipe(plain), net)
    want = qstats.compute_qparams_tree(states, _recipe(qstats.minmax), net)
    assert torch.equal(got["0"]["weight"].scale, want["0"]["weight"].scale)
