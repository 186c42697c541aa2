"""float64 inputs to the emulated element formats (fp4, fp6) and their MX/NVFP4 block scales are
rounded once, in float64, as compressed-tensors' ``cast_to_fp4`` and ``fake_quantize`` round them;
rounding to float32 first put a value just past a tie onto the tie (2.5 + 2.5e-12 became 2, not 3)."""

import warnings

import pytest
import torch

import qstats
from qstats._spec import float_format

warnings.filterwarnings("ignore")

TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def _past_ties():
    """Values just past (and just before) every fp4 tie, both signs, in float64."""
    values = torch.cat([TIES * (1 + 1e-12), TIES * (1 - 1e-12), TIES])
    return torch.cat([values, -values, torch.zeros(64 - 2 * values.numel(), dtype=torch.float64)])


def _grid(name):
    """Every non-negative value of the format, from qstats' bit-code decoder (checked against torchao's)."""
    fmt = float_format(name)
    codes = torch.arange(2 ** (fmt.exponent_bits + fmt.mantissa_bits), dtype=torch.uint8)
    from qstats._formats import decode

    return decode(codes, fmt).double()


def _nearest_even(x, name):
    """Round-to-nearest, ties to the even code, in float64 arithmetic on the enumerated grid."""
    grid = _grid(name)
    magnitude = x.abs().clamp(max=float(grid.max()))
    distance = (magnitude.unsqueeze(-1) - grid).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = (distance == best)
    # among equally near grid values the one with the even code (even index) wins
    index = torch.arange(grid.numel())
    chosen = torch.where(candidates & (index % 2 == 0), index, grid.numel()).min(-1).values
    chosen = torch.where(candidates.sum(-1) > 1, chosen, distance.argmin(-1))
    return torch.copysign(grid[chosen], x)


def test_fp4_rounding_of_float64_equals_compressed_tensors_cast_to_fp4():
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x = _past_ties()
    assert torch.equal(qstats.round_to_format(x, float_format("fp4_e2m1")).double(), cast_to_fp4(x.clone()))


@pytest.mark.parametrize("name", ("fp4_e2m1", "fp6_e2m3", "fp6_e3m2"))
def test_float64_rounding_is_nearest_even_on_the_grid(name):
    grid = _grid(name)
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([midpoints, midpoints * (1 + 1e-12), midpoints * (1 - 1e-12)])
    x = torch.cat([x, -x])
    assert torch.equal(qstats.round_to_format(x, float_format(name)).double(), _nearest_even(x, name))


@pytest.mark.parametrize("scheme", ("NVFP4", "MXFP4"))
def test_float64_fake_quantize_equals_compressed_tensors(scheme):
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize

    args = preset_name_to_scheme(scheme, ["Linear"]).weights
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    x = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[0] = _past_ties()
    x[1] = _past_ties() * 3
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    global_scale = qp.global_scale.reshape(1) if scheme == "NVFP4" else None
    reference = ct_fake_quantize(x, qp.scale, torch.zeros_like(qp.scale), args, global_scale=global_scale)
    assert reference.dtype == torch.float64
    assert torch.equal(qstats.fake_quantize(x, qp, spec), reference)
