"""compute_qparams(state, spec, global_scale=g), a two-level global scale imposed from outside
(torchao's ``to_nvfp4(per_tensor_scale=g)``, a fused group's): a NaN, Inf, zero or negative one is
a ValueError, eagerly and per expert under stacked_qparams (torchao gives NaN values or zeros
there); a Python number is a TypeError; a spec without two-level scales, which would ignore it, is
a ValueError. A valid one gives torchao's NVFP4 values."""

from __future__ import annotations

import pytest
import torch

import qstats

SPEC = qstats.preset("nvfp4")
EXPERTS = 3


def _state(weight):
    obs = qstats.minmax(SPEC)
    return obs.update(obs.init(weight), weight)


def _weight():
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
def test_a_nan_inf_zero_or_negative_global_scale_is_refused(bad):
    with pytest.raises(ValueError, match="global_scale must be finite and positive"):
        qstats.compute_qparams(_state(_weight()), SPEC, global_scale=torch.tensor(bad))


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_one_expert_s_bad_global_scale_is_refused_under_stacked_qparams(bad):
    weight = torch.randn(EXPERTS, 4, 32, generator=torch.Generator().manual_seed(1))
    obs = qstats.stacked_observer(qstats.minmax(SPEC), EXPERTS)
    state = obs.update(obs.init(weight), weight)
    global_scale = torch.tensor([0.01, bad, 0.02])
    with pytest.raises(ValueError, match="global_scale must be finite and positive"):
        qstats.stacked_qparams(state, SPEC, global_scale=global_scale)


def test_a_python_number_global_scale_is_a_type_error():
    with pytest.raises(TypeError, match="global_scale must be a real tensor of one value, got float"):
        qstats.compute_qparams(_state(_weight()), SPEC, global_scale=0.01)


def test_a_global_scale_for_a_spec_without_two_level_scales_is_refused():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(_weight()), _weight())
    with pytest.raises(ValueError, match="two-level specs.*would ignore it"):
        qstats.compute_qparams(state, spec, global_scale=torch.tensor(0.01))


def test_a_valid_global_scale_gives_torchao_s_nvfp4_values():
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    weight = _weight()
    global_scale = weight.abs().amax() / (448.0 * 6.0) * 2  # twice the observed one: every block scale changes
    qparams = qstats.compute_qparams(_state(weight), SPEC, global_scale=global_scale)
    expected = nvfp4.NVFP4Tensor.to_nvfp4(weight, per_tensor_scale=global_scale).dequantize(torch.float32)
    assert torch.equal(qstats.fake_quantize(weight, qparams, SPEC), expected)


@pytest.mark.parametrize("formula", ["amax_over_range", "range_over_amax"])
@pytest.mark.parametrize("subnormal", [1e-45, 1e-39])
def test_a_subnormal_global_scale_is_refused_where_torchao_loses_the_zeros(subnormal, formula):
    """1 / global overflows float32: zeros came back NaN (torchao's ``to_nvfp4`` gives them
    nonzero values, compressed-tensors' block scale over it is Inf, every value NaN)."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    weight = _weight()
    weight[0, :4] = 0.0
    global_scale = torch.tensor(subnormal)
    theirs = nvfp4.NVFP4Tensor.to_nvfp4(weight, per_tensor_scale=global_scale).dequantize(torch.float32)
    assert (theirs[0, :4] != 0).all() or torch.isnan(theirs[0, :4]).all()
    spec = SPEC.replace(global_scale_formula=formula)
    with pytest.raises(ValueError, match="global_scale must be finite and positive, at least the smallest normal"):
        qstats.compute_qparams(_state(weight), spec, global_scale=global_scale)


def test_the_smallest_normal_global_scale_keeps_the_zeros():
    weight = _weight()
    weight[0, :4] = 0.0
    qparams = qstats.compute_qparams(_state(weight), SPEC, global_scale=torch.tensor(torch.finfo(torch.float32).tiny))
    assert torch.equal(qstats.fake_quantize(weight, qparams, SPEC)[0, :4], torch.zeros(4))
