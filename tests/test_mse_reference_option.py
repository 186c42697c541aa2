"""qstats.mse's ``reference`` option: a reversed or infinite range is refused, naming the reference."""

import pytest
import torch

import qstats

SPEC = qstats.QuantSpec(dtype="int8")


@pytest.mark.parametrize("reference", [
    (1.0, -1.0),                                             # reversed: the batch's range replaced it in silence
    (-float("inf"), float("inf")),                           # compute_qparams said the data was not finite
    (-float("inf"), 1.0),
    (torch.tensor(-1e300, dtype=torch.float64), torch.tensor(1.0)),  # past float32's range: -inf
], ids=["reversed", "infinite", "one-infinite-end", "float64-past-float32"])
def test_a_reversed_or_infinite_reference_raises_naming_it(reference):
    x = torch.randn(64)
    with pytest.raises(ValueError, match="reference range is reversed .* or infinite"):
        obs = qstats.mse(SPEC, reference=reference)
        qstats.compute_qparams(obs.update(obs.init(x), x), SPEC)


def test_an_unobserved_min_max_entry_is_set_by_the_first_batch():
    """A MinMaxState reference whose channel saw no data (+inf/-inf) searches that channel from its
    first batch's range, as without a reference; the observed channel keeps the given range."""
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    w = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    minmax = qstats.minmax(spec)
    seen = minmax.update(minmax.init(w), w * 3, torch.tensor([[1.0], [0.0]]).expand(2, 32))
    obs = qstats.mse(spec, reference=seen)
    state = obs.update(obs.init(w), w)
    assert torch.equal(state.min_val, torch.stack([seen.min_val[0], w[1].min()]))
    assert torch.equal(state.max_val, torch.stack([seen.max_val[0], w[1].max()]))


def test_a_reference_given_to_the_moving_average_raises_naming_the_mode():
    """llm-compressor's mse searches each batch's own range: the moving average has no reference
    (one given to it was ignored, and the search ran on each batch's range)."""
    reference = (torch.tensor(-10.0), torch.tensor(10.0))
    with pytest.raises(ValueError, match="reference applies to mode='accumulate'"):
        qstats.mse(SPEC, mode="moving_average", reference=reference)
