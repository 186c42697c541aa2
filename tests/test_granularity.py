"""The canonical view against llm-compressor's flatten_for_calibration and torch.ao's per-channel
reduction, and the view's inverse."""

import dataclasses

import pytest
import torch

import qstats
from qstats._granularity import from_canonical_view

llm_helpers = pytest.importorskip("llmcompressor.observers.helpers")
QuantizationArgs = pytest.importorskip("compressed_tensors.quantization").QuantizationArgs


def _reduce(view):
    return view.amin(dim=(0, -1)), view.amax(dim=(0, -1))


@pytest.mark.parametrize(
    "args, granularity",
    [
        (dict(strategy="tensor"), qstats.PerTensor()),
        (dict(strategy="channel"), qstats.PerAxis(0)),
        (dict(strategy="group", group_size=4), qstats.PerGroup(4)),
        (dict(strategy="tensor_group", group_size=16, type="float", num_bits=4), qstats.TensorGroup(16)),
        (dict(strategy="block", block_structure=[2, 8]), qstats.PerBlock((2, 8))),
    ],
)
def test_weight_view_reduces_like_llm_compressor(args, granularity):
    weight = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    reference = llm_helpers.flatten_for_calibration(weight, "weight", QuantizationArgs(**args))
    ref_min, ref_max = _reduce(reference)
    ours_min, ours_max = _reduce(qstats.canonical_view(weight, granularity))
    # llm-compressor keeps singleton dims (tensor: (1,), channel: (rows, 1)); same values.
    assert torch.equal(ours_min.reshape(-1), ref_min.reshape(-1))
    assert torch.equal(ours_max.reshape(-1), ref_max.reshape(-1))
    assert ours_min.shape == qstats.qparam_shape(weight.shape, granularity)


def test_channel_view_of_3d_weights_is_per_row():
    """compressed-tensors' ``channel`` strategy on a weight of any rank: one set per row of the
    last dimension (what `from_compressed_tensors` maps it to), not one per leading index."""
    weight = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(0))
    reference = llm_helpers.flatten_for_calibration(weight, "weight", QuantizationArgs(strategy="channel"))
    granularity = qstats.QuantSpec.from_compressed_tensors({"num_bits": 8, "strategy": "channel"}).granularity
    ours_min, ours_max = _reduce(qstats.canonical_view(weight, granularity))
    ref_min, ref_max = _reduce(reference)
    assert ours_min.shape == (3, 6) and ref_min.shape == (3, 6, 1)
    assert torch.equal(ours_min, ref_min.reshape(3, 6)) and torch.equal(ours_max, ref_max.reshape(3, 6))


def test_activation_tensor_view_reduces_like_llm_compressor():
    activation = torch.randn(2, 5, 16)
    reference = llm_helpers.flatten_for_calibration(activation, "input", QuantizationArgs(strategy="tensor"))
    assert torch.equal(_reduce(reference)[0].reshape(()), _reduce(qstats.canonical_view(activation, qstats.PerTensor()))[0])


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_per_axis_matches_torch_ao_channel_reduction(axis):
    x = torch.randn(3, 4, 5)
    # torch.ao PerChannelMinMaxObserver: move the channel axis first, flatten the rest.
    expected = torch.flatten(x.transpose(0, axis % 3), start_dim=1).amin(dim=1)
    assert torch.equal(_reduce(qstats.canonical_view(x, qstats.PerAxis(axis)))[0], expected)


@pytest.mark.parametrize(
    "granularity",
    [
        qstats.PerTensor(),
        qstats.PerAxis(1),
        qstats.PerToken(),
        qstats.PerRow(),
        qstats.PerGroup(4),
        qstats.PerBlock((2, 4)),
        qstats.PerHead(),
    ],
)
def test_view_round_trips(granularity):
    x = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(2, 4, 8)
    view = qstats.canonical_view(x, granularity)
    assert view.shape[1:-1] == qstats.qparam_shape(x.shape, granularity)
    assert torch.equal(from_canonical_view(view, granularity, x.shape), x)


def test_block_view_groups_the_right_elements():
    x = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)
    view = qstats.canonical_view(x, qstats.PerBlock((2, 4)))
    assert torch.equal(view[0, 0, 1], x[0:2, 4:8].reshape(-1))
    assert torch.equal(view[0, 1, 0], x[2:4, 0:4].reshape(-1))


@pytest.mark.parametrize(
    "granularity, shape, needle",
    [
        (qstats.PerGroup(5), (4, 8), "group_size 5 does not divide dimension 8"),
        (qstats.PerBlock((3, 4)), (4, 8), "block rows 3 does not divide dimension 4"),
        (qstats.PerAxis(3), (4, 8), "out of range"),
    ],
)
def test_bad_granularity_for_shape_names_the_problem(granularity, shape, needle):
    with pytest.raises(ValueError, match=needle):
        qstats.qparam_shape(shape, granularity)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dtype="int17"), "dtype"),
        (dict(dtype="float5"), "dtype"),
        (dict(dtype="int08"), "dtype"),  # was accepted as a target unequal to "int8"
        (dict(dtype="int\uff18"), "dtype"),  # a fullwidth digit 8, that a \d pattern and int() read as int8
        (dict(mapping="sym"), "mapping"),
        (dict(zero_point_domain="double"), "zero_point_domain"),
        (dict(quant_min=-3), "quant_min"),
        (dict(quant_min=1, quant_max=5), "quant_min"),
        (dict(quant_min=0, quant_max=0), "quant_min"),
        (dict(eps=0.0), "eps"),
        (dict(granularity="tensor"), "granularity"),
        (dict(dtype="uint8", mapping="narrow"), "mapping"),
        (dict(nonfinite="nan"), "nonfinite"),
        (dict(on_uncalibrated="zero"), "on_uncalibrated"),
        # float targets: a custom range changed the scale but codes were not clipped to it (and e8m0
        # scales ignored it); reduce_range was ignored
        (dict(dtype="fp8_e4m3fn", zero_point_domain="none", quant_min=-10, quant_max=10), "quant_min"),
        (dict(dtype="fp4_e2m1", zero_point_domain="none", quant_min=-3, quant_max=3), "quant_min"),
        (dict(dtype="fp8_e5m2", zero_point_domain="none", reduce_range=True), "reduce_range"),
    ],
)
def test_bad_spec_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        qstats.QuantSpec(**kwargs)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: qstats.PerGroup(0), "group_size"),
        (lambda: qstats.TensorGroup(-16), "group_size"),
        (lambda: qstats.PerGroup(True), "group_size"),
        (lambda: qstats.PerAxis("0"), "axis"),
        (lambda: qstats.PerBlock((0, 4)), "block_shape"),
        (lambda: qstats.PerBlock((8,)), "block_shape"),  # one dimension: PerGroup
        (lambda: qstats.PerBlock((2, 0, 8)), "block_shape"),
        (lambda: qstats.PerRow("1"), "dim"),
    ],
)
def test_bad_granularity_raises_at_construction(make, field):
    """Also when used without a QuantSpec (canonical_view, qparam_shape), where PerGroup(0) used to
    divide by zero."""
    with pytest.raises(ValueError, match=field):
        make()


def test_spec_is_hashable_and_ranges_follow_bits():
    spec = qstats.QuantSpec(dtype="int4", mapping="narrow", granularity=qstats.PerGroup(32))
    assert hash(spec) == hash(qstats.QuantSpec(dtype="int4", mapping="narrow", granularity=qstats.PerGroup(32)))
    assert spec.qrange == (-7, 7)
    for bits in range(1, 17):
        assert qstats.QuantSpec(dtype=f"uint{bits}").qrange == (0, 2**bits - 1)
        assert qstats.QuantSpec(dtype=f"int{bits}").qrange == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


@pytest.mark.parametrize("block", [(3, 3, 2, 2), (2, 2, 4), (1, 3, 2, 4), (6, 1, 4, 8)])
def test_blocks_spanning_leading_dimensions(block):
    """PerBlock of three or more dimensions (torchao's block_size, issue 22, item 14): one set per
    block, against reshaping the tensor into its blocks directly; the view's inverse."""
    x = torch.randn(6, 6, 4, 8, generator=torch.Generator().manual_seed(1))
    granularity = qstats.PerBlock(block)
    lead = x.ndim - len(block)
    split = [n for s, b in zip(x.shape[lead:], block) for n in (s // b, b)]
    blocks = x.reshape(*x.shape[:lead], *split)
    expected = blocks.amax(dim=tuple(lead + 2 * i + 1 for i in range(len(block))))
    view = qstats.canonical_view(x, granularity)
    assert view.shape[1:-1] == qstats.qparam_shape(x.shape, granularity) == expected.shape
    assert torch.equal(view.amax(dim=(0, -1)), expected)
    assert torch.equal(from_canonical_view(view, granularity, x.shape), x)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_per_row_reduces_along_its_dim(dim):
    """PerRow(dim): one set per index of every other dimension (torchao's PerRow(dim))."""
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(2))
    granularity = qstats.PerRow(dim)
    view = qstats.canonical_view(x, granularity)
    assert torch.equal(view.amin(dim=(0, -1)), x.amin(dim=dim))
    assert qstats.qparam_shape(x.shape, granularity) == x.amin(dim=dim).shape
    assert torch.equal(from_canonical_view(view, granularity, x.shape), x)
    with pytest.raises(ValueError, match="PerRow"):
        qstats.qparam_shape((3, 5), qstats.PerRow(2))


PARTIAL_ARGS = [
    dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
    dict(num_bits=8, type="int", symmetric=False, strategy="block", block_structure=[32, 48]),
    dict(num_bits=4, type="int", symmetric=True, strategy="block", block_structure=[16, 16]),
]


def _partial_spec(args, dtype):
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    return dataclasses.replace(spec, granularity=qstats.PerBlock(spec.granularity.block_shape, partial=True))


@pytest.mark.parametrize("fields", PARTIAL_ARGS, ids=["fp8-128", "int8-asym-32x48", "int4-16"])
@pytest.mark.parametrize("shape", [(64, 128), (200, 300), (7, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_partial_blocks_equal_compressed_tensors(fields, shape, dtype):
    """Blocks that do not divide the weight (a 64x128 k_proj under 128x128 blocks; 200x300):
    compressed-tensors pads the edge blocks with zeros (llm-compressor's flatten_for_calibration,
    its fake_quantize), scales ceil(out / rows) x ceil(in / cols). qstats refused them; now the
    scales, fake-quantized values, codes and dequantized values are equal bit for bit."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(**fields)
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    w[-1, -1] = 3.0  # the edge block's maximum, alone in it
    spec = _partial_spec(args, dtype)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    flat = llm_helpers.flatten_for_calibration(w, "weight", args)
    scale, zero_point = calculate_qparams(flat.amin(dim=(0, -1)), flat.amax(dim=(0, -1)), args)
    assert qp.scale.shape == scale.shape == tuple(-(-s // b) for s, b in zip(shape, args.block_structure))
    assert torch.equal(qp.scale, scale.float())
    assert torch.equal(qstats.fake_quantize(w, qp, spec), fake_quantize(w, scale, zero_point, args))
    codes, their_codes = qstats.quantize(w, qp, spec), quantize(w, scale, zero_point, args)
    assert torch.equal(codes.to(their_codes.dtype), their_codes)
    assert torch.equal(qstats.dequantize(codes, qp, spec, dtype=dtype), dequantize(their_codes, scale, zero_point, args, dtype=dtype))


@pytest.mark.parametrize("name", ["memoryless_mse", "memoryless_minmax", "static_minmax"])
def test_partial_block_observers_equal_llm_compressors(name):
    """llm-compressor's observers on a 20x40 weight under 16x16 blocks (edge blocks of 4 rows and
    8 columns, all-positive except where the data is negative): the same scales and zero points."""
    from llmcompressor.observers import Observer

    fields = dict(num_bits=4, type="int", symmetric=False, strategy="block", block_structure=[16, 16])
    args = QuantizationArgs(**fields, observer=name, observer_kwargs={"patience": 10**6} if "mse" in name else {})
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 40, generator=g) * torch.rand(20, 1, generator=g) * 3 + 0.5
    w[-1, -1] = 9.0
    reference = Observer.load_from_registry(name, base_name="weight", args=args)
    reference(w)
    want = reference.get_qparams()
    spec = _partial_spec(args, torch.float32)
    obs = {"memoryless_mse": qstats.mse, "memoryless_minmax": qstats.memoryless_minmax, "static_minmax": qstats.minmax}[name](spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale, want["scale"].float())
    assert torch.equal(qp.zero_point.float(), want["zero_point"].float())


def test_partial_edge_blocks_reduce_over_their_real_values():
    """An edge block's extremes and counts are those of its real values (no padding zero counted):
    against slicing the tensor directly."""
    x = torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) + 1  # all positive: a zero would show
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerBlock((2, 4), partial=True))
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(x), x)
    assert state.min_val.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            block = x[2 * i : 2 * i + 2, 4 * j : 4 * j + 4]
            assert state.min_val[i, j] == block.min() and state.max_val[i, j] == block.max()
            assert state.count[i, j] == block.numel()
    moments = qstats.moments(spec)
    assert torch.equal(moments.update(moments.init(x), x).count.reshape(-1), state.count.reshape(-1))


@pytest.mark.parametrize("make_obs", [qstats.minmax, qstats.memoryless_minmax, qstats.moving_average_minmax, qstats.mse, qstats.moments])
def test_laws_hold_with_partial_blocks(make_obs):
    spec = qstats.QuantSpec(dtype="fp8_e4m3fn", zero_point_domain="none", convention="compressed_tensors",
                            granularity=qstats.PerBlock((2, 4), partial=True))
    obs = make_obs(spec)
    qstats.testing.check_all(obs, lambda g: torch.randn(3, 5, 7, generator=g), max_examples=3,
                             accumulates=make_obs is not qstats.memoryless_minmax)


def test_partial_blocks_round_trip_and_keep_gradients():
    granularity = qstats.PerBlock((3, 5), partial=True)
    x = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(2, 4, 8).requires_grad_()
    view = qstats.canonical_view(x, granularity)
    assert view.shape == (1, 2, 2, 2, 15) and view.shape[1:-1] == qstats.qparam_shape(x.shape, granularity)
    assert torch.equal(from_canonical_view(view, granularity, x.shape), x)
    # the edge block of x[0]: row 3, columns 5:8, padded to 3x5
    assert torch.equal(view[0, 0, 1, 1], torch.tensor([29.0, 30, 31] + [0.0] * 12))
    from_canonical_view(view * 2, granularity, x.shape).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_torchao_block_granularity_keeps_refusing_partial_blocks():
    """torchao asserts that the block divides the tensor (`_choose_scale_float8`); its spec raises a
    ValueError naming the shape, not an edge block of its own."""
    tao_granularity = pytest.importorskip("torchao.quantization.granularity")
    from torchao.quantization.quant_primitives import _choose_scale_float8

    w = torch.randn(64, 128)
    with pytest.raises(AssertionError, match="divisible"):
        _choose_scale_float8(w, [128, 128])
    spec = qstats.QuantSpec.from_torchao(torch.float8_e4m3fn, granularity=tao_granularity.PerBlock((128, 128)))
    obs = qstats.minmax(spec)
    with pytest.raises(ValueError, match=r"block rows 128 does not divide dimension 64 of a tensor of shape \(64, 128\)"):
        obs.update(obs.init(w), w)
    with pytest.raises(ValueError, match="partial=True"):
        qstats.QuantSpec(dtype="int8", granularity=qstats.PerBlock((128, 128), partial=True), convention="torchao")


def test_bad_partial_flag_names_it():
    with pytest.raises(ValueError, match="partial"):
        qstats.PerBlock((2, 2), partial="yes")
