"""Granularities take numpy integers (``np.int64(128)``, a size read from an array or a config) as the
Python ints they hold, as `QuantSpec` takes its ranges: ``PerGroup(np.int64(128))`` raised "must be
a positive int". The spec built with them equals (and hashes as) the one built with ints, and its
group qparams are compressed-tensors' own."""

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams

import qstats


@pytest.mark.parametrize("make, plain", [
    (lambda: qstats.PerGroup(np.int64(32)), qstats.PerGroup(32)),
    (lambda: qstats.TensorGroup(np.int32(16)), qstats.TensorGroup(16)),
    (lambda: qstats.PerAxis(np.int64(0)), qstats.PerAxis(0)),
    (lambda: qstats.PerHead(np.int8(1)), qstats.PerHead(1)),
    (lambda: qstats.PerRow(np.int64(-1)), qstats.PerRow(-1)),
    (lambda: qstats.PerBlock((np.int64(2), np.int32(16))), qstats.PerBlock((2, 16))),
    (lambda: qstats.PerBlock([np.int64(2), 16], partial=True), qstats.PerBlock((2, 16), partial=True)),
])
def test_numpy_integers_give_the_granularity_built_with_ints(make, plain):
    granularity = make()
    assert granularity == plain and hash(granularity) == hash(plain)
    for value in vars(granularity).values():
        assert not isinstance(value, np.generic)
        assert not any(isinstance(v, np.generic) for v in (value if isinstance(value, tuple) else ()))


@pytest.mark.parametrize("bad", [np.int64(0), np.float64(32.0), np.bool_(True), True])
def test_numpy_non_integers_and_non_positive_sizes_are_still_refused(bad):
    with pytest.raises(ValueError, match="group_size"):
        qstats.PerGroup(bad)


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_qparams_with_a_numpy_group_size_equal_compressed_tensors(symmetric):
    torch.manual_seed(0)
    weight = torch.randn(8, 96)
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=32)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    numpy_spec = qstats.QuantSpec(**{**vars(spec), "granularity": qstats.PerGroup(np.int64(32))})
    assert numpy_spec == spec
    observer = qstats.minmax(numpy_spec)
    qp = qstats.compute_qparams(observer.update(observer.init(weight), weight), numpy_spec)
    groups = weight.reshape(8, 3, 32)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    assert torch.equal(qp.scale, scale) and torch.equal(qp.zero_point.to(zero_point.dtype), zero_point)
