"""qstats.observers.kit's reductions against plain torch: `observe_extremes` (its row-first path under a
row weight and its plain path), `weight_view` and `batch_weighted_mean`, on odd shapes, 0 rows, half
and double inputs, float/bool/int64 weights and all-NaN/Inf inputs."""

import pytest
import torch

import qstats
from qstats.observers import kit


def _reduced_dims(ndim: int, granularity):
    """The dims of ``x`` a granularity reduces over (its parameters along the others)."""
    if isinstance(granularity, qstats.PerTensor):
        return tuple(range(ndim))
    axis = granularity.axis % ndim
    return tuple(d for d in range(ndim) if d != axis)


def _plain_extremes(x: torch.Tensor, weight, granularity):
    """min, max, finite count and non-finite count of the kept values per parameter, in float64."""
    keep = torch.ones(x.shape, dtype=torch.bool)
    if weight is not None:
        keep = (weight != 0).reshape(tuple(weight.shape) + (1,) * (x.ndim - weight.ndim)).expand(x.shape)
    values = x.double()
    finite = torch.isfinite(values) & keep
    dims = _reduced_dims(x.ndim, granularity)
    return (torch.where(finite, values, torch.inf).amin(dim=dims) if x.numel() else None,
            torch.where(finite, values, -torch.inf).amax(dim=dims) if x.numel() else None,
            finite.sum(dim=dims), (~torch.isfinite(values) & keep).sum(dim=dims))


SHAPES = [((5, 3), qstats.PerTensor()), ((5, 3), qstats.PerAxis(-1)), ((5, 3), qstats.PerAxis(0)),
          ((1, 7), qstats.PerAxis(-1)), ((2, 3, 7), qstats.PerAxis(-1)), ((2, 3, 7), qstats.PerAxis(1)),
          ((2, 3, 7), qstats.PerTensor()), ((0, 7), qstats.PerAxis(-1)), ((0, 7), qstats.PerTensor())]


def _batch(shape, dtype, values):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    if values == "some non-finite" and x.numel() > 2:
        x.view(-1)[0], x.view(-1)[2] = float("nan"), float("inf")
    if values == "all NaN":
        x.fill_(float("nan"))
    if values == "all -inf":
        x.fill_(-float("inf"))
    return x


def _weights(shape):
    rows = torch.arange(shape[0]) % 2 == 0
    weights = {"none": None, "float": rows.float(), "bool": rows, "int64": rows.long()}
    if len(shape) >= 3:
        weights["tokens"] = (torch.arange(shape[0] * shape[1]).reshape(shape[:2]) % 3 != 0).float()
    return weights


@pytest.mark.parametrize("values", ["finite", "some non-finite", "all NaN", "all -inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape,granularity", SHAPES, ids=[f"{s}-{g}" for s, g in SHAPES])
def test_observe_extremes_equals_plain_torch(shape, granularity, dtype, values):
    x = _batch(shape, dtype, values)
    spec = qstats.QuantSpec(granularity=granularity)
    for label, weight in _weights(shape).items():
        got = kit.observe_extremes(x, weight, spec, kit.qparam_shape(x.shape, granularity), "test")
        expected = _plain_extremes(x, weight, granularity)
        assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int64, torch.int64], label
        for name, actual, plain in zip(("min", "max", "count", "nonfinite"), got, expected):
            if plain is None:  # no value: the count fields still say zero
                continue
            assert actual.shape == plain.shape, (label, name)
            assert torch.equal(actual.double(), plain.double()), (label, name, actual, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_batch_weighted_mean_equals_the_float64_weighted_mean(dtype):
    generator = torch.Generator().manual_seed(0)
    u, v = torch.randn(64, generator=generator, dtype=torch.float64), torch.randn(64, generator=generator,
                                                                                  dtype=torch.float64)
    u_batches = torch.randint(0, 5, (64,), generator=generator)
    v_batches = torch.randint(0, 5, (64,), generator=generator)
    got = kit.batch_weighted_mean(u.to(dtype), v.to(dtype), u_batches, v_batches)
    u, v = u.to(dtype).double(), v.to(dtype).double()
    total = (u_batches + v_batches).double()
    mean = torch.where(total > 0, (u * u_batches + v * v_batches) / total.clamp(min=1), u)
    expected = torch.where(u_batches == 0, v, torch.where(v_batches == 0, u, mean))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=4 * torch.finfo(dtype).eps, atol=0)
    assert torch.equal(got[u_batches == 0], v.to(dtype)[u_batches == 0])  # one side empty: the other as it is


@pytest.mark.parametrize("shape,granularity", SHAPES[:7], ids=[f"{s}-{g}" for s, g in SHAPES[:7]])
def test_weight_view_keeps_what_the_weight_keeps(shape, granularity):
    x = torch.randn(shape)
    for label, weight in _weights(shape).items():
        if weight is None:
            continue
        full = (weight != 0).reshape(tuple(weight.shape) + (1,) * (x.ndim - weight.ndim)).expand(x.shape)
        view = kit.weight_view(x, weight, granularity) != 0
        # the kept values of the view are those of x under the weight, parameter by parameter
        dims = _reduced_dims(x.ndim, granularity)
        kept_view = torch.where(view, kit.canonical_view(x, granularity), 0).sum(dim=(0, -1))
        kept_plain = torch.where(full, x, 0).double().sum(dim=dims)
        torch.testing.assert_close(kept_view.double().reshape(kept_plain.shape), kept_plain, rtol=1e-5, atol=1e-5)
        assert int(view.sum()) == int(full.sum()), label
