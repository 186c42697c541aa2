"""`qstats.report`'s ``clipped_fraction`` of int8 weights of float32, bfloat16 and float16 models
against their codes computed by hand as compressed-tensors computes them (``round(x / scale)`` in
float32, the bf16/fp16 weight promoted by the float32 scale), outside ``[-128, 127]``."""

import pytest
import torch

import qstats

quantization = pytest.importorskip("compressed_tensors.quantization")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["tensor", "channel", "group"])
def test_clipped_fraction_is_the_share_of_codes_outside_the_range(strategy, dtype):
    args = quantization.QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy=strategy,
                                         group_size=16 if strategy == "group" else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 32)).to(dtype).eval()
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(2, 48, dtype=dtype)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams, model, recipe).rows
    weight, scale = model[0].weight.detach(), qparams["0"]["weight"].scale
    if strategy == "channel":
        scale = scale[:, None]
    elif strategy == "group":
        scale = scale.repeat_interleave(16, dim=1)
    codes = torch.round(weight.float() / scale)  # compressed-tensors' float32 scale (shape [1] per tensor) promotes
    expected = int(((codes < -128) | (codes > 127)).sum())
    assert row.clipped_fraction * weight.numel() == pytest.approx(expected)
