"""Warnings raised deep inside qstats (recipe resolution, a torch.library op under GPTQ, the
session's context managers) point at the user's line that called qstats, not at a library frame."""

import warnings

import torch

import qstats


def _caught(call) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


def test_a_misspelt_ignore_entry_warns_at_the_calibrate_call():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec())], ignore=["haed"])
    caught = _caught(lambda: qstats.calibrate(model, [torch.randn(2, 4)], recipe, progress=False))
    messages = [w for w in caught if "'haed'" in str(w.message)]
    assert messages and all(w.filename == __file__ for w in messages), [(w.filename, w.lineno) for w in messages]


def test_gptq_of_an_expert_without_rows_warns_at_the_gptq_call():
    spec = qstats.QuantSpec(dtype="int4", mapping="symmetric", granularity=qstats.PerGroup(8))
    weight = torch.randn(2, 4, 8)
    observer = qstats.stacked_observer(qstats.hessian(), 2)
    x = torch.randn(2, 16, 8)
    state = observer.update(observer.init(x), x, torch.tensor([[1.0] * 16, [0.0] * 16]))
    caught = _caught(lambda: qstats.gptq(weight, state, spec))
    messages = [w for w in caught if "saw no input row" in str(w.message)]
    assert messages and all(w.filename == __file__ for w in messages), [(w.filename, w.lineno) for w in messages]


def test_observing_warns_at_the_users_with_lines():
    """Through ``contextlib`` (the session's context managers): an observation weight that fits no
    activation, and a site that saw no data."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec())])

    def weighted():
        with qstats.observing(model, recipe) as session, torch.no_grad():
            with session.weighted(torch.ones(7)):  # fits no activation ([2, 4])
                model(torch.randn(2, 4))

    def unobserved():
        with qstats.observing(model, recipe):
            pass

    for call, text in ((weighted, "fits no observed activation"), (unobserved, "saw no data")):
        messages = [w for w in _caught(call) if text in str(w.message)]
        assert messages and all(w.filename == __file__ for w in messages), [(w.filename, w.lineno) for w in messages]
