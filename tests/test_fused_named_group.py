"""A fused group given as a NamedTuple of states (``QKV(q=..., k=..., v=...)``, a sequence as the
docs ask for) is read as its members, as the list of them is: the shared global scale is
compressed-tensors' ``generate_gparam`` over all of their values, not one stacked state (whose
class would need a range rule)."""

from typing import NamedTuple

import pytest
import torch

import qstats

helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")


class QKV(NamedTuple):
    q: object
    k: object
    v: object


def _group():
    spec = qstats.QuantSpec(dtype="fp4_e2m1", granularity=qstats.TensorGroup(16), scale_dtype="float8_e4m3fn",
                            global_scale_formula="range_over_amax")
    obs = qstats.minmax(spec)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) * spread for shape, spread in (((8, 32), 1.0), ((4, 32), 3.0), ((4, 32), 0.5))]
    return spec, weights, QKV(*(obs.update(obs.init(w), w) for w in weights))


def test_a_named_tuple_of_states_is_a_group():
    spec, weights, group = _group()
    everything = torch.cat([w.reshape(-1) for w in weights])
    expected = helpers.generate_gparam(everything.min(), everything.max()).reshape(())
    assert torch.equal(qstats.fused_global_scale(group, spec), expected)
    fused = qstats.fused_qparams(group, spec)
    assert len(fused) == 3
    for qp, alone in zip(fused, qstats.fused_qparams(list(group), spec)):
        assert all(torch.equal(a, b) for a, b in zip(qp, alone))
        assert torch.equal(qp.global_scale, expected)


def test_a_named_tuple_of_states_is_not_one_stacked_state():
    spec, _, group = _group()
    with pytest.raises(TypeError, match=r"stacked=True\): states must be one state stacked .* got a QKV"):
        qstats.fused_qparams(group, spec, stacked=True)


@pytest.mark.parametrize("function", [qstats.fused_global_scale, qstats.fused_qparams])
def test_a_named_tuple_with_a_none_member_names_it_as_the_list_form_does(function):
    """``QKV(q, k, v=None)`` (Gemma 4's ``attention_k_eq_v`` has no ``v_proj``): the member is named,
    as in ``[q, k, None]``, rather than the NamedTuple taken for one state with no range rule."""
    spec, _, group = _group()
    with pytest.raises(TypeError, match="member 2 of the group is a NoneType"):
        function(list(group[:2]) + [None], spec)
    with pytest.raises(TypeError, match="member 2 of the group is a NoneType"):
        function(group._replace(v=None), spec)
