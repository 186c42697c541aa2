"""qstats.gptq's actorder refusals against compressed-tensors 0.19's QuantizationArgs: 'group', its
alias 'dynamic' (any case, or the ActivationOrdering member) and True (once 'group') are refused as
removed, naming the value given; 'static' and 'weight' and their members are taken."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import hessian

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs  # noqa: E402


def _layer():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(100, 32, generator=gen), torch.randn(16, 32, generator=gen)
    return weight, hessian().update(hessian().init(x), x), qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(8))


@pytest.mark.parametrize("actorder", ["group", "dynamic", "DYNAMIC", "Group", True, ActivationOrdering.DYNAMIC,
                                      ActivationOrdering.GROUP], ids=repr)
def test_removed_orderings_are_refused_as_compressed_tensors_refuses_them(actorder):
    with pytest.raises(ValueError, match="removed"):
        QuantizationArgs(num_bits=4, strategy="group", group_size=8, actorder=actorder)
    weight, state, spec = _layer()
    with pytest.raises(ValueError, match=rf"actorder={actorder!r} .* was removed"):
        qstats.gptq(weight, state, spec, actorder=actorder)


@pytest.mark.parametrize("actorder", ["weight", ActivationOrdering.WEIGHT, ActivationOrdering.STATIC], ids=repr)
def test_static_orderings_are_taken(actorder):
    assert QuantizationArgs(num_bits=4, strategy="group", group_size=8, actorder=actorder).actorder is not None
    weight, state, spec = _layer()
    assert torch.equal(qstats.gptq(weight, state, spec, actorder=actorder)[1],
                       qstats.gptq(weight, state, spec, actorder="static")[1])
