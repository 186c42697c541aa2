"""``fused_qparams(stacked=True)`` compiled raises for an uncalibrated slice as eager does (under
``on_uncalibrated="raise"``): the check's result was discarded, torch.compile dropped it as dead code, and a
spec without a shared global scale (int8 per channel) got scale 1 for the expert that saw no data."""

import pytest
import torch

import qstats


def test_compiled_stacked_group_raises_for_an_expert_that_saw_no_data_as_eager():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    observer = qstats.minmax(spec)
    weights = torch.randn(3, 4, 8)
    empty = torch.func.vmap(observer.init)(weights)
    observed = torch.func.vmap(observer.update)(empty, weights)
    mixed = type(empty)(*(torch.cat([a[:2], b[2:]]) for a, b in zip(observed, empty)))  # expert 2 saw nothing
    compiled = torch.compile(lambda states: qstats.fused_qparams(states, spec, stacked=True), fullgraph=True)
    for fused_qparams in (lambda states: qstats.fused_qparams(states, spec, stacked=True), compiled):
        with pytest.raises(ValueError, match=r"fused_qparams\(stacked=True\): 4 of 12 .*saw no finite data"):
            fused_qparams(mixed)
    result = compiled(observed)  # every expert observed: compute_qparams of each slice
    for i in range(3):
        expected = qstats.compute_qparams(type(observed)(*(t[i] for t in observed)), spec)
        torch.testing.assert_close(result.scale[i], expected.scale, rtol=0, atol=0)
        torch.testing.assert_close(result.zero_point[i], expected.zero_point, rtol=0, atol=0)
