"""check_homomorphism's ``splits``: cut points outside the batches were dropped in silence, so a split
of three batches at 7 compared the merge of one fold with that fold, and passed a merge that halves the
maxima, which the split at 1 fails; ``splits=[1]`` (for ``[[1]]``) failed as "'int' object is not
iterable". Both are refused naming the split."""

import pytest
import torch

import qstats
from qstats import testing

MINMAX = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))


def _halves_the_maxima():
    def merge(a, b):
        merged = MINMAX.merge(a, b)
        both = torch.isfinite(a.max_val) & torch.isfinite(b.max_val)
        return merged._replace(max_val=torch.where(both, (a.max_val + b.max_val) / 2, merged.max_val))

    return MINMAX._replace(merge=merge, name="halves")


def _batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=generator) for _ in range(3)]


def test_the_broken_merge_fails_a_split_inside_the_batches():
    xs = _batches()
    # the law, by hand: the merge of the folds of xs[:1] and xs[1:] is not the fold of all three
    init = MINMAX.init(xs[0])
    folds = [MINMAX.update(init, xs[0]), MINMAX.update(MINMAX.update(init, xs[1]), xs[2])]
    sequential = MINMAX.update(MINMAX.update(MINMAX.update(init, xs[0]), xs[1]), xs[2])
    assert not torch.equal(_halves_the_maxima().merge(*folds).max_val, sequential.max_val)
    with pytest.raises(AssertionError, match=r"halves: homomorphism \(merge of per-group states for split \[1\]"):
        testing.check_homomorphism(_halves_the_maxima(), xs, [[1]])


@pytest.mark.parametrize("cuts", [[7], [0], [3], [-1], [1.5], [True]])
def test_a_cut_outside_the_batches_is_refused(cuts):
    with pytest.raises(ValueError, match=r"cut points must be ints from 1 to 2 \(between the 3 batches\)"):
        testing.check_homomorphism(_halves_the_maxima(), _batches(), [cuts])


def test_a_split_that_is_no_list_of_cuts_is_refused():
    with pytest.raises(TypeError, match=r"splits is a list of cut-point lists \(\[\[1\], \[1, 2\]\]\), got the split 1"):
        testing.check_homomorphism(MINMAX, _batches(), [1])
