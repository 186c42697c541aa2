"""QuantSpec.from_compressed_tensors against compressed-tensors and llm-compressor, bit for bit.

The reference is the real pipeline: llm-compressor's ``memoryless_minmax`` observer
(``Observer.load_from_registry``) observes the weight in its own dtype and compressed-tensors'
``calculate_qparams`` turns its min/max into scales and zero points (``get_qparams``); then
compressed-tensors' ``fake_quantize`` / ``quantize`` use them. qstats observes the same weight with
``minmax`` and ``memoryless_minmax`` under ``QuantSpec.from_compressed_tensors(args,
observed_dtype=weight.dtype)``. Scales must be equal as values (compressed-tensors keeps them in the
weight's dtype, qstats in float32), zero points equal, fake-quantized weights ``torch.equal``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import qstats

ct_quantization = pytest.importorskip("compressed_tensors.quantization")
ct_forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
llmc_observers = pytest.importorskip("llmcompressor.observers")

QuantizationArgs = ct_quantization.QuantizationArgs
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_FEATURES, IN_FEATURES = 8, 64


def _int_args():
    for num_bits, symmetric, (strategy, group_size) in itertools.product(
        (4, 8), (True, False), (("tensor", None), ("channel", None), ("group", 16), ("group", 32))
    ):
        yield dict(num_bits=num_bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)


def _float_args():
    for symmetric, strategy in itertools.product((True, False), ("tensor", "channel")):
        yield dict(num_bits=8, type="float", symmetric=symmetric, strategy=strategy)


ARGS = [*_int_args(), *_float_args()]


def _args_id(kwargs):
    group = f"-g{kwargs['group_size']}" if kwargs.get("group_size") else ""
    sym = "sym" if kwargs["symmetric"] else "asym"
    return f"{kwargs['type']}{kwargs['num_bits']}-{kwargs['strategy']}{group}-{sym}"


def _weights(dtype):
    """Named weights (OUT_FEATURES, IN_FEATURES): random normal at several scales and edge cases."""
    g = torch.Generator().manual_seed(0)
    shape = (OUT_FEATURES, IN_FEATURES)

    def randn(scale, shift=0.0):
        return torch.randn(shape, generator=g) * scale + shift

    mixed = randn(0.05)
    mixed[0] = 0.0  # an all-zero row (channel) and group
    mixed[1] = 0.02  # a constant row
    mixed[2] = -mixed[2].abs() - 1e-3  # a negative row
    mixed[3] = mixed[3].abs() + 1e-3  # a positive row
    mixed[4, :16] = 0.0  # one all-zero group
    weights = {
        "normal-0.02": randn(0.02),
        "normal-1": randn(1.0, 0.1),
        "normal-100": randn(100.0),
        "zeros": torch.zeros(shape),
        "constant": torch.full(shape, 0.75),
        "negative": -randn(0.1).abs() - 1e-4,
        "positive": randn(0.1).abs() + 1e-4,
        "mixed-rows": mixed,
        "tiny": randn(1e-6) if dtype == torch.float16 else randn(1e-30),
    }
    if dtype != torch.float16:  # float16 overflows at 65504
        weights["wide"] = randn(1.0) * torch.logspace(-30, 30, OUT_FEATURES * IN_FEATURES).reshape(shape)
    return {name: w.to(dtype) for name, w in weights.items()}


pytestmark = pytest.mark.usefixtures("single_thread_quiet")


def _reference_qparams(args, weight):
    observer = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    qparams = observer.get_qparams()
    return qparams["scale"], qparams["zero_point"]


def _ours(observer_factory, spec, weight):
    obs = observer_factory(spec)
    return qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)


def _assert_qparams_equal(scale, zero_point, qp, weight, context):
    assert scale.dtype == weight.dtype, f"compressed-tensors keeps the weight dtype: {context}"
    shape = qp.scale.shape
    assert scale.numel() == qp.scale.numel(), f"{tuple(scale.shape)} vs {tuple(shape)}: {context}"
    ours_scale = qp.scale
    theirs_scale = scale.float().reshape(shape)
    assert torch.equal(ours_scale, theirs_scale), (
        f"scale differs for {context}: compressed-tensors {theirs_scale.flatten()[:4].tolist()} "
        f"qstats {ours_scale.flatten()[:4].tolist()}"
    )
    # the qstats scale holds values of the weight's dtype
    assert torch.equal(ours_scale.to(weight.dtype).float(), ours_scale)
    theirs_zero_point = zero_point.float().reshape(shape)
    ours_zero_point = qp.zero_point.float()
    # documented deviation: an all-zero asymmetric float8 range gets a NaN zero point from
    # compressed-tensors (0 / 0), 0 from qstats
    nan = torch.isnan(theirs_zero_point)
    assert not nan.any() or zero_point.dtype == torch.float8_e4m3fn, context
    theirs_zero_point = torch.where(nan, torch.zeros_like(theirs_zero_point), theirs_zero_point)
    assert not torch.isnan(ours_zero_point).any()
    assert torch.equal(ours_zero_point, theirs_zero_point), (
        f"zero point differs for {context}: compressed-tensors {theirs_zero_point.flatten()[:4].tolist()} "
        f"qstats {ours_zero_point.flatten()[:4].tolist()}"
    )


def _assert_quantization_equal(args, spec, scale, zero_point, qp, weight, context):
    zp = None if args.symmetric else zero_point  # llm-compressor registers no zero point when symmetric
    theirs = ct_forward.fake_quantize(weight, scale, zp, args)
    ours = qstats.fake_quantize(weight, qp, spec)
    assert ours.dtype == weight.dtype
    theirs = theirs.to(weight.dtype)  # tensor/channel strategies return the promoted dtype
    assert torch.isfinite(ours).all(), context
    # compressed-tensors' NaN zero point (see above) makes its whole all-zero range NaN
    theirs = torch.where(torch.isnan(theirs) & (weight == 0), torch.zeros_like(theirs), theirs)
    mismatch = ours != theirs
    assert not mismatch.any(), (
        f"fake_quantize differs for {context} at {int(mismatch.sum())} values, e.g. w={weight[mismatch][:4].tolist()}: "
        f"compressed-tensors {theirs[mismatch][:4].tolist()} qstats {ours[mismatch][:4].tolist()}"
    )
    theirs_codes = ct_forward.quantize(weight, scale, zp, args).float()
    theirs_codes = torch.where(torch.isnan(theirs_codes) & (weight == 0), torch.zeros_like(theirs_codes), theirs_codes)
    ours_codes = qstats.quantize(weight, qp, spec)
    assert torch.equal(ours_codes.float(), theirs_codes.float()), f"quantize differs for {context}"
    assert torch.equal(qstats.dequantize(ours_codes, qp, spec, dtype=weight.dtype), ours), context


@pytest.mark.parametrize("kwargs", ARGS, ids=_args_id)
def test_qparams_and_fake_quantize_match(kwargs):
    count = 0
    for dtype in WEIGHT_DTYPES:
        for name, weight in _weights(dtype).items():
            context = f"{_args_id(kwargs)} weight {name} {dtype}"
            args = QuantizationArgs(**kwargs)
            scale, zero_point = _reference_qparams(args, weight)
            spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=weight.dtype)
            for factory in (qstats.memoryless_minmax, qstats.minmax):
                qp = _ours(factory, spec, weight)
                _assert_qparams_equal(scale, zero_point, qp, weight, f"{context} {factory.__name__}")
            _assert_quantization_equal(args, spec, scale, zero_point, qp, weight, context)
            count += 1
    assert count >= 28
    print(f"{_args_id(kwargs)}: {count} weights x dtypes, each through 2 qstats observers")
