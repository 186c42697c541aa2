"""qstats.gptq against llm-compressor 0.14's quantize_weight, case by case, on inputs real
calibrations produce: inputs all zero, zero and constant weight rows and groups, tied Hessian
diagonals under activation ordering (both take torch.argsort's order of ties), one-column weights,
edge blocks of rows and columns, half-precision weights and inputs, tiny and huge activations,
rank-deficient Hessians; and stacked experts that got no token or one token. The quantization
parameters are llm-compressor's weight observer's, compressed-tensors' QuantizationArgs throughout."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import HessianState, gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


def _args(strategy="group", group=32, bits=4, symmetric=True, actorder=None, **more):
    return QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, actorder=actorder,
                            group_size=group if strategy == "group" else None, **more)


def _block(kind, actorder=None):
    return QuantizationArgs(num_bits=8 if kind == "float" else 4, type=kind, symmetric=kind == "float",
                            strategy="block", block_structure=[16, 32], actorder=actorder)


def _tied(x):
    """Features with equal Hessian diagonals: copies, a negated copy, and +-1 features."""
    x = x.clone()
    x[:, 10] = x[:, 30] = x[:, 20]
    x[:, 40] = -x[:, 41]
    x[:, 50:58] = torch.sign(x[:, 50:58])
    return x


def _with(weight, where, value):
    weight = weight.clone()
    weight[where] = value
    return weight


ROWS = (slice(None), slice(0, 32))
CASES = {  # name: (args, weight edit, input edit, shape (out, in), options)
    "inputs all zero": (_args(symmetric=False), None, torch.zeros_like, (32, 64), {}),
    "inputs all zero, actorder": (_args(symmetric=False, actorder="static"), None, torch.zeros_like, (32, 64), {}),
    "a zero output row": (_args(symmetric=False), lambda w: _with(w, 4, 0.0), None, (32, 64), {}),
    "a zero output row, channel": (_args("channel", bits=8), lambda w: _with(w, 4, 0.0), None, (32, 64), {}),
    "a zero group": (_args(symmetric=False), lambda w: _with(w, ROWS, 0.0), None, (32, 64), {}),
    "a constant group": (_args(), lambda w: _with(w, ROWS, 0.03), None, (32, 64), {}),
    "a constant group, asymmetric": (_args(symmetric=False), lambda w: _with(w, ROWS, 0.03), None, (32, 64), {}),
    "a negative constant group": (_args(symmetric=False), lambda w: _with(w, ROWS, -0.03), None, (32, 64), {}),
    "tied diagonals, groups": (_args(group=16, symmetric=False, actorder="static"), None, _tied, (32, 64), {}),
    "tied diagonals, channel": (_args("channel", actorder="static"), None, _tied, (32, 64), {}),
    "one column, channel, actorder": (_args("channel", bits=8, actorder="static"), None, None, (16, 1), {}),
    "one column, tensor": (_args("tensor"), None, None, (16, 1), {}),
    "one column, groups of 1": (_args(group=1), None, None, (16, 1), {}),
    "70 columns, blocks of 32 columns": (_args("channel", bits=8), None, None, (16, 70), {"block_size": 32}),
    "70 columns, one block of 1000": (_args("channel", bits=8), None, None, (16, 70), {"block_size": 1000}),
    "fp8 edge blocks of rows and columns": (_block("float", "static"), None, None, (20, 70), {}),
    "int4 edge blocks of rows and columns": (_block("int"), None, None, (20, 70), {}),
    "bfloat16 weight and inputs": (_args(symmetric=False, actorder="static"), None, None, (32, 64),
                                   {"dtype": torch.bfloat16}),
    "float16 weight and inputs": (_args(actorder="static"), None, None, (32, 64), {"dtype": torch.float16}),
    "inputs of 1e-10": (_args(), None, lambda x: x * 1e-10, (32, 64), {}),
    "inputs of 1e17": (_args(), None, lambda x: x * 1e17, (32, 64), {}),
    "10 rows (rank 10)": (_args(), None, lambda x: x[:10], (32, 64), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_codes_equal_llm_compressor(case):
    args, edit_weight, edit_inputs, (out, columns), options = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    dtype = options.get("dtype", torch.float32)
    weight = torch.randn(out, columns, generator=gen) * 0.05
    x = torch.randn(200, columns, generator=gen) * torch.linspace(0.05, 2.0, columns)
    weight = (weight if edit_weight is None else edit_weight(weight)).to(dtype)
    x = (x if edit_inputs is None else edit_inputs(x)).to(dtype)
    state = hessian().update(hessian().init(x), x)
    observer = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                          args=args.model_copy(deep=True))
    observer(weight)
    found = observer.get_qparams()
    block_size = options.get("block_size", 128)
    want, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state)[None], found["scale"][None],
                                                  found["zero_point"][None], None, args, blocksize=block_size)
    assert not fallback[0]
    # llm-compressor dequantizes in the scales' dtype (the weight's): observed_dtype says so
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=None if dtype == torch.float32 else dtype)
    minmax = qstats.minmax(spec)
    layout = qstats.compute_qparams(minmax.update(minmax.init(weight), weight), spec)
    qparams = layout._replace(scale=found["scale"].reshape(layout.scale.shape).to(layout.scale.dtype),
                              zero_point=found["zero_point"].reshape(layout.zero_point.shape).to(layout.zero_point.dtype))
    got, codes, _ = qstats.gptq(weight, state, spec, block_size=block_size, actorder=args.actorder and "static",
                                qparams=qparams)
    assert torch.equal(codes, qstats.quantize(want[0].to(dtype), qparams, spec))
    assert torch.equal(got, want[0].to(dtype))


def test_stacked_experts_with_no_token_or_one_token():
    """Experts routed 0, 1, 2 and 40 tokens, stacked and under torch.vmap: the ones with tokens equal
    llm-compressor's batched quantize_weight; the one without is rounded to nearest with a warning.
    llm-compressor's routed calibration (``moe_calibrate_all_experts=False``) calls that expert on
    an empty input: its Hessian is zero with a sample count of 1, every column is dead, and its GPTQ
    writes zeros for the whole weight."""
    experts, out, columns = 4, 16, 32
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(experts, out, columns, generator=gen) * 0.05
    x = torch.randn(40, columns, generator=gen)
    route = torch.zeros(experts, 40)
    route[1, 7] = route[2, :2] = route[3] = 1
    stacked = qstats.stacked_observer(hessian(), experts)
    state = stacked.update(stacked.init(x.expand(experts, -1, -1)), x.expand(experts, -1, -1), route)
    assert state.count.tolist() == [0, 1, 2, 40]
    args = _args(group=16, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    weight_observer = qstats.stacked_observer(qstats.minmax(spec), experts)
    qparams = qstats.stacked_qparams(weight_observer.update(weight_observer.init(weights), weights), spec)
    with pytest.warns(qstats.UncalibratedWarning, match=r"experts \[0\] \(1 of 4\) saw no input row"):
        got, codes, _ = qstats.gptq(weights, state, spec, actorder="static", qparams=qparams)
    with pytest.warns(qstats.UncalibratedWarning, match=r"experts \[0\] \(1 of 4\)"):
        mapped = torch.vmap(lambda w, s, q: qstats.gptq(w, s, spec, actorder="static", qparams=q))(weights, state, qparams)
    assert torch.equal(mapped[0], got) and torch.equal(mapped[1], codes)
    assert torch.equal(got[0], qstats.fake_quantize(weights[0], qstats.QParams(*(f[0] for f in qparams)), spec))
    want, _, fallback = llmc_gptq.quantize_weight(weights[1:].clone(), gptq_hessian(HessianState(*(f[1:] for f in state))),
                                                  qparams.scale[1:], qparams.zero_point[1:], None, args)
    assert not fallback.any() and torch.equal(got[1:], want)
    # llm-compressor's hook on the unrouted expert's empty input, then its GPTQ: zeros
    layer = torch.nn.Linear(columns, out, bias=False)
    total, samples = llmc_helpers.accumulate_hessian(x[:0], layer, llmc_helpers.make_empty_hessian(layer),
                                                     torch.zeros(()))
    zeroed, _, fallback = llmc_gptq.quantize_weight(weights[:1].clone(), (total / samples)[None], qparams.scale[:1],
                                                    qparams.zero_point[:1], None, args)
    assert int(samples) == 1 and not fallback[0] and torch.equal(zeroed[0], torch.zeros(out, columns))


@pytest.mark.parametrize("routes", ["every token (one shared Hessian)", "each expert its tokens"])
def test_stacked_experts_with_tied_diagonals_take_llm_compressors_order(routes):
    experts, out, columns = 3, 16, 64
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(experts, out, columns, generator=gen) * 0.05
    x = _tied(torch.randn(120, columns, generator=gen))
    route = torch.ones(experts, 120)
    if routes.startswith("each"):
        route[0, :30] = route[1, 30:70] = route[2, 100:] = 0
    stacked = qstats.stacked_observer(hessian(), experts)
    state = stacked.update(stacked.init(x.expand(experts, -1, -1)), x.expand(experts, -1, -1), route)
    args = _args(group=16, symmetric=False, actorder="static")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    weight_observer = qstats.stacked_observer(qstats.minmax(spec), experts)
    qparams = qstats.stacked_qparams(weight_observer.update(weight_observer.init(weights), weights), spec)
    got, _, _ = qstats.gptq(weights, state, spec, actorder="static", qparams=qparams)
    want, _, fallback = llmc_gptq.quantize_weight(weights.clone(), gptq_hessian(state), qparams.scale,
                                                  qparams.zero_point, None, args)
    assert not fallback.any() and torch.equal(got, want)
