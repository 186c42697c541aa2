"""Errors raised inside calibrate, compute_qparams_tree, fake_quantized and report by a user's code
(an observer, its range rule, a convention) whose type cannot be rebuilt from one message: they keep
their type, attributes and traceback, and still name the module and site where they were raised."""

import traceback
from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import observation
from qstats.conventions import TorchAOConvention
from qstats.observers import kit


class CodebookError(ValueError):
    """A user's error built from two arguments (type(error)(message) raises TypeError)."""

    def __init__(self, limit, got):
        super().__init__(f"{got} values, more than the codebook's {limit}")
        self.limit, self.got = limit, got


def _decode_error():
    return UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


@kit.register_state
class UserFailingState(NamedTuple):
    count: torch.Tensor


def _failing_observer(fail_in):
    """An observer raising ``CodebookError`` in its update (``fail_in="update"``) or its range rule."""

    def factory(spec):
        def init_fn(x):
            return UserFailingState(torch.zeros((), dtype=torch.int64))

        def update_fn(state, x, weight=None):
            if fail_in == "update":
                raise CodebookError(16, x.numel())
            return UserFailingState(state.count + x.numel())

        def merge_fn(a, b):
            return UserFailingState(a.count + b.count)

        return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name="failing")

    return factory


@kit.register_range_rule(UserFailingState)
def _failing_rule(state, spec):
    raise CodebookError(16, int(state.count))


class FailingCodes(TorchAOConvention):
    """A user's convention whose fake quantization raises a UnicodeDecodeError (a ValueError)."""

    def codes(self, view, scale, zero_point, spec):
        raise _decode_error()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()


def _assert_names_site(error, cls, where, raised_in):
    assert type(error) is cls
    text = "".join(traceback.format_exception(error))
    assert where in text, text
    assert raised_in in [frame.name for frame in traceback.extract_tb(error.__traceback__)]


@pytest.mark.parametrize("fail_in", ["update", "rule"])
def test_a_user_observers_error_keeps_its_type_and_names_the_site(fail_in):
    model = _model()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=_failing_observer(fail_in))])
    batches = [torch.randn(2, 8)]
    if fail_in == "update":
        with pytest.raises(CodebookError, match="calibrate: module '0' site 'input'") as caught:
            qstats.calibrate(model, batches, recipe, progress=False)
        _assert_names_site(caught.value, CodebookError, "calibrate: module '0' site 'input'", "update_fn")
    else:
        states = qstats.calibrate(model, batches, recipe, progress=False)
        with pytest.raises(CodebookError, match=r"compute_qparams_tree\['0'\]\['input'\]") as caught:
            qstats.compute_qparams_tree(states, recipe, model)
        _assert_names_site(caught.value, CodebookError, "compute_qparams_tree['0']['input']", "_failing_rule")
    assert (caught.value.limit, caught.value.got) == (16, 16)


@pytest.mark.parametrize("site", ["weight", "input"])
def test_a_user_conventions_error_in_fake_quantized_and_report_names_the_site(site):
    model = _model()
    spec = qstats.QuantSpec(convention=FailingCodes())
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=(site,), observer=qstats.minmax, spec=spec)])
    batches = [torch.randn(2, 8)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    kind = "parameter" if site == "weight" else "site"
    with pytest.raises(UnicodeDecodeError, match=f"{kind} '{site}'") as caught:
        with qstats.fake_quantized(model, qparams, recipe):
            model(batches[0])
    _assert_names_site(caught.value, UnicodeDecodeError, "fake_quantized", "codes")
    assert caught.value.reason == "invalid start byte"
    with pytest.raises(UnicodeDecodeError, match=f"report: module '0' {kind} '{site}'") as caught:
        qstats.report(states, qparams, model, recipe, batches=batches)
    _assert_names_site(caught.value, UnicodeDecodeError, "report: module '0'", "codes")


def test_without_notes_the_site_is_the_runtime_error_the_original_is_raised_from(monkeypatch):
    # Python 3.10 has no add_note: the original is raised with a RuntimeError naming the site as cause
    monkeypatch.setattr(observation, "_HAS_NOTES", False)
    original = _decode_error()
    with pytest.raises(UnicodeDecodeError) as caught:
        try:
            raise original
        except ValueError as error:
            observation.raise_renamed(error, "calibrate: module 'fc' site 'input'")
    assert caught.value is original and not getattr(original, "__notes__", None)
    assert isinstance(original.__cause__, RuntimeError)
    assert "calibrate: module 'fc' site 'input'" in str(original.__cause__)


def test_an_error_rebuilt_from_its_message_keeps_its_attributes_and_the_site_in_front():
    class Tagged(ValueError):
        pass

    original = Tagged("bad shape")
    original.tag = "observer"
    with pytest.raises(Tagged) as caught:
        try:
            raise original
        except ValueError as error:
            observation.raise_renamed(error, "calibrate: module 'fc' site 'input'")
    assert str(caught.value) == "calibrate: module 'fc' site 'input': bad shape"
    assert caught.value.tag == "observer" and caught.value.__cause__ is original


def test_a_site_is_named_once_when_the_error_passes_two_sites():
    error = CodebookError(16, 32)
    for _ in range(2):
        with pytest.raises(CodebookError):
            observation.raise_renamed(error, "report: module 'fc' site 'input'")
    assert error.__notes__ == ["report: module 'fc' site 'input'"]


def test_an_error_whose_one_argument_is_not_its_message_is_not_rebuilt():
    class Coded(ValueError):
        def __init__(self, code):
            super().__init__(f"code {code}")
            self.code = code

    original = Coded(7)
    with pytest.raises(Coded) as caught:
        try:
            raise original
        except ValueError as error:
            observation.raise_renamed(error, "calibrate: module 'fc' site 'input'")
    assert caught.value is original and caught.value.code == 7
    assert caught.value.__notes__ == ["calibrate: module 'fc' site 'input'"]
