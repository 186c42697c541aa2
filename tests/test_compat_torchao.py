"""QuantSpec.from_torchao: affine integer quantization bit for bit against torchao.

Reference: ``torchao.quantization.quant_primitives``: ``choose_qparams_affine`` /
``quantize_affine`` / ``dequantize_affine`` (ZeroPointDomain.INT), the same with the zero point
dropped (NONE: ``_quantize_affine_no_zero_point``), and ``_choose_qparams_affine_tinygemm`` /
``_quantize_affine_tinygemm`` / ``_dequantize_affine_tinygemm`` (FLOAT), for every MappingType and
the targets int1..int8 and uint1..uint8.
"""

import warnings

import pytest
import torch
from _torchao_affine import NO_CAST, torchao_qparams

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
from torchao.quantization import granularity as tao_granularity  # noqa: E402

MappingType, ZeroPointDomain = qp_lib.MappingType, qp_lib.ZeroPointDomain
SIGNED = [getattr(torch, f"int{b}") for b in range(1, 9)]
UNSIGNED = [getattr(torch, f"uint{b}") for b in range(1, 9)]


def _inputs():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 32, generator=g)
    outlier = base.clone()
    outlier[1, 3] = 500.0
    positive = base.abs() + 0.5
    return {
        "random": base,
        "positive": positive,
        "negative": -positive,
        "zeros": torch.zeros(4, 32),
        "tiny": base * 1e-30,
        "huge": base * 1e30,
        "outlier": outlier,
    }


INPUTS = _inputs()
GRANULARITIES = {
    "tensor": ((4, 32), qstats.PerTensor()),
    "row": ((1, 32), qstats.PerToken()),
    "group8": ((1, 8), qstats.PerGroup(8)),
}


def _observe(spec, x):
    obs = qstats.minmax(spec)
    return qstats.compute_qparams(obs.update(obs.init(x), x), spec)


def _check(spec, x, block_size, target_dtype, mapping, domain, scale_dtype=torch.float32, choose=None, **kwargs):
    kwargs = dict(scale_dtype=scale_dtype, **kwargs)
    if choose is not None:
        scale, zero_point = choose(x, mapping, block_size, target_dtype, **kwargs)
    elif domain == "FLOAT":
        scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(x, mapping, block_size, target_dtype, **kwargs)
    else:
        scale, zero_point = qp_lib.choose_qparams_affine(x, mapping, block_size, target_dtype, **kwargs)
    qp = _observe(spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    # The sub-byte torch dtypes (int1..int7) have no copy kernel, so the reference is torchao's
    # arithmetic before its final dtype cast (what quantize_affine itself calls).
    qmin, qmax = spec.qrange
    if domain == "INT":
        assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    elif domain == "NONE":
        zero_point = None
    else:
        assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point)
    quantize, dequantize = NO_CAST[domain]
    codes = quantize(x, block_size, scale, zero_point, qmin, qmax)
    values = dequantize(codes, block_size, scale, zero_point, qmin, qmax, torch.float32)
    ours = qstats.quantize(x, qp, spec)
    # a float16 scale below 2**-16 has an infinite reciprocal: torchao's code of a zero is then
    # 0 * Inf = NaN, qstats' the zero point's (dequantized: 0)
    nan = torch.isnan(codes)
    assert not nan.any() or (scale_dtype == torch.float16 and (x[nan] == 0).all())
    expected_codes = torch.where(nan, ours.to(codes.dtype), codes)  # (those dequantize to 0 below)
    assert torch.equal(ours.to(torch.int32), expected_codes.to(torch.int32))
    expected_values = torch.where(nan, torch.zeros_like(values), values)
    assert torch.equal(qstats.dequantize(ours, qp, spec), expected_values)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), expected_values)


@pytest.mark.parametrize("target_dtype", SIGNED + UNSIGNED, ids=str)
@pytest.mark.parametrize(
    "mapping",
    (MappingType.SYMMETRIC, MappingType.ASYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR),
    ids=lambda m: m.name,
)
def test_choose_qparams_affine_int_domain(target_dtype, mapping):
    if mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target_dtype in UNSIGNED:
        with pytest.raises(ValueError, match="signed"):
            qstats.QuantSpec.from_torchao(target_dtype, mapping_type=mapping)
        return
    if mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target_dtype == torch.int1:
        # torchao divides by quant_max = 0 and returns an infinite scale; qstats refuses the spec
        scale, _ = qp_lib.choose_qparams_affine(INPUTS["random"], mapping, (4, 32), target_dtype)
        assert torch.isinf(scale).all()
        with pytest.raises(ValueError, match="quant_max > 0"):
            qstats.QuantSpec.from_torchao(target_dtype, mapping_type=mapping)
        return
    for gname, (block_size, _) in GRANULARITIES.items():
        spec = qstats.QuantSpec.from_torchao(target_dtype, mapping_type=mapping, block_size=block_size, shape=(4, 32))
        for name, x in INPUTS.items():
            _check(spec, x, block_size, target_dtype, mapping, "INT")


@pytest.mark.parametrize("target_dtype", SIGNED + UNSIGNED, ids=str)
def test_zero_point_domain_none_and_float(target_dtype):
    for gname, (block_size, granularity) in GRANULARITIES.items():
        spec = qstats.QuantSpec.from_torchao(
            target_dtype, mapping_type=MappingType.SYMMETRIC, granularity=granularity,
            zero_point_domain=ZeroPointDomain.NONE,
        )
        for x in INPUTS.values():
            _check(spec, x, block_size, target_dtype, MappingType.SYMMETRIC, "NONE")
        make = lambda: qstats.QuantSpec.from_torchao(  # noqa: E731
            target_dtype, mapping_type=MappingType.ASYMMETRIC, granularity=granularity,
            zero_point_domain=ZeroPointDomain.FLOAT,
        )
        if target_dtype in SIGNED:
            # torchao's float zero point puts the minimum at code 0: a signed range clips the upper
            # part of the data it was calibrated on, so qstats refuses the spec
            x = torch.linspace(-3.0, 5.0, 128).reshape(4, 32)  # every block as wide as the others
            qmin, qmax = qp_lib._DTYPE_TO_QVALUE_BOUNDS[target_dtype]
            scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(
                x, MappingType.ASYMMETRIC, block_size, target_dtype, scale_dtype=torch.float32
            )
            codes = qp_lib._quantize_affine_tinygemm_no_dtype_cast(x, block_size, scale, zero_point, qmin, qmax)
            values = qp_lib._dequantize_affine_tinygemm_no_dtype_check(
                codes, block_size, scale, zero_point, qmin, qmax, torch.float32
            )
            assert float((values - x).abs().max()) > 0.5001 * float(scale.max())  # more than rounding
            with pytest.raises(ValueError, match="zero_point_domain"):
                make()
            continue
        spec = make()
        for name, x in INPUTS.items():
            _check(spec, x, block_size, target_dtype, MappingType.ASYMMETRIC, "FLOAT")


@pytest.mark.parametrize("scale_dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("target_dtype", (torch.int8, torch.uint8, torch.int4, torch.int16), ids=str)
def test_half_precision_scales_on_float32_inputs(target_dtype, scale_dtype):
    """bf16/fp16 scales on float32 inputs: torchao quantizes by ``x * (1.0 / scale)`` with the
    reciprocal in the scale's dtype, so codes and dequantized values (not only the qparams)
    follow that dtype; every mapping and zero-point domain, three granularities. Where torchao's
    scale overflows the scale dtype, qstats' is the dtype's largest value; where it underflows to 0
    (1e-30 data in fp16), qstats' is the dtype's smallest positive value."""
    for gname, (block_size, granularity) in GRANULARITIES.items():
        for mapping, domain in (
            (MappingType.SYMMETRIC, "INT"), (MappingType.ASYMMETRIC, "INT"),
            (MappingType.SYMMETRIC_NO_CLIPPING_ERR, "INT"), (MappingType.SYMMETRIC, "NONE"),
        ):
            if mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target_dtype == torch.uint8:
                continue
            spec = qstats.QuantSpec.from_torchao(
                target_dtype, mapping_type=mapping, granularity=granularity, scale_dtype=scale_dtype,
                zero_point_domain=getattr(ZeroPointDomain, domain),
            )
            for x in INPUTS.values():
                scale, _ = qp_lib.choose_qparams_affine(x, mapping, block_size, target_dtype, scale_dtype=scale_dtype)
                if torch.isfinite(scale).all() and (scale > 0).all():
                    _check(spec, x, block_size, target_dtype, mapping, domain, scale_dtype=scale_dtype)
                    continue
                # past the scale dtype (1e30 data in fp16): torchao's scale is Inf, qstats' the
                # dtype's largest value; below it (1e-30 data in fp16) torchao's is 0, qstats' the
                # smallest subnormal; its fake quantization finite
                qp = _observe(spec, x)
                usable = (torch.isfinite(scale) & (scale > 0)).reshape(qp.scale.shape)
                theirs = scale.float().reshape(qp.scale.shape)
                assert torch.equal(qp.scale[usable], theirs[usable])
                finfo = torch.finfo(scale_dtype)
                assert (qp.scale[torch.isinf(theirs)] == finfo.max).all()
                assert (qp.scale[theirs == 0] == finfo.tiny * finfo.eps).all()
                assert torch.isfinite(qstats.fake_quantize(x, qp, spec)).all()


def test_custom_range_eps_and_bf16_scale():
    x = INPUTS["outlier"]
    spec = qstats.QuantSpec.from_torchao(
        torch.int8, mapping_type=MappingType.ASYMMETRIC, quant_min=-100, quant_max=90, eps=1e-3,
        scale_dtype=torch.bfloat16, granularity=qstats.PerToken(),
    )
    scale, zero_point = qp_lib.choose_qparams_affine(
        x, MappingType.ASYMMETRIC, (1, 32), torch.int8, quant_min=-100, quant_max=90, eps=1e-3,
        scale_dtype=torch.bfloat16,
    )
    qp = _observe(spec, x)
    assert torch.equal(qp.scale, scale.float())
    assert torch.equal(qp.zero_point, zero_point)


def test_torchao_granularity_objects_and_block_size_mapping():
    cases = [
        (dict(granularity=tao_granularity.PerTensor()), qstats.PerTensor()),
        (dict(granularity=tao_granularity.PerAxis(0)), qstats.PerAxis(0)),
        (dict(granularity=tao_granularity.PerGroup(32)), qstats.PerGroup(32)),
        (dict(granularity=tao_granularity.PerRow()), qstats.PerRow()),
        (dict(granularity=tao_granularity.PerToken()), qstats.PerToken()),
        (dict(granularity=tao_granularity.PerBlock((128, 128))), qstats.PerBlock((128, 128))),
        (dict(block_size=(256, 512), shape=(256, 512)), qstats.PerTensor()),
        (dict(block_size=(1, 512), shape=(256, 512)), qstats.PerToken()),
        (dict(block_size=(1, 64), shape=(256, 512)), qstats.PerGroup(64)),
        (dict(block_size=(128, 128), shape=(256, 512)), qstats.PerBlock((128, 128))),
    ]
    for kwargs, expected in cases:
        assert qstats.QuantSpec.from_torchao(torch.int8, **kwargs).granularity == expected


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="mapping_type"):
        qstats.QuantSpec.from_torchao(torch.int8, mapping_type="AFFINE")
    with pytest.raises(ValueError, match="FLOAT"):
        qstats.QuantSpec.from_torchao(torch.int4, mapping_type=MappingType.SYMMETRIC, zero_point_domain=ZeroPointDomain.FLOAT)
    with pytest.raises(ValueError, match="shape"):
        qstats.QuantSpec.from_torchao(torch.int8, block_size=(1, 32))
    with pytest.raises(ValueError, match="unexpected"):
        qstats.QuantSpec.from_torchao(torch.int8, output_dtype=torch.int8)
    with pytest.raises(ValueError, match="preserve_zero=False needs MappingType.ASYMMETRIC"):
        qstats.QuantSpec.from_torchao(torch.int8, preserve_zero=False)  # torchao asserts it too
    with pytest.raises(ValueError, match="NVFP4 needs block_size 16"):
        qstats.QuantSpec.from_torchao(nvfp4=True, block_size=32)
    with pytest.raises(ValueError, match="elem_dtype"):
        qstats.QuantSpec.from_torchao(elem_dtype=torch.int8, scaling_mode="FLOOR")


FLOAT8_GRANULARITIES = {
    "tensor": ((4, 32), tao_granularity.PerTensor()),
    "row": ((1, 32), tao_granularity.PerRow()),
    "block": ((2, 16), tao_granularity.PerBlock((2, 16))),
}


@pytest.mark.parametrize("float8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
@pytest.mark.parametrize("scale_dtype", (torch.float32, torch.float8_e8m0fnu), ids=str)
def test_float8_matches_choose_scale_float8(float8_dtype, scale_dtype):
    for gname, (block_size, granularity) in FLOAT8_GRANULARITIES.items():
        spec = qstats.QuantSpec.from_torchao(float8_dtype, granularity=granularity, scale_dtype=scale_dtype)
        for name, x in INPUTS.items():
            if name == "zeros":
                continue  # torchao's scale is 0 there (0 / 0 below); see the next test
            scale = qp_lib._choose_scale_float8(x, list(block_size), float8_dtype, scale_dtype)
            qp = _observe(spec, x)
            assert torch.equal(qp.scale.reshape(scale.shape), scale), (gname, name)
            codes = qp_lib._quantize_affine_float8(x, scale, float8_dtype)
            ours = qstats.quantize(x, qp, spec)
            assert ours.dtype == float8_dtype and torch.equal(ours.view(torch.uint8), codes.view(torch.uint8))
            values = qp_lib._dequantize_affine_float8(codes, scale, torch.float32)
            assert torch.equal(qstats.fake_quantize(x, qp, spec), values), (gname, name)


def test_float8_all_zero_rows_get_a_positive_scale_where_torchao_divides_by_zero():
    x = INPUTS["random"].clone()
    x[2] = 0.0
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=tao_granularity.PerRow())
    scale = qp_lib._choose_scale_float8(x, [1, 32], torch.float8_e4m3fn)
    assert scale[2] == 0 and torch.isnan(qp_lib._dequantize_affine_float8(
        qp_lib._quantize_affine_float8(x, scale), scale))[2].all()
    qp = _observe(spec, x)
    assert (qp.scale > 0).all()
    out = qstats.fake_quantize(x, qp, spec)
    assert torch.equal(out[2], torch.zeros(32))
    assert torch.equal(out[[0, 1, 3]], qp_lib._dequantize_affine_float8(qp_lib._quantize_affine_float8(x, scale), scale)[[0, 1, 3]])


@pytest.mark.parametrize("input_dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("target_dtype", (torch.int4, torch.uint4, torch.int8, torch.uint8), ids=str)
def test_low_precision_inputs_compute_in_the_input_dtype(input_dtype, target_dtype):
    cases = [
        (MappingType.SYMMETRIC, ZeroPointDomain.INT),
        (MappingType.ASYMMETRIC, ZeroPointDomain.INT),
        (MappingType.SYMMETRIC_NO_CLIPPING_ERR, ZeroPointDomain.INT),
        (MappingType.SYMMETRIC, ZeroPointDomain.NONE),
        (MappingType.ASYMMETRIC, ZeroPointDomain.FLOAT),
    ]
    for mapping, domain in cases:
        if mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target_dtype in UNSIGNED:
            continue
        if domain == ZeroPointDomain.FLOAT and target_dtype not in UNSIGNED:
            continue  # refused: test_zero_point_domain_none_and_float
        for gname, (block_size, granularity) in GRANULARITIES.items():
            spec = qstats.QuantSpec.from_torchao(
                target_dtype, mapping_type=mapping, granularity=granularity, zero_point_domain=domain,
                input_dtype=input_dtype,
            )
            for name, x32 in INPUTS.items():
                if name in ("tiny", "huge") and input_dtype == torch.float16:
                    continue  # outside float16's range
                x = x32.to(input_dtype)
                choose = qp_lib._choose_qparams_affine_tinygemm if domain == ZeroPointDomain.FLOAT else qp_lib.choose_qparams_affine
                scale, zero_point = choose(x, mapping, block_size, target_dtype)
                qp = _observe(spec, x)
                assert torch.equal(qp.scale.reshape(scale.shape), scale.float()), (mapping, domain, gname, name)
                zp = None if domain == ZeroPointDomain.NONE else zero_point
                if zp is not None:
                    assert torch.equal(qp.zero_point.reshape(zp.shape).to(zp.dtype), zp)
                q, dq = qp_lib._do_fake_quantize_affine(
                    x, block_size, scale, zp, target_dtype, spec.qrange[0], spec.qrange[1], zero_point_domain=domain
                )
                assert torch.equal(qstats.quantize(x, qp, spec).to(torch.int32), q.to(torch.int32))
                out = qstats.fake_quantize(x, qp, spec)
                assert out.dtype == input_dtype and torch.equal(out, dq), (mapping, domain, gname, name)


def test_per_block_granularity_of_3d_tensors_matches_get_block_size():
    # torchao pads a short PerBlock block_size with leading 1s (get_block_size); an explicit
    # leading 1 is the same granularity, a leading entry above 1 spans leading dimensions (it used
    # to be dropped silently, then refused; issue 22, item 14)
    from torchao.quantization.utils import get_block_size

    x = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(1))
    for block in ((2, 4), (1, 2, 4), (8,), (2, 2, 4), (4, 1, 8), (2, 4, 8)):
        granularity = tao_granularity.PerBlock(block)
        block_size = get_block_size(x.shape, granularity)
        spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=granularity)
        _check(spec, x, block_size, torch.int8, MappingType.ASYMMETRIC, "INT")
        float8 = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=granularity)
        scale = qp_lib._choose_scale_float8(x, list(block_size), torch.float8_e4m3fn)
        qp = _observe(float8, x)
        assert torch.equal(qp.scale.reshape(-1), scale.reshape(-1)), block


@pytest.mark.parametrize(
    "shape, block_size",
    [((6, 6, 4, 4), (3, 3, 2, 2)), ((3, 3, 4, 4), (3, 3, 2, 2)), ((4, 6, 8), (2, 3, 4)), ((4, 6, 8), (4, 2, 8))],
)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
def test_blocks_spanning_leading_dimensions(shape, block_size, mapping):
    """torchao's block_size with entries above 1 before the last two dimensions (issue 22, item 14):
    qparams, codes and values of choose_qparams_affine / quantize_affine, through ``block_size``
    with ``shape`` and through a PerBlock granularity."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3 + 0.5
    by_shape = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=mapping, block_size=block_size, shape=shape)
    by_block = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=mapping, granularity=tao_granularity.PerBlock(block_size))
    for spec in (by_shape, by_block):
        assert isinstance(spec.granularity, qstats.PerBlock)
        _check(spec, x, block_size, torch.int8, mapping, "INT")


def test_block_size_that_does_not_divide_the_shape_raises_at_construction():
    # torchao refuses such a block_size (get_block_size / choose_qparams_affine); the spec used to
    # be built (PerGroup(3), PerGroup(16)) and fail only when a tensor was observed.
    with pytest.raises(ValueError, match=r"block_size \(1, 3\) does not divide shape \(4, 8\)"):
        qstats.QuantSpec.from_torchao(torch.int8, block_size=(1, 3), shape=(4, 8))
    with pytest.raises(ValueError, match=r"block_size \(1, 16\) does not divide shape \(4, 8\)"):
        qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, block_size=(1, 16), shape=(4, 8))
    with pytest.raises(ValueError, match=r"does not divide"):
        qstats.QuantSpec.from_torchao(torch.int8, block_size=(0, 8), shape=(4, 8))


def test_bad_input_dtype_is_named():
    # scale_dtype defaults to input_dtype: the error used to blame scale_dtype
    with pytest.raises(ValueError, match="input_dtype"):
        qstats.QuantSpec.from_torchao(torch.int8, input_dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# arguments torchao accepts (issue 22, item 14) and half-precision arithmetic that overflows
# (item 18)


@pytest.mark.parametrize("dim", (0, 1, 2, -1, -2))
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
def test_per_row_along_any_dim(dim, mapping):
    """torchao's ``PerRow(dim)`` reduces along ``dim`` and keeps every other dimension
    (get_block_size); ``PerRow(dim=1)`` used to be refused."""
    from torchao.quantization.utils import get_block_size

    for shape in ((4, 6, 8), (6, 8)):
        if dim >= len(shape):
            continue
        x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 2 - 0.3
        granularity = tao_granularity.PerRow(dim=dim)
        spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=mapping, granularity=granularity)
        assert spec.granularity == qstats.PerRow(dim)
        _check(spec, x, get_block_size(shape, granularity), torch.int8, mapping, "INT")


@pytest.mark.parametrize("target_dtype", (torch.uint8, torch.int8, torch.uint4, torch.int4), ids=str)
def test_preserve_zero_false(target_dtype):
    """``preserve_zero=False``: the range need not contain zero
    (``_choose_qparams_affine_dont_preserve_zero``), quantized by ``quantize_affine``."""
    for gname, (block_size, granularity) in GRANULARITIES.items():
        spec = qstats.QuantSpec.from_torchao(
            target_dtype, mapping_type=MappingType.ASYMMETRIC, granularity=granularity, preserve_zero=False
        )
        assert not spec.preserve_zero
        for name, x in INPUTS.items():
            _check(spec, x, block_size, target_dtype, MappingType.ASYMMETRIC, "INT",
                   choose=qp_lib._choose_qparams_affine_dont_preserve_zero)
    # the range [2, 3] of positive data, where zero kept in the range would waste most codes
    x = torch.linspace(2.0, 3.0, 32)[None]
    spec = qstats.QuantSpec.from_torchao(target_dtype, mapping_type=MappingType.ASYMMETRIC, preserve_zero=False)
    kept = qstats.QuantSpec.from_torchao(target_dtype, mapping_type=MappingType.ASYMMETRIC)
    assert float(_observe(spec, x).scale) < float(_observe(kept, x).scale) / 2
    with pytest.raises(ValueError, match="preserve_zero"):
        qstats.QuantSpec(dtype="int8", mapping="asymmetric", preserve_zero=False)  # torch.ao keeps zero


@pytest.mark.parametrize("zero_point_dtype", (torch.int8, torch.int16, torch.int32, torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
def test_zero_point_dtypes_that_hold_the_zero_points(zero_point_dtype, mapping):
    for gname, (block_size, granularity) in GRANULARITIES.items():
        spec = qstats.QuantSpec.from_torchao(
            torch.int8, mapping_type=mapping, granularity=granularity, zero_point_dtype=zero_point_dtype
        )
        for x in INPUTS.values():
            _check(spec, x, block_size, torch.int8, mapping, "INT", zero_point_dtype=zero_point_dtype)


def test_zero_point_dtypes_that_change_the_zero_points_are_refused():
    x = INPUTS["positive"] - 3.0
    # torchao wraps a uint8 zero point into int8, rounds an int16 one to bfloat16
    _, wrapped = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (4, 32), torch.uint8, zero_point_dtype=torch.int8)
    _, exact = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (4, 32), torch.uint8)
    assert int(exact) > 127 and int(wrapped) != int(exact)
    with pytest.raises(ValueError, match="zero_point_dtype"):
        qstats.QuantSpec.from_torchao(torch.uint8, mapping_type=MappingType.ASYMMETRIC, zero_point_dtype=torch.int8)
    with pytest.raises(ValueError, match="zero_point_dtype"):
        qstats.QuantSpec.from_torchao(torch.int16, mapping_type=MappingType.ASYMMETRIC, zero_point_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="zero_point_dtype"):
        qstats.QuantSpec.from_torchao(torch.uint4, mapping_type=MappingType.ASYMMETRIC,
                                      zero_point_domain=ZeroPointDomain.FLOAT, zero_point_dtype=torch.bfloat16)


def test_float_zero_points_in_a_wider_dtype():
    x = INPUTS["random"].bfloat16()
    spec = qstats.QuantSpec.from_torchao(torch.uint4, mapping_type=MappingType.ASYMMETRIC, input_dtype=torch.bfloat16,
                                         zero_point_domain=ZeroPointDomain.FLOAT, zero_point_dtype=torch.float32)
    scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(
        x, MappingType.ASYMMETRIC, (1, 8), torch.uint4, zero_point_dtype=torch.float32)
    spec = spec.replace(granularity=qstats.PerGroup(8))
    qp = _observe(spec, x)
    assert zero_point.dtype == torch.float32
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    assert torch.equal(qp.zero_point.reshape(zero_point.shape), zero_point)


@pytest.mark.parametrize("target_dtype", (torch.int8, torch.uint8, torch.int4), ids=str)
def test_float64_scales(target_dtype):
    """``scale_dtype=torch.float64``: float32 scales held in float64, and ``x * (1 / scale)``
    formed in float64 by quantize_affine (codes differ from float32 arithmetic at ties)."""
    for gname, (block_size, granularity) in GRANULARITIES.items():
        for mapping, domain in ((MappingType.SYMMETRIC, "INT"), (MappingType.ASYMMETRIC, "INT"), (MappingType.SYMMETRIC, "NONE")):
            spec = qstats.QuantSpec.from_torchao(
                target_dtype, mapping_type=mapping, granularity=granularity, scale_dtype=torch.float64,
                zero_point_domain=getattr(ZeroPointDomain, domain),
            )
            assert spec.scale_dtype == "float64"
            for x in INPUTS.values():
                _check(spec, x, block_size, target_dtype, mapping, domain, scale_dtype=torch.float64)


def _fake_quantize_reference(x, mapping, block_size, target_dtype, scale_dtype, qrange):
    scale, zero_point = qp_lib.choose_qparams_affine(x, mapping, block_size, target_dtype, scale_dtype=scale_dtype)
    _, values = qp_lib._do_fake_quantize_affine(x, block_size, scale, zero_point, target_dtype, *qrange)
    return scale, zero_point, values


@pytest.mark.parametrize("input_dtype, scale_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
                         ids=("fp16-bf16scale", "bf16-fp16scale"))
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
def test_mixed_half_precision_input_and_scale_dtypes(input_dtype, scale_dtype, mapping):
    """fp16 inputs with bf16 scales made compute_qparams and mse.update raise (a clamp to bf16's
    largest value in fp16); bf16 inputs with fp16 scales gave an Inf scale from |x| ~ 8.4e6 on (the
    clamp rounded 65504 up to 65536 in bf16) and NaN values. Now: torchao's qparams and values
    wherever torchao's scale is finite, the scale dtype's largest value where it is Inf, and no
    input gives a NaN, Inf or zero scale or value."""
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=mapping, granularity=qstats.PerToken(),
                                         input_dtype=input_dtype, scale_dtype=scale_dtype)
    top = float(torch.finfo(input_dtype).max)
    rows = torch.tensor([[1.0, -2.0], [3e-3, 1e-3], [8.3e6, -1.0], [8.5e6, 2.0], [1e7, -3e7], [top, -top], [0.0, 0.0]])
    x = torch.cat([rows, torch.randn(7, 30, generator=torch.Generator().manual_seed(4))], dim=1)
    x = x.clamp(-top, top).to(input_dtype)
    scale, zero_point, values = _fake_quantize_reference(x, mapping, (1, 32), torch.int8, scale_dtype, spec.qrange)
    for qp in (_observe(spec, x), qstats.compute_qparams(qstats.mse(spec).update(qstats.mse(spec).init(x), x), spec)):
        assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
    qp = _observe(spec, x)
    theirs = scale.float().reshape(qp.scale.shape)
    finite = torch.isfinite(theirs)
    if scale_dtype == torch.float16 or mapping == MappingType.ASYMMETRIC:
        assert not finite.all()  # torchao overflows there: fp16 scales past 65504, fp16/bf16 spans
    assert torch.equal(qp.scale[finite], theirs[finite])
    # where torchao's scale is Inf: the exact range's scale, or the scale dtype's largest value
    lo, hi = x.double().amin(-1).clamp(max=0), x.double().amax(-1).clamp(min=0)
    exact = (hi - lo) / 255 if mapping == MappingType.ASYMMETRIC else torch.maximum(hi, -lo) / 127.5
    expected = exact.clamp(max=torch.finfo(scale_dtype).max).reshape(qp.scale.shape)
    torch.testing.assert_close(qp.scale[~finite].double(), expected[~finite], rtol=1e-2, atol=0)
    ours = qstats.fake_quantize(x, qp, spec)
    assert ours.dtype == input_dtype and torch.isfinite(ours).all()
    rows_finite = torch.isfinite(values).all(-1) & finite
    assert torch.equal(ours[rows_finite], values[rows_finite])
    if mapping == MappingType.ASYMMETRIC:
        assert torch.equal(qp.zero_point[finite], zero_point.reshape(qp.zero_point.shape)[finite])


@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR),
                         ids=lambda m: m.name)
@pytest.mark.parametrize("target_dtype", (torch.int8, torch.uint8, torch.int1, torch.uint1), ids=str)
def test_float16_compute_saturates(mapping, target_dtype):
    """``compute_dtype='float16'`` on float32 data past 65504 gave an Inf scale and all-NaN values;
    a span past 65504 (asymmetric) overflowed in torchao's own float16 arithmetic. qstats saturates
    the range at float16's largest value: its qparams are torchao's of the saturated float16 data
    wherever torchao's are finite, and every scale and value is finite."""
    if mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target_dtype in (torch.uint8, torch.uint1, torch.int1):
        return  # refused (test_choose_qparams_affine_int_domain)
    spec = qstats.QuantSpec.from_torchao(target_dtype, mapping_type=mapping, granularity=qstats.PerToken(),
                                         input_dtype=torch.float16)
    x = torch.tensor([[1e5, -3.0, 2.0, 7.0], [-1e9, 5e4, 1.0, 0.0], [6e4, -6e4, 1.0, 2.0], [0.5, -0.25, 0.0, 1.0],
                      [65504.0, -65504.0, 0.0, 1.0], [3e4, 1e4, 2e4, 3.0]])
    saturated = x.clamp(-65504, 65504).half()
    scale, zero_point = qp_lib.choose_qparams_affine(saturated, mapping, (1, 4), target_dtype)
    for data in (x, saturated):
        qp = _observe(spec, data)
        assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
        theirs = scale.float().reshape(qp.scale.shape)
        finite = torch.isfinite(theirs)
        assert torch.equal(qp.scale[finite], theirs[finite])
        assert torch.equal(qp.zero_point[finite], zero_point.reshape(qp.zero_point.shape)[finite])
        out = qstats.fake_quantize(data, qp, spec)
        assert not torch.isnan(out).any() and torch.isfinite(out).all()
    if mapping == MappingType.ASYMMETRIC:
        assert not torch.isfinite(scale).all()  # the case this is for: torchao's float16 span overflows


# --------------------------------------------------------------------------------------------
# every target dtype torchao's affine functions take, through its own public functions


_TORCHAO_QUANTIZE = {
    "INT": (qp_lib.quantize_affine, qp_lib.dequantize_affine),
    "NONE": (qp_lib._quantize_affine_no_zero_point, qp_lib._dequantize_affine_no_zero_point),
    "FLOAT": (qp_lib._quantize_affine_tinygemm, qp_lib._dequantize_affine_tinygemm),
}
TORCHAO_TARGETS = SIGNED + UNSIGNED + [torch.int16, torch.int32]
AFFINE_CASES = [  # (mapping, zero-point domain, preserve_zero)
    (MappingType.SYMMETRIC, "INT", True), (MappingType.ASYMMETRIC, "INT", True),
    (MappingType.SYMMETRIC_NO_CLIPPING_ERR, "INT", True), (MappingType.SYMMETRIC, "NONE", True),
    (MappingType.ASYMMETRIC, "FLOAT", True), (MappingType.ASYMMETRIC, "INT", False),
]


def _torchao_affine(x, target, mapping, domain, block_size, preserve_zero=True, **kwargs):
    """torchao's qparams, its arithmetic's codes before the final dtype cast, its stored codes
    and its values in ``x``'s dtype, each from its own functions (the stored codes and values
    from the public ones where torch can hold the target: int1..int7 have no copy kernel)."""
    scale, zero_point = torchao_qparams(x, target, mapping, domain, block_size, preserve_zero, **kwargs)
    qrange = (kwargs.get("quant_min"), kwargs.get("quant_max"))
    qmin, qmax = qp_lib._get_and_check_qmin_qmax(target, *qrange)
    quantize_no_cast, dequantize_no_check = NO_CAST[domain]
    uncast = quantize_no_cast(x, block_size, scale, zero_point, qmin, qmax)
    quantize, dequantize = _TORCHAO_QUANTIZE[domain]
    try:
        codes = quantize(x, block_size, scale, zero_point, target, *qrange)
    except NotImplementedError:  # "copy_" not implemented for 'Int4'
        return scale, zero_point, uncast, uncast, dequantize_no_check(uncast, block_size, scale, zero_point, qmin, qmax, x.dtype)
    values = dequantize(codes, block_size, scale, zero_point, target, *qrange, output_dtype=x.dtype)
    return scale, zero_point, uncast, codes, values


def _per_element(t, block_size, shape):
    """A per-block tensor (torchao's layout) repeated over every element of its block."""
    t = t.reshape([size // block for size, block in zip(shape, block_size)])
    for dim, block in enumerate(block_size):
        t = t.repeat_interleave(block, dim=dim)
    return t


def _compare_with_torchao(spec, x, target, mapping, domain, block_size, preserve_zero=True, **kwargs):
    scale, zero_point, uncast, codes, values = _torchao_affine(x, target, mapping, domain, block_size, preserve_zero, **kwargs)
    qmin, qmax = spec.qrange
    qp = _observe(spec, x)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    fine = torch.ones_like(x, dtype=torch.bool)
    if domain == "FLOAT":
        assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    elif domain == "INT":
        # int16 in bf16: torchao clamps an all-negative block's zero point to bf16(32767) = 32768;
        # qstats' is 32767 (docs/differences.md); those blocks are compared no further
        theirs = zero_point.to(torch.int64).clamp(qmin, qmax)
        assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(torch.int64), theirs)
        fine = _per_element(theirs == zero_point.to(torch.int64), block_size, x.shape)
    ours = qstats.quantize(x, qp, spec)
    # int16/int32: the top code rounds up past the target in bf16 (32767) or float32 (2**31 - 1)
    # arithmetic, and torchao's cast wraps it to the bottom code; qstats' is the top code
    wrapped = fine & (uncast.double() > qmax)
    fine = fine & ~wrapped
    assert not wrapped.any() or target in (torch.int16, torch.int32)
    assert torch.equal(ours.to(torch.int64)[fine], codes.to(torch.int64)[fine])
    assert (ours.to(torch.int64)[wrapped] == qmax).all()
    assert codes.dtype != target or (codes.to(torch.int64)[wrapped] == qmin).all()
    assert torch.equal(qstats.dequantize(ours, qp, spec).to(x.dtype)[fine], values[fine])
    assert torch.equal(qstats.fake_quantize(x, qp, spec)[fine], values[fine])


def _inputs_with_ties():
    inputs = dict(INPUTS)
    ties = torch.arange(128, dtype=torch.float32) - 63.5  # k + 1/2 at scale 1 (int8, per tensor)
    ties[0] = 127.5
    inputs["ties"] = ties.reshape(4, 32)
    return inputs


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("target_dtype", TORCHAO_TARGETS, ids=str)
def test_every_torchao_target_matches_choose_quantize_dequantize_affine(target_dtype, input_dtype):
    """Every target of torchao's affine functions (int1..int8, uint1..uint8, int16, int32; uint16
    used to be built, which torchao refuses), every MappingType, zero-point domain INT/NONE/FLOAT
    and preserve_zero=False, per tensor / row / group, float32 and bf16 inputs: scales, zero
    points, stored codes and values of choose_qparams_affine + quantize_affine + dequantize_affine
    (or their NONE/FLOAT/dont_preserve_zero variants)."""
    for mapping, domain, preserve_zero in AFFINE_CASES:
        make = lambda granularity: qstats.QuantSpec.from_torchao(  # noqa: E731
            target_dtype, mapping_type=mapping, zero_point_domain=getattr(ZeroPointDomain, domain),
            granularity=granularity, input_dtype=input_dtype, **({} if preserve_zero else dict(preserve_zero=False)),
        )
        refused = (mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and (target_dtype in UNSIGNED or target_dtype == torch.int1)
                   or domain == "FLOAT" and target_dtype not in UNSIGNED)
        if refused:  # documented in docs/differences.md (torchao: an infinite scale, or clipped data)
            with pytest.raises(ValueError):
                make(qstats.PerTensor())
            continue
        for gname, (block_size, granularity) in GRANULARITIES.items():
            spec = make(granularity)
            for name, x in _inputs_with_ties().items():
                _compare_with_torchao(spec, x.to(input_dtype), target_dtype, mapping, domain, block_size, preserve_zero)


@pytest.mark.parametrize(
    "target_dtype",
    [torch.uint16, torch.uint32, torch.uint64, torch.int64, torch.bool, torch.float32, torch.bfloat16,
     torch.float8_e8m0fnu, torch.quint8],
    ids=str,
)
def test_targets_torchao_refuses_are_refused_naming_the_dtype(target_dtype):
    # from_torchao(torch.uint16) used to build a uint16 spec
    with pytest.raises(ValueError, match="Unsupported dtype"):
        qp_lib.choose_qparams_affine(INPUTS["random"], MappingType.ASYMMETRIC, (1, 32), target_dtype)
    with pytest.raises(ValueError, match=str(target_dtype)):
        qstats.QuantSpec.from_torchao(target_dtype, mapping_type=MappingType.ASYMMETRIC)


@pytest.mark.parametrize("name", ("uint16", "int12", "uint9"))
def test_target_names_outside_torchao_are_refused(name):
    with pytest.raises(ValueError, match=name):
        qstats.QuantSpec.from_torchao(name)


def test_deprecated_torchao_dtype_enum_is_refused():
    # torchao's choose_qparams_affine (a custom op taking a ScalarType) refuses TorchAODType.INT4
    TorchAODType = qp_lib.TorchAODType
    with pytest.raises(RuntimeError, match="TorchAODType"):
        qp_lib.choose_qparams_affine(INPUTS["random"], MappingType.ASYMMETRIC, (1, 32), TorchAODType.INT4)
    with pytest.raises(ValueError, match="TorchAODType.INT4"):
        qstats.QuantSpec.from_torchao(TorchAODType.INT4, mapping_type=MappingType.ASYMMETRIC)


@pytest.mark.parametrize("float8_dtype", sorted(qp_lib.FP8_TYPES, key=str), ids=str)
def test_float8_targets_of_choose_qparams_affine_are_refused(float8_dtype):
    """torchao's choose_qparams_affine + quantize_affine on a float8 target round the codes to
    integers before the float8 cast; qstats refuses those arguments and names the dtype (they
    used to be 'unexpected arguments', or 'not an integer target' for the fnuz dtypes)."""
    x = INPUTS["random"] * 100
    scale, zero_point = qp_lib.choose_qparams_affine(x, MappingType.SYMMETRIC, (4, 32), float8_dtype)
    codes = qp_lib.quantize_affine(x, (4, 32), scale, zero_point, float8_dtype)
    assert torch.equal(codes.float(), codes.float().round())
    for kwargs in (dict(mapping_type=MappingType.SYMMETRIC), dict(zero_point_domain=ZeroPointDomain.INT), dict(eps=1e-6)):
        with pytest.raises(ValueError, match=str(float8_dtype)):
            qstats.QuantSpec.from_torchao(float8_dtype, **kwargs)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("scale_dtype", (torch.float32, torch.float8_e8m0fnu), ids=str)
@pytest.mark.parametrize("float8_dtype", sorted(qp_lib.FP8_TYPES, key=str), ids=str)
def test_float8_every_dtype_and_input_dtype(float8_dtype, scale_dtype, input_dtype):
    """_choose_scale_float8 + _quantize_affine_float8 + _dequantize_affine_float8 for every float8
    dtype torchao takes (the fnuz ones used to be refused) on float32, bf16 and fp16 inputs
    (``input_dtype=``: torchao divides ``amax / max`` and takes the e8m0 log2 in the input's dtype;
    bf16 scales used to differ in 54 of 64 rows)."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 64)[:, None]
    x = x.to(input_dtype)
    for block_size, granularity in FLOAT8_GRANULARITIES.values():
        block_size = (16, 16) if isinstance(granularity, tao_granularity.PerBlock) else block_size
        block_size = (64, 32) if isinstance(granularity, tao_granularity.PerTensor) else block_size
        granularity = tao_granularity.PerBlock((16, 16)) if isinstance(granularity, tao_granularity.PerBlock) else granularity
        spec = qstats.QuantSpec.from_torchao(float8_dtype, granularity=granularity, scale_dtype=scale_dtype,
                                             input_dtype=input_dtype)
        scale = qp_lib._choose_scale_float8(x, list(block_size), float8_dtype, scale_dtype)
        qp = _observe(spec, x)
        assert torch.equal(qp.scale.reshape(scale.shape), scale)
        codes = qp_lib._quantize_affine_float8(x, scale, float8_dtype)
        ours = qstats.quantize(x, qp, spec)
        assert ours.dtype == float8_dtype and torch.equal(ours.view(torch.uint8), codes.view(torch.uint8))
        values = qp_lib._dequantize_affine_float8(codes, scale, input_dtype)
        assert torch.equal(qstats.fake_quantize(x, qp, spec), values)


def test_fractional_quant_min_max_are_refused():
    # torchao maps onto a fractional range (its scale divides by quant_max - quant_min); qstats
    # used to truncate it with int(), a different scale
    x = INPUTS["random"]
    fractional, _ = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (4, 32), torch.int8, quant_min=-100.5, quant_max=90)
    truncated, _ = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (4, 32), torch.int8, quant_min=-100, quant_max=90)
    assert not torch.equal(fractional, truncated)
    for kwargs in (dict(quant_min=-100.5), dict(quant_max=90.7), dict(quant_min=True), dict(quant_max="7")):
        with pytest.raises(ValueError, match="must be an integer"):
            qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, **kwargs)
    # integral floats are torchao's integer ranges
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, quant_min=-100.0, quant_max=90.0)
    _compare_with_torchao(spec, x, torch.int8, MappingType.ASYMMETRIC, "INT", (4, 32), quant_min=-100.0, quant_max=90.0)


def test_keepdim_only_shapes_torchao_outputs():
    x = INPUTS["outlier"]
    flat = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (1, 8), torch.int8)
    kept = qp_lib.choose_qparams_affine(x, MappingType.ASYMMETRIC, (1, 8), torch.int8, keepdim=True)
    assert all(torch.equal(a.flatten(), b.flatten()) for a, b in zip(flat, kept))
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=qstats.PerGroup(8),
                                         keepdim=True)
    assert spec == qstats.QuantSpec.from_torchao(torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=qstats.PerGroup(8))


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("eps", (1e-3, 0.1, 0.3, 7.0), ids=str)
def test_eps_matches_torchao(eps, input_dtype):
    """torchao clamps the scale at ``eps`` in the input's dtype (eps rounded to it), for every
    mapping, domain and preserve_zero=False."""
    for target in (torch.int4, torch.uint4, torch.int8, torch.uint8):
        for mapping, domain, preserve_zero in AFFINE_CASES:
            if (mapping == MappingType.SYMMETRIC_NO_CLIPPING_ERR and target in UNSIGNED
                    or domain == "FLOAT" and target not in UNSIGNED):
                continue
            for block_size, granularity in GRANULARITIES.values():
                spec = qstats.QuantSpec.from_torchao(
                    target, mapping_type=mapping, zero_point_domain=getattr(ZeroPointDomain, domain), eps=eps,
                    granularity=granularity, input_dtype=input_dtype, **({} if preserve_zero else dict(preserve_zero=False)),
                )
                for name in ("random", "positive", "zeros", "outlier"):
                    x = INPUTS[name].to(input_dtype)
                    _compare_with_torchao(spec, x, target, mapping, domain, block_size, preserve_zero, eps=eps)
