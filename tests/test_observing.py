"""qstats.observing: a session whose hooks update the states over forwards the user runs, against
torch.ao observers fed by independent hooks, and against qstats.calibrate over the same batches."""

import warnings

import pytest
import torch
from torch.ao.quantization.observer import MovingAverageMinMaxObserver

import qstats
from tests._shared import bit_equal

INPUT_SPEC = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
WEIGHT_SPEC = qstats.QuantSpec.from_torch_ao(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()


def _recipe():
    return qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax, spec=WEIGHT_SPEC),
        qstats.Rule("Linear", sites=("input", "output"), observer=qstats.moving_average_minmax, spec=INPUT_SPEC,
                    observer_kwargs={"averaging_constant": 0.1}),
    ])


def _batches(count=4):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(2, 7, 6, generator=generator) * (i + 1) for i in range(count)]


def _masks(batches):
    return [(torch.arange(7) < 3 + i).expand(2, 7).float() for i, _ in enumerate(batches)]


def _leaves_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].keys() == b[path].keys()
        for site in a[path]:
            for x, y in zip(a[path][site], b[path][site]):
                assert bit_equal(x, y), (path, site)


def test_session_matches_torch_ao_fed_by_plain_hooks():
    model, batches = _model(), _batches()
    with qstats.observing(model, _recipe()) as session, torch.no_grad():
        for x in batches:
            model(x)
    reference = MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.quint8)
    with torch.no_grad():
        for x in batches:
            reference(x)  # the first Linear's input is the batch itself
    qp = qstats.compute_qparams(session.states["0"]["input"], INPUT_SPEC)
    scale, zero_point = reference.calculate_qparams()
    assert bit_equal(qp.scale.reshape(()), scale.reshape(()))
    assert torch.equal(qp.zero_point.reshape(()).to(torch.int64), zero_point.reshape(()).to(torch.int64))
    assert session.calls == len(batches)


def test_batch_by_batch_equals_one_calibrate_call_with_masks():
    model, batches = _model(), _batches()
    masks = _masks(batches)
    with qstats.observing(model, _recipe()) as session, torch.no_grad():
        for x, mask in zip(batches, masks):
            with session.weighted(mask):
                model(x)
    weights = {id(x): m for x, m in zip(batches, masks)}
    expected = qstats.calibrate(model, batches, _recipe(), progress=False, observation_weight=lambda x: weights[id(x)])
    _leaves_equal(session.states, expected)
    # the padding was left out: not the same as observing everything
    unmasked = qstats.calibrate(model, batches, _recipe(), progress=False)
    assert not bit_equal(unmasked["0"]["input"].min_val, session.states["0"]["input"].min_val) or not bit_equal(
        unmasked["0"]["input"].max_val, session.states["0"]["input"].max_val)


def test_resumed_session_equals_one_session():
    model, batches = _model(), _batches()
    with qstats.observing(model, _recipe()) as first, torch.no_grad():
        for x in batches[:2]:
            model(x)
    with qstats.observing(model, _recipe(), states=first.states) as second, torch.no_grad():
        for x in batches[2:]:
            model(x)
    one = qstats.calibrate(model, batches, _recipe(), progress=False)
    _leaves_equal(second.states, one)


def test_hooks_are_removed_on_exit_and_on_error():
    model, batches = _model(), _batches()
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    with qstats.observing(model, _recipe()) as session, torch.no_grad():
        model(batches[0])
    kept = {path: dict(entry) for path, entry in session.states.items()}
    with torch.no_grad():
        model(batches[1])  # outside the session: nothing observed
    _leaves_equal(session.states, kept)
    assert hooks() == 0
    with pytest.raises(RuntimeError, match="user stop"):
        with qstats.observing(model, _recipe()), warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning about unobserved sites when the body raises
            raise RuntimeError("user stop")
    assert hooks() == 0


def test_no_forward_warns_naming_the_sites_and_parameters_are_observed_on_entry():
    model = _model()
    with pytest.warns(qstats.UncalibratedWarning, match=r"the model was not run.*0\.input"):
        with qstats.observing(model, _recipe()) as session:
            assert session.states["0"]["weight"].max_val.shape == (5,)
    assert torch.equal(session.states["0"]["weight"].max_val, model[0].weight.detach().amax(dim=1))


def test_forwards_with_gradients_keep_states_free_of_the_graph():
    model, batches = _model(), _batches()
    with qstats.observing(model, _recipe()) as session:
        loss = model(batches[0]).sum()
    loss.backward()
    assert all(not leaf.requires_grad for entry in session.states.values() for state in entry.values() for leaf in state)


def test_bad_weight_and_model_are_named():
    with pytest.raises(TypeError, match="observing expects an nn.Module"):
        with qstats.observing(lambda x: x, _recipe()):
            pass
    with pytest.warns(qstats.UncalibratedWarning), qstats.observing(_model(), _recipe()) as session:
        with pytest.raises(TypeError, match="observation weight must be a tensor"):
            with session.weighted([1, 0]):
                pass


def test_masked_rows_of_partial_blocks_stay_in_their_blocks():
    """Dropping masked rows kept the qparam shape of a partial PerBlock (ceil(7/4) == ceil(6/4)), so
    the rows after a dropped one slid into the previous block."""
    torch.manual_seed(0)
    x = torch.randn(7, 8)
    x[4, 0], x[3, 1] = 10.0, -10.0  # the extremes of the second block and the first
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerBlock((4, 8), partial=True))
    recipe = qstats.Recipe([qstats.Rule("Identity", sites=("input",), spec=spec)])
    mask = torch.tensor([1.0, 0, 1, 1, 1, 1, 1])
    states = qstats.calibrate(torch.nn.Sequential(torch.nn.Identity()), [x], recipe,
                              observation_weight=lambda batch: mask, progress=False)
    keep = mask.bool()
    blocks = [(x[:4], keep[:4]), (x[4:], keep[4:])]
    assert torch.equal(states["0"]["input"].max_val.flatten(), torch.stack([b[k].max() for b, k in blocks]))
    assert torch.equal(states["0"]["input"].min_val.flatten(), torch.stack([b[k].min() for b, k in blocks]))
