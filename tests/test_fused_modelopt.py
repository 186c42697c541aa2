"""`qstats.fused_global_scale` in ModelOpt's convention (``global_scale_formula="amax_over_range"``)
against ModelOpt's export of fused q/k/v and gate/up NVFP4 weights (``preprocess_linear_fusion``:
the largest member amax, then ``NVFP4QTensor.get_weights_scaling_factor_2``, ``amax / (6 * 448)``),
for float32, bfloat16 and float16 weights; an uncalibrated (reversed-range) entry is left out as
ModelOpt's amax of the observed values leaves out what was never observed."""

import warnings

import pytest
import torch

import qstats

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ModelOpt warns about untested transformers versions at import
    pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

SPEC = qstats.preset("nvfp4", global_scale_formula="amax_over_range")


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=g) * spread).to(dtype)
            for shape, spread in (((32, 64), 1.0), ((16, 64), 4.0), ((16, 64), 0.25))]


def _modelopt_fused(weights):
    """ModelOpt's scale of the fused group: its largest member amax, over E2M1_MAX * E4M3_MAX."""
    amax = torch.stack([w.abs().amax().float() for w in weights]).max()
    return NVFP4QTensor.get_weights_scaling_factor_2(amax.reshape(1)).reshape(())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_global_scale_is_modelopts(dtype):
    weights = _weights(dtype)
    obs = qstats.minmax(SPEC)
    states = [obs.update(obs.init(w), w) for w in weights]
    expected = _modelopt_fused(weights)
    assert torch.equal(qstats.fused_global_scale(states, SPEC), expected)
    for qp in qstats.fused_qparams(states, SPEC):
        assert torch.equal(qp.global_scale, expected)


def test_an_entry_with_a_reversed_range_is_left_out():
    spec = SPEC.replace(on_uncalibrated="fallback")
    weights = _weights(torch.float32)
    obs = qstats.minmax(spec)
    states = [obs.update(obs.init(w), w) for w in weights]
    k = states[1]
    # k's first row saw no data: a reversed range far larger than any value
    states[1] = k._replace(min_val=k.min_val.index_fill(0, torch.tensor([0]), -300.0),
                           max_val=k.max_val.index_fill(0, torch.tensor([0]), -400.0))
    expected = _modelopt_fused([weights[0], weights[1][1:], weights[2]])
    assert torch.equal(qstats.fused_global_scale(states, spec), expected)
