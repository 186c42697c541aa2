"""Stacked experts against references: per-expert NVFP4 global scales (each expert's gate and up
fused, as llm-compressor fuses a linearized expert's gate_proj/up_proj) against compressed-tensors'
own ``generate_gparam``/``calculate_qparams`` expert by expert; the expert of a slice of a stack whose
experts share one memory (stride 0); strict tree checks on non-tensor leaves (numpy arrays, NaN)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import qstats
from qstats import tree

from _shared import ExpertsLayer, TiedExperts

E = 4


def _nvfp4():
    compressed = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = compressed.QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                       group_size=16, scale_dtype=torch.float8_e4m3fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = qstats.QuantSpec.from_compressed_tensors(args)
    return args, spec, calculate_qparams, generate_gparam


def _stacks():
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(E, 8, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0, 0.2]).view(E, 1, 1)
    up = torch.randn(E, 8, 64, generator=g) * torch.tensor([2.0, 0.5, 1.0, 0.2]).view(E, 1, 1)
    return gate, up


def test_stacked_qparams_take_one_global_scale_per_expert():
    # global_scale [E] used to fail with "RuntimeError: shape '[]' is invalid for input of size 4"
    args, spec, calculate_qparams, generate_gparam = _nvfp4()
    gate, up = _stacks()
    observer = qstats.stacked_observer(qstats.minmax(spec), E)
    gate_state, up_state = (observer.update(observer.init(w), w) for w in (gate, up))
    shared = torch.vmap(lambda a, b: qstats.fused_global_scale([a, b], spec))(gate_state, up_state)
    assert shared.shape == (E,)
    for global_scale in (shared, shared.reshape(E, 1)):
        qparams = qstats.stacked_qparams(gate_state, spec, global_scale=global_scale)
        for expert in range(E):
            amax = torch.maximum(gate[expert].abs().amax(), up[expert].abs().amax())
            expected_global = generate_gparam(-amax.reshape(1), amax.reshape(1))
            groups = gate[expert].reshape(8, 4, 16)
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=expected_global)
            assert torch.equal(qparams.global_scale[expert].reshape(1), expected_global)
            assert torch.equal(qparams.scale[expert].to(scale.dtype), scale.reshape(qparams.scale[expert].shape))


def test_stacked_qparams_share_a_one_element_global_scale_and_name_other_shapes():
    args, spec, calculate_qparams, generate_gparam = _nvfp4()
    gate, _ = _stacks()
    observer = qstats.stacked_observer(qstats.minmax(spec), E)
    state = observer.update(observer.init(gate), gate)
    amax = gate.abs().amax()
    one = generate_gparam(-amax.reshape(1), amax.reshape(1))
    for global_scale in (one, one.reshape(())):
        qparams = qstats.stacked_qparams(state, spec, global_scale=global_scale)
        for expert in range(E):
            groups = gate[expert].reshape(8, 4, 16)
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=one)
            assert torch.equal(qparams.scale[expert].to(scale.dtype), scale.reshape(qparams.scale[expert].shape))
    for bad in (torch.ones(E + 1), torch.ones(2, E), torch.ones(E, 2)):
        with pytest.raises(ValueError, match=r"stacked_qparams: global_scale of shape .* one per expert \(\[4\]\)"):
            qstats.stacked_qparams(state, spec, global_scale=bad)
    one_expert = type(state)(*(field[0] for field in state))  # compute_qparams takes one value only
    with pytest.raises(ValueError, match=r"compute_qparams: global_scale must be one value .* shape \(4,\)"):
        qstats.compute_qparams(one_expert, spec, global_scale=torch.ones(E))


def _linear_rows(stack, expert):
    x = torch.randn(5, stack.shape[-1])
    with qstats.experts.ExpertInputCapture({"w": stack}) as capture:
        torch.nn.functional.linear(x, stack[expert])
    return capture.captured("w")


def test_capture_of_a_stack_whose_experts_share_one_memory():
    # stride(0) == 0 (an expanded stack) used to raise ZeroDivisionError on every matmul
    base = torch.randn(8, 4)
    assert _linear_rows(base.expand(3, 8, 4), 1) is None  # every expert's slice is the same memory
    rows, ids = _linear_rows(base.expand(1, 8, 4), 0)  # one expert: its slice is known
    assert rows.shape == (5, 4) and ids.tolist() == [0] * 5


def test_calibrate_expanded_experts_names_the_module_or_observes_the_one_expert():
    # three experts sharing one memory: calibrate used to fail with ZeroDivisionError from the capture
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    recipe = qstats.Recipe([qstats.Rule("TiedExperts", sites=("down_proj.input",), spec=qstats.QuantSpec())])
    index, weights = torch.arange(10).remainder(3).reshape(10, 1), torch.ones(10, 1)
    with pytest.raises(ValueError, match=r"'down_proj.input' of the experts module 'experts'"):
        qstats.calibrate(ExpertsLayer(TiedExperts(3)), [(x, index, weights)], recipe, progress=False)
    one = ExpertsLayer(TiedExperts(1))  # against the intermediate computed in plain torch
    states = qstats.calibrate(one, [(x, torch.zeros_like(index), weights)], recipe, progress=False)
    with torch.no_grad():
        rows = one.experts.intermediate(x, 0)
    state = states["experts"]["down_proj.input"]
    assert int(state.count.sum()) == rows.numel()
    assert torch.equal(state.min_val.reshape(()), rows.min()) and torch.equal(state.max_val.reshape(()), rows.max())


def test_assert_same_structure_compares_numpy_and_nan_leaves():
    # numpy leaves used to raise "The truth value of an array ... is ambiguous"; equal NaN leaves mismatched
    tree.assert_same_structure({"a": np.zeros(3), "b": math.nan}, {"a": np.zeros(3), "b": float("nan")})
    with pytest.raises(ValueError, match=r"tree mismatch at tree\['a'\]: ndarray"):
        tree.assert_same_structure({"a": np.zeros(3)}, {"a": np.ones(3)})
    with pytest.raises(ValueError, match=r"tree mismatch at tree\['a'\]: ndarray"):
        tree.assert_same_structure({"a": np.zeros(3)}, {"a": np.zeros(2)})
    with pytest.raises(ValueError, match=r"tree mismatch at tree\['b'\]: float nan vs float 1.0"):
        tree.assert_same_structure({"b": math.nan}, {"b": 1.0})


def test_dispatch_capacity_keeps_each_experts_first_tokens_against_torch_ao():
    # capacity=0 used to keep one token per expert (it was raised to 1); a negative one was taken as 1
    from torch.ao.quantization.observer import MinMaxObserver

    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(9, 6, generator=g)
    mask = (torch.rand(E, 9, generator=g) > 0.4).float()
    mask[1] = 0
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                          on_uncalibrated="fallback")
    stacked = qstats.stacked_observer(qstats.minmax(spec), E)
    for capacity in (0, 2, 9):
        x, weight = qstats.experts.dispatch(tokens, mask, capacity)
        assert x.shape == (E, capacity, 6)
        qparams = qstats.stacked_qparams(stacked.update(stacked.init(x), x, weight), spec)
        for expert in range(E):
            first = tokens[mask[expert] != 0][:capacity]
            assert bool(qparams.calibrated[expert]) == bool(first.numel())
            if first.numel():
                observer = MinMaxObserver(dtype=torch.quint8)
                observer(first)
                scale, zero_point = observer.calculate_qparams()
                assert torch.equal(qparams.scale[expert], scale.reshape(()))
                assert int(qparams.zero_point[expert]) == int(zero_point)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"dispatch: capacity must be an int >= 0"):
            qstats.experts.dispatch(tokens, mask, bad)


def test_dispatch_capacity_takes_numpy_and_tensor_integers_as_the_python_int():
    # a capacity read from a mask (a 0-d int64 tensor) or numpy was refused as "not an int"
    g = torch.Generator().manual_seed(4)
    tokens = torch.randn(9, 6, generator=g)
    mask = (torch.rand(E, 9, generator=g) > 0.4).float()
    for capacity in (np.int64(3), torch.tensor(3), (mask != 0).sum(dim=1).max()):
        x, weight = qstats.experts.dispatch(tokens, mask, capacity)
        kept = int(capacity)
        for expert in range(E):  # each expert's first `kept` routed tokens, gathered by hand
            first = tokens[mask[expert] != 0][:kept]
            assert torch.equal(x[expert][weight[expert] != 0], first)
    for bad in (torch.tensor(2.0), torch.tensor([2]), torch.tensor(True), np.float64(2.0), torch.tensor(-1)):
        with pytest.raises(ValueError, match=r"dispatch: capacity must be an int >= 0"):
            qstats.experts.dispatch(tokens, mask, bad)
