"""e8m0 (MX) block scales at and around every rounding boundary of every binade, against torchao's
``to_mx`` (FLOOR, CEIL, EVEN, RCEIL; every element format; fp32 and bf16 inputs) and compressed-tensors'
``generate_mx_scales`` through llm-compressor's observer (MXFP4, MXFP8; fp32, bf16, fp16 weights).

Each block's amax is ``m * 2**k`` for k in [-126, 126] and m at the boundaries the modes round at:
1 (a power of two), 1 + ulp, 1.5 +- ulp (one mantissa bit), 1.75 +- ulp (fp4/fp6 EVEN, and
compressed-tensors' round-then-floor), 1.875, 1.9375 and 2 - ulp. Scales and fake-quantized values
must be equal bit for bit wherever the reference's are finite (blocks near the float32 limit:
docs/differences.md)."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")
mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread_quiet")

ULP = 2.0**-23
MANTISSAS = (1, 1 + ULP, 1.25, 1.5 - ULP, 1.5, 1.5 + ULP, 1.75 - ULP, 1.75, 1.75 + ULP, 1.875, 1.9375, 2 - ULP)
ELEMENTS = (torch.float8_e4m3fn, torch.float8_e5m2, "fp6_e2m3", "fp6_e3m2", torch.float4_e2m1fn_x2)


def _blocks():
    """One block of 32 per amax: the amax first (every other row negative), then values below it."""
    mantissas = torch.tensor(MANTISSAS, dtype=torch.float64)
    exponents = torch.arange(-126, 127, dtype=torch.float64)
    amax = (mantissas[None, :] * 2.0 ** exponents[:, None]).flatten()
    amax = amax[amax < 3.0e38].float()
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(len(amax), 32, generator=g) * 2 - 1) * amax[:, None]
    x[:, 0] = amax
    x[::2, 0] = -amax[::2]
    return x


BLOCKS = _blocks()


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _bits(t):
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("elem", ELEMENTS, ids=str)
def test_torchao_to_mx_at_every_binade_boundary(elem, dtype):
    x = BLOCKS.to(dtype)
    x = x[torch.isfinite(x).all(1)]
    for mode in ScaleCalculationMode:
        spec = qstats.QuantSpec.from_torchao(elem_dtype=elem, scaling_mode=mode)
        scale, data = mx.to_mx(x, elem, 32, mode)
        reference = mx.to_dtype(data, scale, elem, 32, dtype)
        qp = _observe(spec, x)
        expected = torch.pow(2.0, scale.view(torch.uint8).float() - 127).reshape(qp.scale.shape)
        finite = torch.isfinite(reference).all(1) & torch.isfinite(expected).all(1)
        assert finite.float().mean() > 0.95, mode
        assert torch.equal(qp.scale[finite], expected[finite]), mode
        fake = qstats.fake_quantize(x, qp, spec)
        assert torch.equal(_bits(fake[finite]), _bits(reference[finite])), mode


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("scheme", ("MXFP4", "MXFP8"))
def test_compressed_tensors_mx_at_every_binade_boundary(scheme, dtype):
    from compressed_tensors.quantization import quant_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from llmcompressor.observers import Observer

    x = BLOCKS.to(dtype)
    x = x[torch.isfinite(x).all(1) & (x[:, 0] != 0)]
    args = getattr(quant_scheme, scheme)["weights"].model_copy(deep=True)
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(x)
    reference = observer.get_qparams()
    theirs = ct_fake_quantize(x, reference["scale"], reference["zero_point"], args)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    qp = _observe(spec, x)
    expected = reference["scale"].float().reshape(qp.scale.shape)
    finite = torch.isfinite(expected).all(1) & torch.isfinite(theirs).all(1)
    assert finite.float().mean() > 0.95
    assert torch.equal(qp.scale[finite], expected[finite])
    assert torch.equal(_bits(qstats.fake_quantize(x, qp, spec)[finite]), _bits(theirs[finite]))
