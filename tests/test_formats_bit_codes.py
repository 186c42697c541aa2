"""Bit codes of the emulated fp6/fp4 formats given to `dequantize`: torchao's unpacked decoders
(``f4_unpacked_to_f32``, ``f6_*_unpacked_to_f32``) define one value per code in ``[0, 2**bits)``;
codes past the format's width (packed fp4 bytes, signed bytes) are refused, not read modulo the width.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

WIDTHS = {"fp4_e2m1": 4, "fp6_e2m3": 6, "fp6_e3m2": 6}
PRESETS = {"fp4_e2m1": "mxfp4", "fp6_e2m3": "mxfp6_e2m3", "fp6_e3m2": "mxfp6_e3m2"}


def _decoder(name):
    from torchao.prototype.mx_formats import kernels

    return {
        "fp4_e2m1": kernels.f4_unpacked_to_f32,
        "fp6_e2m3": kernels.f6_e2m3_unpacked_to_f32,
        "fp6_e3m2": kernels.f6_e3m2_unpacked_to_f32,
    }[name]


def _unit_qparams(spec, shape):
    one = torch.ones(shape[:-1] + (shape[-1] // 32,))
    return qstats.QParams(one, torch.zeros_like(one, dtype=torch.int32), torch.tensor(1.0), torch.ones_like(one, dtype=torch.bool))


@pytest.mark.parametrize("name", sorted(WIDTHS))
def test_dequantize_of_every_code_equals_torchao_decoder(name):
    spec = qstats.preset(PRESETS[name])
    codes = torch.arange(2 ** WIDTHS[name], dtype=torch.uint8).repeat(8)[:128].reshape(4, 32)
    assert torch.equal(qstats.dequantize(codes, _unit_qparams(spec, (4, 32)), spec), _decoder(name)(codes))


@pytest.mark.parametrize("name", sorted(WIDTHS))
def test_codes_past_the_format_width_are_refused(name):
    spec = qstats.preset(PRESETS[name])
    qp = _unit_qparams(spec, (1, 32))
    top = 2 ** WIDTHS[name]
    # torchao reads the bits past the width as exponent bits (code 16 of fp4 is 128, not 0): a value
    # no fp4 quantization produced; qstats used to drop them (code 16 decoded as 0)
    outside = torch.full((1, 32), top, dtype=torch.uint8)
    assert float(_decoder(name)(outside)[0, 0]) != 0.0
    with pytest.raises(ValueError, match=rf"{name} bit codes lie in \[0, {top - 1}\]"):
        qstats.dequantize(outside, qp, spec)
    with pytest.raises(ValueError, match="unpack"):
        qstats.dequantize(torch.full((1, 32), -1, dtype=torch.int8), qp, spec)


def test_packed_fp4_bytes_are_refused():
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4

    spec = qstats.preset("mxfp4")
    w = torch.randn(2, 64)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    packed = pack_uint4(f32_to_f4_unpacked(w[:, :32] / 2))  # two codes per byte: 16 bytes a row
    packed = torch.cat([packed, packed, packed, packed], dim=1)  # (2, 64) bytes, two per element
    if int(packed.max()) < 16:
        pytest.skip("no byte with a high nibble")
    with pytest.raises(ValueError, match="fp4_e2m1 bit codes"):
        qstats.dequantize(packed, qp, spec)


def test_refusal_under_vmap_and_valid_codes_under_vmap():
    spec = qstats.preset("mxfp4")
    qp = _unit_qparams(spec, (3, 32))
    scales = qp.scale.unsqueeze(0).expand(2, 3, 1)
    codes = torch.arange(16, dtype=torch.uint8).repeat(12).reshape(2, 3, 32)

    def run(c, scale):
        return qstats.dequantize(c, qp._replace(scale=scale), spec)

    expected = _decoder("fp4_e2m1")(codes)
    assert torch.equal(torch.vmap(run)(codes, scales), expected)
    with pytest.raises(ValueError, match="fp4_e2m1 bit codes"):
        torch.vmap(run)(codes + 16, scales)
