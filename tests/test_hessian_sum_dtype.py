"""qstats.hessian accumulates x^T x in its state's dtype, float32 or float64 (llm-compressor's
accumulate_hessian sums in float32): a state whose total has another dtype (bfloat16 after a
conversion to save memory, an integer tensor) is a ValueError naming the field in update and merge,
where the sum was rounded to bfloat16 or the inputs truncated to integers without a word."""

import pytest
import torch

import qstats
from qstats.observers.hessian import hessian


def _x(seed=0):
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.int32])
def test_update_and_merge_refuse_a_total_of_another_dtype(dtype):
    obs, x = hessian(), _x()
    state = obs.init(x)
    converted = state._replace(total=state.total.to(dtype))
    with pytest.raises(ValueError, match=rf"hessian.update: HessianState.total must be a float32 or float64 .*{dtype}"):
        obs.update(converted, x)
    with pytest.raises(ValueError, match=rf"hessian.merge: HessianState.total must be a float32 or float64 .*{dtype}"):
        obs.merge(converted, converted)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_float32_and_float64_sums_equal_the_float64_sum(dtype, tolerance):
    # an independent computation: the float64 sum of x^T x over the rows
    obs, x, y = hessian(dtype=dtype), _x(0), _x(1)
    state = obs.merge(obs.update(obs.init(x), x), obs.update(obs.init(y), y))
    rows = torch.cat([x, y]).double()
    expected = rows.T @ rows
    assert state.total.dtype == dtype
    torch.testing.assert_close(state.total.double(), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


def test_a_float32_sum_equals_llm_compressor_accumulate_hessian():
    helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
    layer, x = torch.nn.Linear(16, 4), _x().reshape(4, 16, 16)
    total = helpers.make_empty_hessian(layer)
    total, samples = helpers.accumulate_hessian(x, layer, total, torch.zeros((), dtype=torch.int64))
    obs = hessian()
    state = obs.update(obs.init(x), x)
    # llm-compressor's H is 2 / samples * sum x^T x (its samples: the leading dimension)
    torch.testing.assert_close(2.0 * state.total / samples, total / samples, rtol=1e-5, atol=1e-5)


def test_gptq_still_takes_a_converted_state():
    # gptq computes in float32 whatever the state holds: a bfloat16 total is read, not accumulated
    obs, x = hessian(), _x()
    state = obs.update(obs.init(x), x)
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerGroup(8))
    assert qstats.gptq(weight, state._replace(total=state.total.bfloat16()), spec)[0].shape == (8, 16)
