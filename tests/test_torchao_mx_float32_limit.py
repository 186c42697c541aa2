"""MX (``to_mx``) blocks whose peak nears the float32 limit, every ScaleCalculationMode and element
format against torchao, as docs/differences.md states them: FLOOR equals torchao; CEIL, RCEIL and
EVEN scales are one exponent below torchao's from a threshold on (qstats keeps every code finite);
where torchao's values are finite they equal qstats' except e4m3 blocks peaking past 448 x 2^119."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode  # noqa: E402

ELEMENTS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", "fp6_e2m3": "fp6_e2m3",
            "fp6_e3m2": "fp6_e3m2", torch.float4_e2m1fn_x2: "fp4"}
# the first peak (a multiple of 2**127) whose scale is one exponent below torchao's
THRESHOLDS = {
    Mode.FLOOR: {},
    Mode.CEIL: {name: 1.0 for name in ELEMENTS.values()},
    Mode.RCEIL: {"e4m3": 1.75, "e5m2": 1.75, "fp6_e2m3": 1.875, "fp6_e3m2": 1.75, "fp4": 1.5},
    Mode.EVEN: {"e4m3": 1.9375, "e5m2": 1.875, "fp6_e2m3": 1.9375, "fp6_e3m2": 1.875, "fp4": 1.75},
}


def _blocks():
    """Blocks of 32 whose peaks sweep float32 from 1e38 to its largest value."""
    start = torch.tensor(1e38).view(torch.int32).item()
    stop = torch.tensor(torch.finfo(torch.float32).max).view(torch.int32).item()
    peaks = torch.linspace(start, stop, 1201, dtype=torch.float64).round().to(torch.int32).view(torch.float32)
    x = torch.zeros(len(peaks), 32)
    x[:, 0], x[:, 1], x[:, 2] = peaks, -0.77 * peaks, 1.0
    return peaks, x


@pytest.mark.parametrize("mode", list(THRESHOLDS), ids=lambda m: m.value)
@pytest.mark.parametrize("elem", list(ELEMENTS), ids=str)
def test_scales_and_values_near_the_float32_limit(elem, mode):
    peaks, x = _blocks()
    spec = qstats.QuantSpec.from_torchao(elem_dtype=elem, block_size=32, scaling_mode=mode)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    scale_e8m0, data = mx.to_mx(x, elem, 32, mode)
    theirs = torch.pow(2.0, scale_e8m0.view(torch.uint8).float() - 127).reshape(qp.scale.shape)
    threshold = THRESHOLDS[mode].get(ELEMENTS[elem], float("inf")) * 2.0**127
    above = peaks >= threshold
    assert torch.equal(qp.scale[~above], theirs[~above])
    assert torch.equal(qp.scale[above], theirs[above] / 2)
    reference = mx.to_dtype(data, scale_e8m0, elem, 32, torch.float32)
    ours = qstats.fake_quantize(x, qp, spec)
    assert torch.isfinite(ours).all()
    finite = torch.isfinite(reference).all(-1)
    agree = (ours == reference).all(-1)
    if ELEMENTS[elem] == "e4m3" and mode in (Mode.CEIL, Mode.RCEIL):
        clipped = finite & ~agree
        assert clipped.any() and (peaks[clipped] > 448 * 2.0**119).all()
        assert (ours[clipped].abs().amax(-1) == 448 * 2.0**119).all()
        assert (reference[clipped].abs().amax(-1) > 448 * 2.0**119).all()
    else:
        assert agree[finite].all()
