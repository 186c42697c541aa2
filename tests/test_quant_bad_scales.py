"""Hand-made or corrupt qparams whose scale is zero or negative: `quantize`, `fake_quantize` and
`dequantize` raise a ValueError naming the scale; `quantize` refuses NaN and Inf scales too (every code
was 0). torch's fake-quant ops and compressed-tensors take them and give numbers silently (a zero scale:
every value 0, NaN at x = 0 in qstats; a negative one: codes of the other sign). An Inf or NaN scale's
NaN and +-Inf values stay visible in `fake_quantize` and `dequantize`, as torchao's
(tests/test_torchao_convention_float8_dequantize_scale_overflow.py).
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

pytestmark = pytest.mark.usefixtures("single_thread_quiet")

X = torch.tensor([[1.0, -2.0, 0.0, 0.3], [0.5, -0.25, 3.0, -0.0]])
BAD = {"zero": 0.0, "negative": -0.1, "nan": float("nan"), "inf": float("inf")}
NOT_POSITIVE = ["zero", "negative"]


def _specs():
    return {
        "torch_ao-tensor": qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_affine),
        "torch_ao-channel": qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0),
        "default": qstats.QuantSpec(dtype="int8"),
        "compressed_tensors-int4-group": qstats.QuantSpec.from_compressed_tensors(
            dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=2)),
        "compressed_tensors-fp8": qstats.QuantSpec.from_compressed_tensors(
            dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
        "torchao-int8": qstats.QuantSpec.from_torchao(torch.int8),
        "torchao-fp8": qstats.QuantSpec.from_torchao(torch.float8_e4m3fn),
    }


SPECS = _specs()


def _qparams(spec, value, index=0):
    """QParams of ``spec`` for X, one scale (``index``) set to ``value``."""
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(X), X), spec)
    scale = qp.scale.clone()
    scale.view(-1)[index] = value
    return qp._replace(scale=scale)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("name", SPECS)
def test_quantize_refuses_the_scale(name, bad):
    spec = SPECS[name]
    with pytest.raises(ValueError, match="quantize: qparams scales must be positive and finite"):
        qstats.quantize(X, _qparams(spec, BAD[bad], index=-1), spec)


@pytest.mark.parametrize("bad", NOT_POSITIVE)
@pytest.mark.parametrize("name", SPECS)
def test_fake_quantize_and_dequantize_refuse_zero_and_negative_scales(name, bad):
    spec = SPECS[name]
    codes = qstats.quantize(X, _qparams(spec, 1.0), spec)
    qp = _qparams(spec, BAD[bad], index=-1)
    if not spec.is_float:  # fake_quantize checks scales within the zero-point check's host read only
        with pytest.raises(ValueError, match="fake_quantize: qparams scales must not be zero or negative"):
            qstats.fake_quantize(X, qp, spec)
    with pytest.raises(ValueError, match="dequantize: qparams scales must not be zero or negative"):
        qstats.dequantize(codes, qp, spec)


def test_torch_hides_what_a_zero_negative_or_inf_scale_does():
    """What the refusals replace: torch's fake-quant op takes a zero scale (every value 0, where
    qstats gave NaN at x = 0) and a negative one (the values back, from codes of the other sign);
    quantize_per_tensor's codes under an Inf scale are all 0, as qstats' quantize gave them."""
    x = X.reshape(-1)
    assert torch.equal(torch.fake_quantize_per_tensor_affine(x, 0.0, 0, -128, 127).abs(), torch.zeros_like(x))
    assert torch.equal(torch.fake_quantize_per_tensor_affine(x, -1.0, 0, -128, 127), torch.round(x))
    codes = torch.quantize_per_tensor(x, float("inf"), 0, torch.qint8).int_repr()
    assert torch.equal(codes, torch.zeros_like(codes))
    spec = SPECS["torch_ao-tensor"]
    for scale in (0.0, -1.0):
        with pytest.raises(ValueError, match="fake_quantize: qparams scales"):
            qstats.fake_quantize(x, _qparams(spec, scale), spec)
    with pytest.raises(ValueError, match="quantize: qparams scales"):
        qstats.quantize(x, _qparams(spec, float("inf")), spec)


def test_one_bad_expert_scale_under_vmap_is_refused():
    spec = SPECS["torch_ao-tensor"]
    scales = torch.tensor([0.1, 0.0, 0.2])
    xs = X.reshape(1, -1).expand(3, -1)

    def one_expert(x, scale):
        qp = qstats.QParams(scale, torch.tensor(0, dtype=torch.int32), torch.tensor(1.0), torch.tensor(True))
        return qstats.fake_quantize(x, qp, spec)

    assert torch.vmap(one_expert)(xs, scales.abs() + 0.1).isfinite().all()
    with pytest.raises(ValueError, match="fake_quantize: qparams scales"):
        torch.vmap(one_expert)(xs, scales)


def _nvfp4_args():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4", ["Linear"]).weights


@pytest.mark.parametrize("global_scale", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["torchao", "compressed_tensors"])
def test_two_level_specs_refuse_a_global_scale_that_is_not_positive_and_finite(name, global_scale):
    """NVFP4's global scale: compressed-tensors' fake_quantize takes a negative or Inf one and gives
    every value 0 (a zero one: every value NaN); qstats gave 0, or codes of the other sign, or NaN."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize

    specs = {"torchao": lambda: qstats.QuantSpec.from_torchao(nvfp4=True),
             "compressed_tensors": lambda: qstats.QuantSpec.from_compressed_tensors(_nvfp4_args())}
    spec = specs[name]()
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    codes = qstats.quantize(x, qp, spec)
    bad = qp._replace(global_scale=torch.tensor(global_scale))
    if name == "compressed_tensors" and global_scale in (-1.0, float("inf")):
        theirs = ct_fake_quantize(x, qp.scale, torch.zeros_like(qp.scale), _nvfp4_args(),
                                  global_scale=bad.global_scale.reshape(1))
        assert torch.equal(theirs, torch.zeros_like(x))  # silently
    for where, call in (("quantize", lambda: qstats.quantize(x, bad, spec)),  # not fake_quantize: no host read there
                        ("dequantize", lambda: qstats.dequantize(codes, bad, spec))):
        with pytest.raises(ValueError, match=f"{where}: .*a two-level spec's global scale must be positive and finite"):
            call()

