"""`qstats.imatrix_mse`'s errors name it: a state or tensor its update (or merge) cannot take raises the
error `qstats.mse` (the search it is built on) raises for the same input, with ``imatrix_mse.update``
(``.merge``) where mse's says ``mse.update`` (``.merge``), with importance data and without."""

from __future__ import annotations

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
WEIGHT = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
# imatrix_mse's defaults as mse's arguments: steps = int(0.95 * 20) + 1 candidates
MSE = qstats.mse(SPEC, maxshrink=0.95, grid=20, norm=3.0, steps=20)


def _importance():
    observer = qstats.imatrix()
    return observer.update(observer.init(torch.ones(3, 8)), torch.randn(3, 8, generator=torch.Generator().manual_seed(1)))


def _error(call) -> Exception:
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    return caught.value


CASES = {
    "not a state": lambda obs: obs.update("state", WEIGHT),
    "another searches' state": lambda obs: obs.update(qstats.mse(SPEC).init(WEIGHT), WEIGHT),
    "a state of another shape": lambda obs: obs.update(obs.init(torch.ones(4, 8))._replace(
        min_val=torch.zeros(5), max_val=torch.zeros(5), count=torch.zeros(5, dtype=torch.int64),
        nonfinite=torch.zeros(5, dtype=torch.int64), loss=torch.zeros(5, 20, dtype=torch.float64)), WEIGHT),
    "a merge with no state": lambda obs: obs.merge(obs.init(WEIGHT), "state"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_importance", [False, True])
def test_imatrix_mse_errors_name_it_as_mse_names_itself(case, with_importance):
    observer = qstats.imatrix_mse(SPEC, (4, 8), _importance() if with_importance else None)
    ours, theirs = _error(lambda: CASES[case](observer)), _error(lambda: CASES[case](MSE))
    verb = "merge" if "merge" in case else "update"
    assert str(theirs).startswith(f"mse.{verb}: ")  # the reference names mse
    assert type(ours) is type(theirs)
    assert str(ours) == f"imatrix_{theirs}"


def test_errors_of_its_own_checks_are_unchanged():
    observer = qstats.imatrix_mse(SPEC, (4, 8), _importance())
    message = r"^imatrix_mse\.update: a tensor of shape \(4, 9\) does not match the weight shape \(4, 8\)"
    with pytest.raises(ValueError, match=message):
        observer.update(observer.init(WEIGHT), torch.ones(4, 9))
    assert observer.update(observer.init(WEIGHT), WEIGHT, weight=torch.ones(4)).count.sum() == 32
