"""Per-row and per-block activation specs (torchao's dynamic rowwise float8 and blockwise
activations) take their scales from each batch at run time, as per-token ones do: calibration over
sequences of different lengths works and the fake-quantized forward equals an independent per-row /
per-block quantization written here in plain torch."""
import pytest
import torch

import qstats


def _rowwise_fp8(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.clamp(amax / 448.0, min=torch.finfo(torch.float32).eps)
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _blockwise_int8(x: torch.Tensor, cols: int) -> torch.Tensor:
    """torch's per-channel fake quantization, one channel per block of ``cols`` values of a row."""
    blocks = x.reshape(-1, cols)
    scale = torch.clamp(blocks.abs().amax(-1) / 127.5, min=torch.finfo(torch.float32).eps)
    zero = torch.zeros(len(blocks), dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(blocks, scale, zero, 0, -128, 127).reshape(x.shape)


@pytest.mark.parametrize("case", ["row", "block"])
def test_rowwise_and_blockwise_inputs_are_dynamic(case):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    if case == "row":
        spec, reference = qstats.QuantSpec(dtype=torch.float8_e4m3fn, granularity=qstats.PerRow()), _rowwise_fp8
    else:
        spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerBlock((1, 32)))
        reference = lambda x: _blockwise_int8(x, 32)  # noqa: E731
    recipe = qstats.Recipe([qstats.Rule(targets="Linear", sites=("input",), observer=qstats.minmax, spec=spec)])
    batches = [torch.randn(3, 5, 64), torch.randn(2, 7, 64)]  # a state shaped by the first batch refused the second
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert qparams["0"]["input"] is None  # nothing calibrated: every batch brings its own scales
    for x in batches + [torch.randn(1, 11, 64)]:
        expected = torch.nn.functional.linear(reference(x), model[0].weight, model[0].bias)
        with qstats.fake_quantized(model, qparams, recipe):
            got = model(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
