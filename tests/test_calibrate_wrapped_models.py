"""`qstats.calibrate` of a model wrapped in ``DistributedDataParallel`` (a one-rank gloo group in a
forked process) or ``DataParallel`` (on CPU) names its sites by the bare model's paths, as it names a
``torch.compile``'d model's: a recipe's ``ignore`` written for the bare model matches the same modules,
and the states, the qparams (`compute_qparams_tree`), the fake-quantized outputs (`fake_quantized`) and
the report (`qstats.report`) equal those computed on the bare model (the reference), key for key."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch

import qstats
from _shared import exit_rank, fork_ranks, gloo_group

# "re:^head$" names the bare model's head; on the wrapper's paths it would match no module
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("weight", "input"))], ignore=["re:^head$"])


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.body(x))


def _model():
    torch.manual_seed(0)
    return _Net().eval()


BATCHES = [torch.randn(5, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
PROBE = torch.randn(7, 8, generator=torch.Generator().manual_seed(9))


def _results(model) -> dict:
    """calibrate, compute_qparams_tree, the output under fake_quantized and the report of ``model``."""
    states = qstats.calibrate(model, BATCHES, RECIPE, progress=False)
    qparams = qstats.compute_qparams_tree(states, RECIPE, model)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, RECIPE):
        output = model(PROBE)
    report = qstats.report(states, qparams, model, RECIPE, batches=BATCHES[:1]).to_json()
    return {"states": states, "qparams": qparams, "output": output, "report": report}


def _assert_same_trees(ours, expected, what: str) -> None:
    assert {path: sorted(entry) for path, entry in ours.items()} == \
        {path: sorted(entry) for path, entry in expected.items()}, what
    for path, entry in expected.items():
        for site, value in entry.items():
            mine = ours[path][site]
            assert type(mine) is type(value), (what, path, site)
            for field, tensor in zip(value._fields, value):
                other = getattr(mine, field)
                if isinstance(tensor, torch.Tensor):
                    assert torch.equal(other, tensor), (what, path, site, field)
                else:
                    assert other == tensor, (what, path, site, field)


def _assert_as_bare(ours: dict) -> None:
    expected = _results(_model())
    assert "head" not in expected["states"] and "body.0" in expected["states"]  # the ignore entry applied
    _assert_same_trees(ours["states"], expected["states"], "states")
    _assert_same_trees(ours["qparams"], expected["qparams"], "qparams")
    assert torch.equal(ours["output"], expected["output"])
    assert ours["report"] == expected["report"]


def _calibrate_ddp(rank: int, port: int, out: str) -> None:
    try:
        with gloo_group(rank, port, world=1, timeout=timedelta(seconds=60)):
            wrapper = torch.nn.parallel.DistributedDataParallel(_model())
            torch.save(_results(wrapper), os.path.join(out, "ddp.pt"))
            plan = RECIPE.resolve(wrapper)
            torch.save(sorted(plan.sites), os.path.join(out, "plan.pt"))
    except BaseException:
        traceback.print_exc()
        exit_rank(1)
    exit_rank(0)


def test_a_ddp_wrapped_model_is_calibrated_as_the_bare_model(tmp_path):
    assert fork_ranks(_calibrate_ddp, str(tmp_path), world=1, timeout=300) == [0]
    _assert_as_bare(torch.load(tmp_path / "ddp.pt", weights_only=False))
    assert torch.load(tmp_path / "plan.pt") == sorted(RECIPE.resolve(_model()).sites) == ["body.0", "body.2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel of a CPU model needs no GPU to be visible")
def test_a_data_parallel_model_is_calibrated_as_the_bare_model():
    wrapper = torch.nn.DataParallel(_model())
    _assert_as_bare(_results(wrapper))
    assert sorted(RECIPE.resolve(wrapper).sites) == ["body.0", "body.2"]
    assert RECIPE.rule_for("head", "weight", model=wrapper) is None  # ignored by its bare path
    assert RECIPE.rule_for("body.0", "weight", model=wrapper) is RECIPE.rules[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="DataParallel of a CPU model needs no GPU to be visible")
def test_a_wrapped_model_that_ran_no_batch_gets_the_compile_hint_only_when_compiled():
    # the hint names a graph compiled before the hooks: a DataParallel of an eager model has none
    # (the bare model's warning is the reference), a compiled one inside DataParallel has
    def warning_of(model):
        with pytest.warns(qstats.UncalibratedWarning) as caught:
            with qstats.observing(model, RECIPE):
                pass
        return [str(w.message) for w in caught if issubclass(w.category, qstats.UncalibratedWarning)]

    bare = warning_of(_model())
    assert warning_of(torch.nn.DataParallel(_model())) == bare
    assert "torch.compiler.reset()" not in bare[0]
    torch.compiler.reset()
    try:
        hinted = warning_of(torch.nn.DataParallel(torch.compile(_model(), backend="eager")))
    finally:
        torch.compiler.reset()
    assert "call torch.compiler.reset() first" in hinted[0]
