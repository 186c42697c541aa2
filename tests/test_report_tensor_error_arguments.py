"""`qstats.reporting.tensor_error` refuses what it cannot measure with a TypeError naming itself and
the argument: a numpy array or integer tensor for ``x``, anything but a QuantSpec for ``spec``, and
anything but QParams for ``qparams`` (a numpy ``x`` or a None spec raised AttributeError from inside
qstats); a float tensor is measured as `qstats.fake_quantize` computes it."""

import numpy as np
import pytest
import torch

import qstats
from qstats.reporting import tensor_error


def _setup():
    spec = qstats.QuantSpec(dtype="int8")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    observer = qstats.minmax(spec)
    state = observer.update(observer.init(x), x)
    return x, state, qstats.compute_qparams(state, spec), spec


@pytest.mark.parametrize("argument", ["numpy", "int", "bool"])
def test_x_that_is_not_a_floating_point_tensor_is_refused_by_name(argument):
    x, _, qp, spec = _setup()
    bad = {"numpy": x.numpy(), "int": x.int(), "bool": x > 0}[argument]
    with pytest.raises(TypeError, match="tensor_error: x must be a floating-point tensor"):
        tensor_error(bad, qp, spec)


@pytest.mark.parametrize("spec", [None, {"num_bits": 8}, "int8"])
def test_a_spec_that_is_not_a_quantspec_is_refused_by_name(spec):
    x, _, qp, _ = _setup()
    with pytest.raises(TypeError, match="tensor_error: spec must be a QuantSpec"):
        tensor_error(x, qp, spec)


def test_qparams_that_are_not_qparams_are_refused_by_name():
    x, state, _, spec = _setup()
    for bad in (None, state):
        with pytest.raises(TypeError, match="tensor_error: qparams must be QParams"):
            tensor_error(x, bad, spec)


def test_a_float_tensor_is_measured_as_fake_quantize_computes_it():
    x, _, qp, spec = _setup()
    signal, noise, clipped, total, nonfinite = tensor_error(x, qp, spec)
    values = x.double().numpy()
    error = values - qstats.fake_quantize(x, qp, spec).double().numpy()
    assert signal == pytest.approx(np.sum(values**2), rel=1e-6)
    assert noise == pytest.approx(np.sum(error**2), rel=1e-5)
    assert (total, nonfinite) == (x.numel(), 0)
