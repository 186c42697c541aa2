"""``qstats.mse``'s ``averaging_constant`` is the moving average's: given with ``mode="accumulate"``
(the default) it raises, naming the mode, where it was ignored in silence; in
``mode="moving_average"`` it is llm-compressor's (default 0.01), as torch.ao's drop-in reads it."""

import pytest
import torch

import qstats
from qstats.torch_ao import QstatsObserver


def test_averaging_constant_in_accumulate_mode_raises_naming_the_mode():
    spec = qstats.QuantSpec(dtype="int8")
    with pytest.raises(ValueError, match="averaging_constant applies to mode='moving_average'"):
        qstats.mse(spec, averaging_constant=0.5)
    with pytest.raises(ValueError, match="averaging_constant applies to mode='moving_average'"):
        qstats.mse(spec, mode="accumulate", averaging_constant=0.01)


def test_moving_average_default_is_llm_compressor_s_and_equals_it_given():
    spec = qstats.QuantSpec(dtype="int8")
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    default, given = qstats.mse(spec, mode="moving_average"), qstats.mse(spec, mode="moving_average",
                                                                          averaging_constant=0.01)
    states = []
    for obs in (default, given):
        state = obs.init(batches[0])
        for batch in batches:
            state = obs.update(state, batch)
        states.append(qstats.compute_qparams(state, spec))
    assert torch.equal(states[0].scale, states[1].scale)
    # independently: a moving average with 0.01 of each batch's searched range, not the latest batch's
    last = qstats.mse(spec, mode="moving_average", averaging_constant=1.0)
    state = last.init(batches[0])
    for batch in batches:
        state = last.update(state, batch)
    assert not torch.equal(qstats.compute_qparams(state, spec).scale, states[0].scale)


def test_torch_ao_drop_in_reads_the_moving_average_constant():
    observer = QstatsObserver(observer=qstats.mse, dtype=torch.quint8, mode="moving_average")
    assert observer.averaging_constant == 0.01
    assert not hasattr(QstatsObserver(observer=qstats.mse, dtype=torch.quint8), "averaging_constant")
