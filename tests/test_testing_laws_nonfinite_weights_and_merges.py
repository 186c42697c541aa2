"""qstats.testing against observers that mishandle non-finite values, mask dtypes, attention masks
over tokens and merges of two seen states; and correct observers (raise policy, 3-D batches at every
granularity) that the added checks must pass."""

from typing import NamedTuple, Optional

import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit

XS = [torch.randn(6, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
XS3 = [torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _make_x(generator):
    return torch.randn(6, 8, generator=generator)


def _make_x3(generator):
    return torch.randn(4, 3, 8, generator=generator)


@kit.register_state
class LawsSquareSumState(NamedTuple):
    approx_fields = ("square_total",)
    square_total: torch.Tensor
    count: torch.Tensor


@kit.register_range_rule(LawsSquareSumState)
def _square_sum_rule(state, spec):
    rms = (state.square_total / state.count.clamp(min=1)).sqrt().float()
    return kit.Range(-4 * rms, 4 * rms, state.count)


def _square_sum(spec, finite_only: bool = True):
    """docs/write_an_observer.md's root-mean-square observer; ``finite_only=False`` forgets to
    leave NaN/Inf out (one NaN activation makes the scale NaN)."""

    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return LawsSquareSumState(torch.zeros(shape, dtype=torch.float64, device=x.device),
                                  torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight: Optional[torch.Tensor] = None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, spec.granularity, state.count.shape, "square_sum.update").double()
        keep = torch.isfinite(view) if finite_only else torch.ones_like(view, dtype=torch.bool)
        mask = kit.weight_view(x, weight, spec.granularity)
        if mask is not None:
            keep = keep & (mask != 0)
        squares = torch.where(keep, view * view, 0.0)
        return LawsSquareSumState(state.square_total + squares.sum(dim=(0, -1)), state.count + keep.sum(dim=(0, -1)))

    def merge_fn(a, b):
        return LawsSquareSumState(a.square_total + b.square_total, a.count + b.count)

    name = "square_sum" if finite_only else "square_sum(nan kept)"
    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, spec=spec, name=name)


def test_the_dirty_batch_of_the_stability_law_spoils_a_plain_square_sum():
    """An independent check that NaN reaches a sum that does not leave it out."""
    broken = _square_sum(qstats.QuantSpec(), finite_only=False)
    dirty = XS[0].clone()
    dirty.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert torch.isnan(broken.update(broken.init(dirty), dirty).square_total)


def test_stability_catches_an_update_that_lets_nan_into_its_state():
    broken = _square_sum(qstats.QuantSpec(granularity=qstats.PerAxis(0)), finite_only=False)
    with pytest.raises(AssertionError, match=r"square_sum\(nan kept\): stability: .*NaN and ±inf.*state.square_total"):
        testing.check_stability(broken, XS)
    with pytest.raises(AssertionError, match="stability: .*NaN and ±inf"):
        testing.check_all(broken, _make_x, laws="stability", max_examples=2)


def test_check_all_feeds_non_finite_values_to_every_law():
    """A merge that keeps only its first state's count of NaN/Inf values: no finite batch shows it."""
    obs = qstats.minmax(qstats.QuantSpec())
    broken = obs._replace(merge=lambda a, b: obs.merge(a, b)._replace(nonfinite=a.nonfinite), name="drops_nonfinite")
    testing.check_identity(broken, XS)  # finite batches: every count of NaN/Inf is zero
    with pytest.raises(AssertionError, match=r"drops_nonfinite: identity merge\(init, s\): state.nonfinite"):
        testing.check_all(broken, _make_x, laws="identity", max_examples=10)


def test_an_observer_that_refuses_non_finite_values_passes_every_law():
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0), nonfinite="raise"))
    dirty = XS[0].clone()
    dirty[0, 0] = float("nan")
    with pytest.raises(Exception):  # the policy the laws must accept
        obs.update(obs.init(dirty), dirty)
    testing.check_all(obs, _make_x, max_examples=3)


def test_stability_catches_an_update_that_ignores_a_bool_mask():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        return obs.update(state, x, None if weight is not None and weight.dtype == torch.bool else weight)

    broken = obs._replace(update=update, name="float_masks_only")
    # an independent check that the bool mask then observes the rows it leaves out
    mask = (torch.arange(6) % 2 == 0)
    assert float(broken.update(broken.init(XS[1]), XS[1], mask).max_val) == float(XS[1].max())
    assert float(broken.update(broken.init(XS[1]), XS[1], mask.float()).max_val) == float(XS[1][mask].max())
    with pytest.raises(AssertionError, match="float_masks_only: stability: update with a torch.bool weight.*count"):
        testing.check_stability(broken, XS)


def test_stability_catches_an_update_that_ignores_the_weight_of_half_precision_batches():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        return obs.update(state, x, weight if x.dtype == torch.float32 else None)

    broken = obs._replace(update=update, name="float32_masks_only")
    with pytest.raises(AssertionError, match=r"float32_masks_only: stability: update\(init, x, weight=0\) of a "
                                             r"torch.bfloat16 x changed init"):
        testing.check_stability(broken, XS)


def _first_token_masks(obs):
    """An update that reads a ``[batch, tokens]`` mask by its first token only (a row mask)."""

    def update(state, x, weight=None):
        if weight is not None and weight.ndim > 1:
            weight = weight[:, :1].expand(weight.shape)
        return obs.update(state, x, weight)

    return obs._replace(update=update, name="first_token_masks")


def test_homomorphism_catches_an_update_that_reads_an_attention_mask_by_its_first_token():
    broken = _first_token_masks(qstats.minmax(qstats.QuantSpec()))
    # an independent check: leaving out token 0 of every row leaves out every row
    weight = torch.ones(4, 3)
    weight[:, 0] = 0
    assert torch.isinf(broken.update(broken.init(XS3[0]), XS3[0], weight).max_val)
    with pytest.raises(AssertionError, match=r"first_token_masks: homomorphism update\(s, x, w\) == update\(s, x\[:, 1:\]\)"
                                             r".*leaves out token 0.*state.min_val"):
        testing.check_homomorphism(broken, XS3)
    with pytest.raises(AssertionError, match="first_token_masks: homomorphism"):
        testing.check_all(broken, _make_x3, laws="homomorphism", max_examples=3)


GRANULARITIES_3D = [qstats.PerTensor(), qstats.PerAxis(-1), qstats.PerAxis(1), qstats.PerAxis(0), qstats.PerGroup(4),
                    qstats.PerToken()]


@pytest.mark.parametrize("granularity", GRANULARITIES_3D, ids=str)
@pytest.mark.parametrize("factory", [qstats.minmax, qstats.moments, _square_sum], ids=["minmax", "moments", "square_sum"])
def test_correct_observers_pass_every_law_on_3d_batches(factory, granularity):
    testing.check_all(factory(qstats.QuantSpec(granularity=granularity)), _make_x3, max_examples=2)


@pytest.mark.parametrize("factory", [qstats.hessian, qstats.imatrix], ids=["hessian", "imatrix"])
def test_activation_observers_pass_the_token_weight_forms(factory):
    testing.check_homomorphism(factory(), XS3)


def test_stability_catches_a_merge_that_changes_a_dtype_only_when_both_states_have_seen_data():
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))

    def merge(a, b):
        merged = obs.merge(a, b)
        both = bool((a.count.sum() > 0) & (b.count.sum() > 0))
        return merged._replace(count=merged.count.to(torch.int32)) if both else merged

    broken = obs._replace(merge=merge, name="int32_merge")
    with pytest.raises(AssertionError, match=r"int32_merge: stability: merge\(s, t\) of two states that have seen "
                                             r"data changed the state: .*state.count.*int32"):
        testing.check_stability(broken, XS)


def test_stability_catches_an_update_that_fails_on_an_empty_batch_with_its_weight():
    obs = qstats.minmax(qstats.QuantSpec())

    def update(state, x, weight=None):
        if weight is not None:  # one weight per row, as a column: view(0, -1) of no row raises
            weight = weight.view(x.shape[0], -1)[:, 0]
        return obs.update(state, x, weight)

    broken = obs._replace(update=update, name="row_weight_view")
    with pytest.raises(RuntimeError):  # an independent check that the empty case fails
        broken.update(broken.init(XS[0]), XS[0][:0], torch.ones(0))
    testing.check_homomorphism(broken, XS)  # batches with rows: no law sees it
    with pytest.raises(AssertionError, match=r"row_weight_view: stability: update with an empty tensor of shape "
                                             r"\(0, 8\) and weight of shape \(0,\) failed: RuntimeError"):
        testing.check_stability(broken, XS)


@kit.register_state
class LawsSpectrumState(NamedTuple):
    spectrum: torch.Tensor  # complex sum of each row's FFT
    count: torch.Tensor


def _spectrum(dtype):
    def init_fn(x):
        return LawsSpectrumState(torch.zeros(x.shape[-1], dtype=dtype), torch.zeros((), dtype=torch.int64))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        rows = x.reshape(-1, x.shape[-1]).double()
        rows = torch.where(torch.isfinite(rows), rows, 0.0)
        keep = torch.ones(rows.shape[0]) if weight is None else (weight != 0).reshape(-1).double()
        spectrum = (torch.fft.fft(rows) * keep[:, None]).sum(dim=0).to(dtype)
        return LawsSpectrumState(state.spectrum + spectrum, state.count + keep.sum().long())

    def merge_fn(a, b):
        return LawsSpectrumState(a.spectrum + b.spectrum, a.count + b.count)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=False, name=f"spectrum({dtype})")


def test_stability_catches_a_state_field_that_checkpoints_cannot_hold(tmp_path):
    obs = _spectrum(torch.complex128)
    state = obs.update(obs.init(XS[0]), XS[0])
    with pytest.raises(TypeError, match="complex128"):  # an independent check: qstats.save refuses it
        qstats.save(tmp_path / "state.safetensors", {"s": state})
    with pytest.raises(AssertionError, match=r"spectrum\(torch.complex128\): stability: state.spectrum has dtype "
                                             r"torch.complex128, which qstats.save cannot hold"):
        testing.check_stability(obs, XS)
    complex64 = _spectrum(torch.complex64)
    qstats.save(tmp_path / "state64.safetensors", {"s": complex64.update(complex64.init(XS[0]), XS[0])})
    testing.check_stability(complex64, XS)


@kit.register_state
class LawsBucketState(NamedTuple):
    counts: torch.Tensor  # int64 values per bucket of |x| * 4 (the last bucket holds the rest)


def _buckets():
    def init_fn(x):
        return LawsBucketState(torch.zeros(16, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        keep = torch.ones(x.shape[0]) if weight is None else (weight != 0).to(torch.float32)
        index = (x.abs() * 4).long().clamp(max=15)  # NaN and inf cast to a negative index
        rows = keep.reshape((-1,) + (1,) * (x.ndim - 1)).expand(x.shape).long()
        return LawsBucketState(state.counts + torch.bincount(index.flatten(), rows.flatten(), minlength=16).long())

    def merge_fn(a, b):
        return LawsBucketState(a.counts + b.counts)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=True, name="buckets")


def test_stability_catches_an_update_that_crashes_on_non_finite_values():
    """A refusal is a ValueError naming the problem, not whatever error the update runs into."""
    obs = _buckets()
    dirty = XS[0].clone()
    dirty[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="bincount"):  # an independent check that the update crashes
        obs.update(obs.init(dirty), dirty)
    with pytest.raises(AssertionError, match="buckets: stability: update with a batch holding NaN and ±inf failed: "
                                             "RuntimeError.*refuse them with a ValueError"):
        testing.check_stability(obs, XS)


def test_stability_catches_squares_taken_in_float16():
    """Squares of a float16 batch taken in float16 overflow past 256 (an autocast model's activations)."""

    def update(state, x, weight=None):
        if x.numel() == 0:
            return state
        view = kit.checked_view(x, qstats.PerAxis(0), state.count.shape, "half_squares.update")
        squares = torch.where(torch.isfinite(view), view * view, 0).sum(dim=(0, -1)).double()  # in x's dtype
        return LawsSquareSumState(state.square_total + squares, state.count + torch.isfinite(view).sum(dim=(0, -1)))

    correct = _square_sum(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    broken = correct._replace(update=update, name="half_squares")
    xs = [x * 256 for x in XS]
    assert torch.isinf(broken.update(broken.init(xs[0]), xs[0].half()).square_total).any()  # independent check
    testing.check_stability(correct, xs)
    with pytest.raises(AssertionError, match=r"half_squares: stability: update with a torch.float16 tensor put \d+ "
                                             r"non-finite value\(s\) into state.square_total"):
        testing.check_stability(broken, xs)
