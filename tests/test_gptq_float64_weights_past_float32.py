"""qstats.gptq on float64 weights: GPTQ computes in float32 (as llm-compressor's quantize_weight,
which casts the weight with ``.float()``), so a value past float32's range is refused with a
ValueError naming the weight, with or without given qparams and per expert of a stack, rather than
turned into NaN along its row; a float64 weight inside the range is GPTQ of its float32 copy."""

from __future__ import annotations

import pytest
import torch

import qstats

OUT, IN = 8, 16
SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def _hessian_state(experts=None):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, IN, generator=gen)
    obs = qstats.hessian()
    state = obs.update(obs.init(x), x)
    if experts is None:
        return state
    return type(state)(*(field.expand(experts, *field.shape).clone() for field in state))


def _weight(experts=None):
    gen = torch.Generator().manual_seed(1)
    shape = (OUT, IN) if experts is None else (experts, OUT, IN)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _qparams(experts=None):
    batch = () if experts is None else (experts,)
    return qstats.QParams(torch.full((*batch, OUT), 0.05), torch.zeros((*batch, OUT), dtype=torch.int32),
                          torch.ones(batch), torch.ones((*batch, OUT), dtype=torch.bool))


@pytest.mark.parametrize("given", [False, True], ids=["own qparams", "given qparams"])
def test_a_float64_weight_past_float32_is_refused(given):
    weight = _weight()
    weight[0, 3] = 1e300  # finite in float64, Inf in float32
    assert torch.isfinite(weight).all() and not torch.isfinite(weight.float()).all()
    with pytest.raises(ValueError, match="weight of the layer holds NaN or Inf.*past float32"):
        qstats.gptq(weight, _hessian_state(), SPEC, qparams=_qparams() if given else None)


def test_a_stacked_float64_weight_names_the_expert_past_float32():
    weight = _weight(experts=3)
    weight[1, 2, 5] = -1e200
    with pytest.raises(ValueError, match=r"experts \[1\] \(1 of 3\)"):
        qstats.gptq(weight, _hessian_state(experts=3), SPEC, qparams=_qparams(experts=3))


def test_a_float64_weight_inside_float32_range_is_gptq_of_its_float32_copy():
    weight = _weight() * 1e30  # past float32's precision, inside its range
    fake_quantized, codes, qparams = qstats.gptq(weight, _hessian_state(), SPEC)
    reference, reference_codes, reference_qparams = qstats.gptq(weight.float(), _hessian_state(), SPEC)
    assert fake_quantized.dtype == torch.float64 and torch.isfinite(fake_quantized).all()
    assert torch.equal(fake_quantized, reference.double()) and torch.equal(codes, reference_codes)
    assert torch.equal(qparams.scale, reference_qparams.scale)
