"""`qstats.gptq` compiles with ``torch.compile(fullgraph=True)``: the codes equal eager's and
llm-compressor 0.14's ``quantize_weight`` on the same Hessian; a stack of equal Hessians (every expert
on every token, factored once) compiles too and equals eager."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

OUT, IN, GROUP = 8, 32, 16
ARGS = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=GROUP, actorder="static")
SPEC = qstats.QuantSpec.from_compressed_tensors(ARGS)


def _minmax_qparams(weight):
    observer = qstats.minmax(SPEC)
    return qstats.compute_qparams(observer.update(observer.init(weight), weight), SPEC)


def _gptq(weight, state, qparams):
    return qstats.gptq(weight, state, SPEC, block_size=GROUP, actorder="static", qparams=qparams)


def test_compiled_codes_equal_eager_and_llm_compressor():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, IN, generator=gen) * 0.05
    x = torch.randn(200, IN, generator=gen) * torch.linspace(0.05, 2.0, IN)
    state = hessian().update(hessian().init(x), x)
    qparams = _minmax_qparams(weight)
    eager = _gptq(weight, state, qparams)
    compiled = torch.compile(_gptq, fullgraph=True)(weight, state, qparams)
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[0], eager[0])
    scale, zero_point = qparams.scale.reshape(OUT, -1), qparams.zero_point.reshape(OUT, -1)
    reference, _, fallback = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state).clone()[None],
                                                       scale[None], zero_point[None], None, ARGS, blocksize=GROUP)
    assert not bool(fallback[0])
    assert torch.equal(compiled[1], qstats.quantize(reference[0], qparams, SPEC))


def test_compiled_stack_of_equal_hessians_equals_eager():
    experts = 3
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(experts, OUT, IN, generator=gen)
    x = torch.randn(80, IN, generator=gen).expand(experts, 80, IN)  # every expert on every token
    observer = qstats.stacked_observer(hessian(), experts)
    state = observer.update(observer.init(x), x)
    assert torch.equal(state.total, state.total[:1].expand_as(state.total))
    eager = _gptq(weights, state, None)
    compiled = torch.compile(_gptq, fullgraph=True)(weights, state, None)
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[0], eager[0])
