"""``F.linear``/``F.conv2d`` calls of a module's own parameters (no Linear or Conv module holds them), and of a
weight tied to a layer's, trained by `qstats.qat.prepare`'s model beside torch.ao's ``prepare_qat_fx``.

Reference: torch.ao's ``prepare_qat_fx`` with ``QConfigMapping().set_global(qconfig)`` fake-quantizes such a call's
weight (a weight ``FakeQuantize`` reading the parameter), its input and its output (an activation ``FakeQuantize``
each); a weight tied to a layer's gets fake quants of its own beside the layer's. qstats fake-quantizes layer inputs
and weights, not outputs: torch.ao's fake quants that feed no layer or call are switched off. Outputs, parameter
gradients and the final ranges of every point are compared over SGD steps through observe, fake-quantize and frozen
phases.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
)
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, train_beside_prepared
from qstats import QATSchedule

QCONFIG = QConfig(  # _qat_torch_ao_reference's fake quants, of ACT_SPEC and W_SPEC
    activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                      dtype=torch.quint8, qscheme=torch.per_tensor_affine),
    weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
SCHEDULE = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=4)
LR = 0.05
_CALLS = (F.linear, F.conv1d, F.conv2d, F.conv3d)


class _Block(nn.Module):
    """A custom block: a convolution and a projection as F.conv2d / F.linear of its own parameters."""

    def __init__(self):
        super().__init__()
        self.conv_weight = nn.Parameter(torch.randn(4, 3, 3, 3) * 0.3)
        self.conv_bias = nn.Parameter(torch.randn(4) * 0.1)
        self.proj = nn.Parameter(torch.randn(5, 4) * 0.4)
        self.proj_bias = nn.Parameter(torch.randn(5) * 0.1)
        self.shift = nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x):
        # the sum of two tensors has an output fake quant of its own in torch.ao; mean or relu share their input's
        # (the convolution's output), which qstats has not
        h = F.conv2d(x, self.conv_weight, self.conv_bias, padding=1).mean((2, 3)) + self.shift
        return F.linear(h, weight=self.proj, bias=self.proj_bias)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = _Block(), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.body(x))


class _Tied(nn.Module):
    """A Linear called as a module, and its weight and bias read again by an F.linear of the model's forward."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(6, 6)

    def forward(self, x):
        return F.linear(self.mix(x).tanh(), self.mix.weight, self.mix.bias)


def _weight(call):
    return call.args[1] if len(call.args) > 1 else call.kwargs["weight"]


def _reference(model: nn.Module, example, mapping=None) -> tuple:
    """``(torch.ao's prepared model, {"kind.key": its FakeQuantize}, [its other FakeQuantize])``: the weight and
    input fake quants of each functional call (keyed by the parameter it reads) and of each QAT module (keyed by
    its name), then those qstats has not (outputs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = prepare_qat_fx(copy.deepcopy(model).train(), mapping or QConfigMapping().set_global(QCONFIG),
                                   (example,))
    points, others = {}, []
    for node in reference.graph.nodes:
        module = reference.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, FakeQuantize):
            (user,) = node.users
            if user.op == "call_function" and user.target in _CALLS and _weight(user) is node:
                points[f"weights.{node.args[0].target}"] = module
            elif user.op == "call_function" and user.target in _CALLS and user.args[0] is node:
                weight = _weight(user).args[0]  # the call's weight fake quant reads the parameter
                points[f"activations.{weight.target}"] = module
            elif user.op == "call_module" and hasattr(reference.get_submodule(user.target), "weight_fake_quant"):
                points[f"activations.{user.target}"] = module
            else:
                others.append(module)
        elif module is not None and hasattr(module, "weight_fake_quant"):
            points[f"weights.{node.target}"] = module.weight_fake_quant
    return reference, points, others


def _prepare(model: nn.Module, **kwargs):
    return qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                              qstats.moving_average_minmax(ACT_SPEC, 0.01), **kwargs)


def _train_beside_torch_ao(model: nn.Module, qat, make_batch, expected_points: set) -> None:
    reference, points, others = _reference(model, make_batch(0))
    assert set(points) == expected_points
    assert {f"{kind}.{key}" for kind, keys in (("weights", qat.weight_observers), ("activations", qat.activation_layers))
            for key in keys} == expected_points
    batches = [make_batch(step) for step in range(7)]  # drawn after the reference's example, as they were
    train_beside_prepared(qat, reference, points, others, batches, SCHEDULE, LR)


def test_functional_conv_and_linear_of_a_blocks_own_parameters_train_as_torch_ao_prepare_qat_fx():
    # they stayed in float (prepare warned): torch.ao fake-quantizes each call's weight and input
    torch.manual_seed(0)
    model = _Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stays in float: no warning
        qat = _prepare(model)
    assert qat.layers == ("body.conv_weight", "body.proj", "head")
    assert qat.parameter_layers == {"body.conv_weight": nn.Conv2d, "body.proj": nn.Linear}
    g = torch.Generator().manual_seed(1)
    _train_beside_torch_ao(model, qat, lambda step: torch.randn(3, 3, 6, 6, generator=g) * (1 + step / 3), {
        "weights.body.conv_weight", "activations.body.conv_weight", "weights.body.proj", "activations.body.proj",
        "weights.head", "activations.head"})


def test_weight_tied_to_a_layer_has_points_of_its_own_as_in_torch_ao():
    # torch.ao gives the F.linear of mix's weight a weight and an input fake quant apart from the QAT Linear's
    # (before: one weight point and one input state, "mix", for both)
    torch.manual_seed(0)
    model = _Tied()
    qat = _prepare(model)
    assert qat.layers == ("mix", "mix.weight") and qat.parameter_layers == {"mix.weight": nn.Linear}
    g = torch.Generator().manual_seed(2)
    _train_beside_torch_ao(model, qat, lambda step: torch.randn(4, 6, generator=g) * (1 + step / 3), {
        "weights.mix", "activations.mix", "weights.mix.weight", "activations.mix.weight"})


def test_observers_of_a_functional_call_are_those_of_its_layer_type():
    # F.conv2d takes Conv2d's entry (here None: float), F.linear Linear's; torch.ao names the functions themselves
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(2, 3, 6, 6)
    weights = qstats.moving_average_minmax(W_SPEC, 0.01)
    qat = qstats.qat.prepare(model, {nn.Conv2d: None, nn.Linear: weights},
                             {nn.Conv2d: None, nn.Module: qstats.moving_average_minmax(ACT_SPEC, 0.01)})
    assert set(qat.weight_observers) == {"body.proj", "head"}
    assert set(qat.activation_observers) == {"body.proj", "head"}
    mapping = QConfigMapping().set_global(QCONFIG).set_object_type(F.conv2d, None)
    reference, points, others = _reference(model, x, mapping)
    assert set(points) == {"weights.body.proj", "activations.body.proj", "weights.head", "activations.head"}
    conv = next(node for node in reference.graph.nodes if node.op == "call_function" and node.target is F.conv2d)
    assert [arg.op for arg in conv.args[:3]] == ["placeholder", "get_attr", "get_attr"]  # in float in torch.ao too
    for fq in others:
        fq.disable_observer()
        fq.disable_fake_quant()
    out, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase(observe=True, fake_quantize=True))
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.weights["body.proj"].max_val, points["weights.body.proj"].activation_post_process.max_val)


def test_observed_weight_and_learnable_ranges_of_a_functional_parameter():
    torch.manual_seed(0)
    model, x = _Model(), torch.randn(2, 3, 6, 6)
    qat = _prepare(model)
    trained = {"body.proj": torch.randn(5, 4)}
    torch.testing.assert_close(qat.observed_weight(trained, "body.proj"), trained["body.proj"])
    torch.testing.assert_close(qat.observed_weight({}, "body.conv_weight"), model.body.conv_weight)
    state = qat.init(x)
    _, state = qat.apply(qat.params(), state, x, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    ranges = qat.learnable_ranges(state, weights=True)
    assert set(ranges["weights"]) == set(ranges["activations"]) == {"body.conv_weight", "body.proj", "head"}
    # layer_phases: the block's path switches its calls' points
    frozen = qstats.QATPhase(observe=False, fake_quantize=False)
    _, after = qat.apply(qat.params(), state, x * 3, phase=qstats.QATPhase(), layer_phases={"body": frozen})
    torch.testing.assert_close(after.activations["body.proj"].max_val, state.activations["body.proj"].max_val)
    assert not torch.equal(after.activations["head"].max_val, state.activations["head"].max_val)


class _Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("frozen", torch.randn(4, 4))
        self.scaled = nn.Parameter(torch.randn(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(F.linear(F.linear(x, self.frozen), self.scaled * 0.5))


def test_buffers_and_computed_weights_are_fake_quantized_as_in_torch_ao():
    # they stayed in float, named in a warning; torch.ao fake-quantizes both calls' weights and inputs
    # (trained beside it: tests/test_qat_functional_transposed_and_buffer_weights.py)
    torch.manual_seed(0)
    model, x = _Buffered(), torch.randn(3, 4)
    _, points, _ = _reference(model, x)
    assert {"weights.frozen", "activations.frozen", "weights.head", "activations.head"} <= set(points)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qat = _prepare(model)
    assert qat.layers == ("frozen", "linear_1", "head")  # linear_1: the call of self.scaled * 0.5


class _OwnProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(4, 4) * 0.5)

    def forward(self, x):
        return F.linear(x, self.proj)


def test_layer_phases_switch_a_parameter_call_through_every_path_of_a_shared_block():
    """A block held under two paths (``nn.ModuleList([block, block])``) is one object, switched through either
    path (as a shared Linear is, tests/test_qat_layer_phases_shared_modules.py): its F.linear call's point is named
    after the first path's parameter, and ``layer_phases={"blocks.1": off}`` switched nothing but raised that the
    path held no quantized layer. Reference: the float model (no point observes or fake-quantizes)."""
    torch.manual_seed(0)
    block = _OwnProjection()

    class _Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([block, block])

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x))

    shared = _Shared()
    qat = _prepare(shared)
    x = torch.randn(3, 4)
    state = qat.init(x)
    off = qstats.QATPhase(observe=False, fake_quantize=False)
    for path in ("blocks.0", "blocks.1"):
        out, new_state = qat.apply(qat.params(), state, x, layer_phases={path: off})
        torch.testing.assert_close(out, shared(x), rtol=0, atol=0, msg=path)
