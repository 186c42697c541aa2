"""Range searches of a histogram state where some channels saw no finite value: the error names
how many quantization parameters are uncalibrated, counted from the data itself."""

import re

import pytest
import torch

import qstats


@pytest.mark.parametrize("method", ["l2", "mse", "entropy", "percentile"])
def test_float_zero_point_searches_count_the_uncalibrated_channels(method):
    # torch.ao's per_channel_affine_float_qparams (uint8, float zero point): its candidate grid
    # raised from inside the search, counting candidates ("12 of 48", "128 of 512") as parameters
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", zero_point_domain="float",
                            granularity=qstats.PerAxis(0))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[2] = float("nan")
    expected = int((~torch.isfinite(x).any(1)).sum())  # channels without a finite value
    obs = qstats.histogram(spec)
    state = obs.update(obs.init(x), x)
    with pytest.raises(ValueError, match=re.escape(f"{expected} of {x.shape[0]} quantization parameter(s)")):
        qstats.compute_qparams(state, spec, method=method)
