"""qstats.testing: a weight read along the wrong rows fails every observer (order-dependent ones
too), and an update that cannot take the row weight fails with the call the laws make."""

from typing import NamedTuple

import pytest
import torch

import qstats
from qstats import testing
from qstats.observers import kit

SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(-1))
XS = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]


@kit.register_state
class _AbsmaxMeanTestState(NamedTuple):
    approx_fields = ("absmax_total",)

    absmax_total: torch.Tensor  # float64 sum of each batch's absmax per channel
    batches: torch.Tensor  # int64 batches that observed each channel


def _absmax_mean(spec: qstats.QuantSpec) -> kit.Observer:
    """The mean over batches of each batch's absmax: order-independent but not split-exact
    (``exact=False``: a batch cut in two gives two maxima)."""

    def init_fn(x):
        shape = kit.qparam_shape(x.shape, spec.granularity)
        return _AbsmaxMeanTestState(torch.zeros(shape, dtype=torch.float64, device=x.device),
                                    torch.zeros(shape, dtype=torch.int64, device=x.device))

    def update_fn(state, x, weight=None):
        if x.numel() == 0:
            return state
        view, mask = kit.masked_view(x, weight, spec, state.batches.shape, "absmax_mean.update")
        keep = torch.isfinite(view) if mask is None else torch.isfinite(view) & mask
        absmax = torch.where(keep, view.abs().double(), 0.0).amax(dim=(0, -1))
        return _AbsmaxMeanTestState(state.absmax_total + absmax, state.batches + keep.any(-1).any(0).long())

    def merge_fn(a, b):
        return _AbsmaxMeanTestState(a.absmax_total + b.absmax_total, a.batches + b.batches)

    return kit.Observer(init_fn, update_fn, merge_fn, exact=False, spec=spec, name="absmax_mean")


def _make_x(generator):
    return torch.randn(8, 16, generator=generator)


def _make_tokens(generator):
    return torch.randn(3, 5, 16, generator=generator)


def test_absmax_mean_passes_every_law_and_matches_plain_torch():
    obs = _absmax_mean(SPEC)
    testing.check_all(obs, _make_x, max_examples=5)
    testing.check_all(obs, _make_tokens, max_examples=3)
    weight = (torch.arange(8) % 3 != 0).float()
    state = obs.update(obs.update(obs.init(XS[0]), XS[0], weight), XS[1])
    # an independent computation: the kept rows' absmax per channel, then the mean over the two batches
    expected = (XS[0][weight != 0].abs().amax(0).double() + XS[1].abs().amax(0).double()) / 2
    torch.testing.assert_close(state.absmax_total / state.batches, expected, rtol=0, atol=0)


def _flipped_weight(obs):
    """``obs`` reading its row weight upside down (an off-by-one or reversed routing map): every row
    weight of zeros or ones still observes as before, as do bool and int64 ones."""

    def update(state, x, weight=None):
        return obs.update(state, x, None if weight is None else weight.flip(0))

    return obs._replace(update=update, name=f"{obs.name} reading its weight upside down")


@pytest.mark.parametrize("make_obs", [lambda: _absmax_mean(SPEC),
                                      lambda: qstats.moving_average_minmax(SPEC, averaging_constant=0.1)],
                         ids=["absmax_mean", "moving_average_minmax"])
def test_an_order_dependent_observer_reading_its_weight_along_the_wrong_rows_fails(make_obs):
    broken = _flipped_weight(make_obs())
    assert not broken.exact  # the homomorphism law, whose row-mask forms caught this, is skipped
    # the flipped weight is a wrong observation: the kept rows differ from x[w != 0]
    weight = (torch.arange(8) % 2 == 0).float()
    state = broken.update(broken.init(XS[0]), XS[0], weight)
    assert not torch.equal(state[0], broken.update(broken.init(XS[0]), XS[0][weight != 0])[0])
    with pytest.raises(AssertionError, match=r"stability: update\(s, x, w\) vs update\(s, x\[w != 0\]"):
        testing.check_stability(broken, XS)
    with pytest.raises(AssertionError, match="stability"):
        testing.check_all(broken, _make_x, max_examples=5)


def test_a_token_weight_read_along_the_wrong_tokens_fails_an_order_dependent_observer():
    obs = _absmax_mean(SPEC)

    def update(state, x, weight=None):  # a [batch, tokens] weight with its tokens reversed
        return obs.update(state, x, weight if weight is None or weight.ndim < 2 else weight.flip(1))

    tokens = [torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(AssertionError, match=r"update\(s, x\[:, 1:\] \(a weight of shape \(3, 5\) leaving out"):
        testing.check_stability(obs._replace(update=update), tokens)


def test_an_update_without_the_weight_argument_fails_with_the_call_the_laws_make():
    obs = qstats.minmax(SPEC)
    broken = obs._replace(update=lambda state, x: obs.update(state, x))
    # it fails each law with a message naming update and the call it cannot take, not a bare TypeError
    for check in (testing.check_purity, testing.check_stability, testing.check_identity, testing.check_vmap):
        with pytest.raises(AssertionError, match=r"update\(state, x\) cannot be called as update\(state, x, "
                                                 r"weight=None\)"):
            check(broken, XS)
    with pytest.raises(AssertionError, match=r"merge\(a\) cannot be called as merge\(a, b\)"):
        testing.check_identity(obs._replace(merge=lambda a: a), XS)


def test_observers_taking_keyword_options_and_callables_without_signatures_pass():
    obs = qstats.minmax(SPEC)

    def update(state, x, weight=None, *, unused=None):
        return obs.update(state, x, weight)

    testing.check_purity(obs._replace(update=update), XS)
    testing.check_identity(obs._replace(merge=torch.jit.ignore(obs.merge)), XS)


def test_compile_law_compiles_the_weighted_update():
    obs = qstats.minmax(SPEC)

    def update(state, x, weight=None):
        if weight is not None and bool(weight.sum() > 0):  # a host read on the weight breaks the graph
            return obs.update(state, x, weight)
        return obs.update(state, x, weight)

    broken = obs._replace(update=update, name="minmax reading its weight on the host")
    with pytest.raises(AssertionError, match=r"torch.compile\(update, fullgraph=True\) with a weight failed"):
        testing.check_compile(broken, XS[:2], backend="eager")
    testing.check_compile(obs, XS[:2], backend="eager")


def test_a_factory_given_for_its_observer_is_refused_naming_the_call():
    with pytest.raises(TypeError, match=r"expected an Observer .* _absmax_mean is callable: pass the Observer it "
                                        r"returns, _absmax_mean\(spec\)"):
        testing.check_all(_absmax_mean, _make_x, max_examples=1)
    with pytest.raises(TypeError, match="check_identity: expected an Observer"):
        testing.check_identity(_absmax_mean, XS)


def test_batches_that_are_not_a_list_of_tensors_are_refused():
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    # a tensor for xs: its rows, of shape (16,), would be checked as the batches (16 channels, not 8)
    with pytest.raises(TypeError, match=r"check_identity: xs is a list of input batches, got a tensor of shape "
                                        r"\(8, 16\) \(pass \[x\] for one batch\)"):
        testing.check_identity(obs, XS[0])
    with pytest.raises(TypeError, match="got items of type list"):
        testing.check_purity(obs, [XS[0], [XS[1]]])
    with pytest.raises(TypeError, match=r"make_x\(generator\) must return one input batch \(a tensor\), got list"):
        testing.check_all(obs, lambda generator: [_make_x(generator)], max_examples=1)
