"""The canonical view against llm-compressor's flatten_for_calibration and torch.ao's per-channel
reduction, and the view's inverse."""

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
