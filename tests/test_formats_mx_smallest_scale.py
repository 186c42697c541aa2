"""MX blocks whose e8m0 scale is the smallest, ``2**-127`` (docs/formats.md): torchao's ``to_mx`` divides
them by ``2**-126`` (its floor on the scale, FLOOR/CEIL/EVEN) or by 1 (RCEIL) and ``to_dtype`` multiplies
by ``2**-127``; ``from_torchao`` gives torchao's values bit for bit (halved, or 0), the ``"mx*"`` presets
(torch.ao's convention) divide and multiply by ``2**-127`` (the values themselves, to e4m3's precision)."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")
mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

X = torch.linspace(-1.0, 1.0, 64).reshape(2, 32) * 2.0**-120  # e4m3 FLOOR: biased exponent 0 from 2**-118 down


def _fake(spec):
    obs = qstats.minmax(spec)
    return qstats.fake_quantize(X, qstats.compute_qparams(obs.update(obs.init(X), X), spec), spec)


@pytest.mark.parametrize("mode", list(ScaleCalculationMode), ids=lambda m: m.value)
def test_smallest_scale_blocks_as_torchao_and_as_the_presets(mode):
    scale, data = mx.to_mx(X, torch.float8_e4m3fn, 32, mode)
    assert (scale.view(torch.uint8) == 0).all()  # the case: the smallest e8m0 scale
    theirs = mx.to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    ours = _fake(qstats.QuantSpec.from_torchao(elem_dtype=torch.float8_e4m3fn, scaling_mode=mode))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    preset = _fake(qstats.preset("mxfp8", scale_rounding=mode.value.lower()))
    assert torch.equal(preset, X.div(2.0**-127).to(torch.float8_e4m3fn).float().mul(2.0**-127))
    if mode == ScaleCalculationMode.RCEIL:
        assert (theirs == 0).all()
    else:
        assert torch.equal(theirs, X.div(2.0**-126).to(torch.float8_e4m3fn).float().mul(2.0**-127))
        assert torch.equal(theirs * 2, preset)
