"""torch.ao ``PlaceholderObserver`` arguments that the placeholder drop-ins do not take are named in
the error (it said that the float dtype builds no QuantSpec and to use ``observer=placeholder``,
which the call did)."""

import warnings

import pytest
import torch
import torch.ao.quantization as tq

import qstats
from qstats import torch_ao


@pytest.mark.parametrize("observer", [qstats.placeholder, qstats.noop, qstats.recording])
@pytest.mark.parametrize("argument", [dict(custom_op_name="my_op"), dict(compute_dtype=torch.quint8)])
def test_an_argument_the_factory_does_not_take_is_named(observer, argument):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # compute_dtype is deprecated in torch.ao
        tq.PlaceholderObserver(dtype=torch.float16, **argument)  # torch.ao takes it
    with pytest.raises(TypeError, match=next(iter(argument))) as raised:
        torch_ao.QstatsObserver(observer, dtype=torch.float16, **argument)
    assert "builds no QuantSpec" not in str(raised.value)


def test_an_observer_that_needs_a_spec_still_names_the_float_dtype():
    with pytest.raises(TypeError, match="float dtype torch.float16 builds no QuantSpec, and minmax needs one"):
        torch_ao.QstatsObserver(qstats.minmax, dtype=torch.float16)
    with pytest.raises(TypeError, match="builds no QuantSpec, and moving_average_minmax needs one"):
        torch_ao.QstatsObserver(qstats.moving_average_minmax, dtype=torch.float32, averaging_constant=0.5)
