"""``F.linear``/``F.conv2d`` calls on weights held as plain parameters (no Linear or Conv module holds them).

Reference: torch.ao's ``prepare_qat_fx`` with ``get_default_qat_qconfig_mapping`` fake-quantizes such a call's
weight (a ``FakeQuantize`` reading the parameter) and input. `qstats.qat.prepare` fake-quantizes the same
parameters and buffers (tests/test_qat_functional_parameters.py trains them beside torch.ao); a call it leaves in
float (an F.embedding of a parameter, as torch.ao does) must be named, instead of training in float without a word
(and a model made of such calls only must be refused naming them, not with "no layer")."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantizeBase, get_default_qat_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC


class _Functional(nn.Module):
    """A conv and a linear as F.conv2d / F.linear of the module's own parameters."""

    def __init__(self):
        super().__init__()
        self.conv_weight, self.conv_bias = nn.Parameter(torch.randn(4, 3, 3, 3) * 0.2), nn.Parameter(torch.zeros(4))
        self.proj = nn.Parameter(torch.randn(5, 4) * 0.3)

    def forward(self, x):
        h = F.conv2d(x, self.conv_weight, self.conv_bias, padding=1).relu_()
        return F.linear(h.mean((2, 3)), self.proj)


class _WithHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = _Functional(), nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.body(x))


class _TiedOutput(nn.Module):
    """A language-model head tied to its embedding: F.linear of the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.embedding, self.mix = nn.Embedding(10, 6), nn.Linear(6, 6)

    def forward(self, ids):
        return F.linear(self.mix(self.embedding(ids)), self.embedding.weight)


class _LowRank(nn.Linear):
    """A Linear subclass with a low-rank update held as plain parameters (LoRA without Linear modules)."""

    def __init__(self, features: int, rank: int):
        super().__init__(features, features)
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(rank, features) * 0.1), nn.Parameter(torch.zeros(features, rank))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def _fake_quantized_parameters(model: nn.Module, example) -> set:
    """The parameters whose value torch.ao's prepare_qat_fx (default x86 QAT mapping) fake-quantizes."""
    # embeddings (default QAT qconfig: per-channel symmetric weights, which torch.ao refuses for them) in float
    mapping = get_default_qat_qconfig_mapping("x86").set_object_type(nn.Embedding, None)
    prepared = prepare_qat_fx(copy.deepcopy(model).train(), mapping, (example,))
    return {str(node.args[0].target) for node in prepared.graph.nodes
            if node.op == "call_module" and isinstance(prepared.get_submodule(node.target), FakeQuantizeBase)
            and node.args[0].op == "get_attr"}


def _prepare(model, **kwargs):
    return qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                              qstats.moving_average_minmax(ACT_SPEC, 0.01), **kwargs)


def test_functional_calls_on_plain_parameters_are_fake_quantized_as_in_torch_ao():
    # they stayed in float, named in a warning
    torch.manual_seed(0)
    model, x = _WithHead(), torch.randn(2, 3, 6, 6)
    expected = _fake_quantized_parameters(model, x)
    assert {"body.conv_weight", "body.proj"} <= expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qat = _prepare(model)
    assert qat.layers == ("body.conv_weight", "body.proj", "head")
    assert set(qat.parameter_layers) == expected == {"body.conv_weight", "body.proj"}  # head's is its QAT Linear's
    out, _ = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    torch.testing.assert_close(out, model(x))


def test_tied_output_projection_is_fake_quantized_as_a_linear():
    # F.linear of the embedding's weight takes Linear's observers, as torch.ao gives that F.linear a weight fake quant
    torch.manual_seed(0)
    model, ids = _TiedOutput(), torch.randint(0, 10, (2, 5))
    assert "embedding.weight" in _fake_quantized_parameters(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qat = _prepare(model)
    assert qat.layers == ("mix", "embedding.weight") and qat.parameter_layers == {"embedding.weight": nn.Linear}
    out, _ = qat.apply(qat.params(), qat.init(ids), ids, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    torch.testing.assert_close(out, model(ids))


class _Buffers(nn.Module):
    """F.conv2d / F.linear of buffers: weights no parameter holds."""

    def __init__(self):
        super().__init__()
        self.register_buffer("conv_weight", torch.randn(4, 3, 3, 3) * 0.2)
        self.register_buffer("proj", torch.randn(5, 4) * 0.3)

    def forward(self, x):
        return F.linear(F.conv2d(x, self.conv_weight, padding=1).mean((2, 3)), self.proj)


def test_model_of_functional_calls_of_buffers_only_is_fake_quantized_as_in_torch_ao():
    # it was refused ("no layer"), naming the calls as left in float
    torch.manual_seed(0)
    model = _Buffers()
    assert {"conv_weight", "proj"} <= _fake_quantized_parameters(model, torch.randn(2, 3, 6, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qat = _prepare(model)
    assert qat.layers == ("conv_weight", "proj")
    assert qat.parameter_layers == {"conv_weight": nn.Conv2d, "proj": nn.Linear}


class _Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        return F.embedding(ids, self.table)


def test_model_of_functional_calls_left_in_float_only_is_refused_naming_them():
    # torch.ao's prepare_qat_fx leaves F.embedding in float too (its backend config quantizes Embedding modules)
    with pytest.raises(ValueError, match=r"no layer of the types.*F\.embedding\(weight 'table'\) in the model.*"
                                         r"observe_fake_quantize"):
        qstats.qat.prepare(_Lookup(), qstats.minmax(W_SPEC), layers=nn.Embedding)


def test_functional_calls_of_unquantized_kinds_are_neither_quantized_nor_named():
    # layers=Linear: an F.conv2d is no call of a quantized kind, as an nn.Conv2d would stay in float unnamed
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qat = _prepare(_WithHead(), layers=nn.Linear)
    assert qat.layers == ("body.proj", "head")


def test_plain_parameters_in_a_quantized_layers_own_forward_are_fake_quantized():
    # the layer's own weight is quantized under its name, the low-rank parameters beside it under theirs
    # (they stayed in float, named in a warning)
    torch.manual_seed(0)
    model = nn.Sequential(_LowRank(4, 2), nn.ReLU(), nn.Linear(4, 2))
    assert {"0.lora_a", "0.lora_b", "0.weight"} <= _fake_quantized_parameters(model, torch.randn(3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qat = _prepare(model)
    assert qat.layers == ("0", "0.lora_a", "0.lora_b", "2")
