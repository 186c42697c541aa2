"""qwix's outlier-aware MX scales (``scale = 2 ** ceil(log2(absmax / qmax))``, so the block's
largest value is never clipped) are qstats' ``scale_rounding="rceil"``.

qwix is a JAX library and is not installed here; ``_qwix_mx_scale`` transcribes its
``compute_scale_zero_point`` (qwix/_src/core/qarray.py: absmax calibration over tiles of 32 along
the last axis, ``scale = absmax / qmax``, a zero scale becomes 1, then rounded up to a power of
two) in float64 numpy, an independent computation.
"""

import numpy as np
import pytest
import torch

import qstats


def _qwix_mx_scale(x: torch.Tensor, qmax: float) -> np.ndarray:
    tiles = x.double().numpy().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    absmax = np.abs(tiles).max(axis=-1).astype(np.float32)
    scale = absmax / np.float32(qmax)
    scale = np.where(scale == 0, np.float32(1.0), scale)
    return (2.0 ** np.ceil(np.log2(scale.astype(np.float32)))).astype(np.float32)


def _inputs():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(16, 128, generator=g)
    outlier = normal.clone()
    outlier[3, 5] = 900.0
    exact = torch.tensor([6.0, 3.0, 12.0, 0.75]).repeat(4, 32)  # block maxima on the grid
    wide = torch.randn(8, 64, generator=g) * torch.logspace(-20, 20, 64)
    return [normal, outlier, exact, wide]


@pytest.mark.parametrize("name, qmax", [("mxfp4", 6.0), ("mxfp8", 448.0), ("mxfp6_e2m3", 7.5)])
def test_rceil_scales_equal_qwix_outlier_aware_scales(name, qmax):
    spec = qstats.preset(name, scale_rounding="rceil")
    obs = qstats.minmax(spec)
    for x in _inputs():
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        expected = _qwix_mx_scale(x, qmax)
        assert np.array_equal(qp.scale.numpy(), expected)
        # Outlier-aware: nothing is clipped, every value fits the element range.
        fq = qstats.fake_quantize(x, qp, spec)
        view = qstats.canonical_view(x, spec.granularity)
        assert bool((view.abs() <= qmax * qp.scale.unsqueeze(0).unsqueeze(-1)).all())
        assert torch.isfinite(fq).all()


def test_floor_scales_clip_where_qwix_does_not():
    x = torch.full((1, 32), 5.0)  # floor: scale 1 -> 5 fits; 7 would clip at 6
    x[0, 0] = 7.0
    floor_spec = qstats.preset("mxfp4")
    rceil_spec = qstats.preset("mxfp4", scale_rounding="rceil")
    for spec, clips in ((floor_spec, True), (rceil_spec, False)):
        obs = qstats.minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
        assert bool((x.abs() > 6.0 * qp.scale).any()) == clips
