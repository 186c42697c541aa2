"""``F.conv_transpose1d/2d/3d`` calls of a parameter and ``F.linear``/``F.conv2d`` calls of a buffer, trained by
`qstats.qat.prepare`'s model beside torch.ao's ``prepare_qat_fx``; ``F.embedding`` calls of a parameter stay in float
in both; an integer input of a fake-quantized point is refused naming the layer.

Reference: torch.ao's ``prepare_qat_fx`` with the default backend config. With ``get_default_qat_qconfig_mapping``
("x86" and "qnnpack") it fake-quantizes the weight and input of a transposed convolution of a parameter, of a linear
of a buffer and of a linear of a computed weight (``self.a @ self.b``), and leaves ``F.embedding``/``F.embedding_bag``
of a parameter in float, whatever their qconfig (its backend config quantizes the Embedding modules only). The
training tests give torch.ao plain ``FakeQuantize`` modules (tests/test_qat_functional_parameters.py's), per-channel
along the output channels of the transposed convolution's weight (``ch_axis=1``, one group: qstats observes it in a
convolution's layout, ``PerAxis(0)``), and compare outputs, parameter gradients and final ranges over SGD steps
through observe, fake-quantize and frozen phases; torch.ao's output fake quants, which qstats has not, are off.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    FakeQuantizeBase,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
    default_embedding_qat_qconfig,
    get_default_qat_qconfig_mapping,
)
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, train_beside_prepared
from qstats import QATSchedule

SCHEDULE = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=4)
LR = 0.05
_ACTIVATION = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                     dtype=torch.quint8, qscheme=torch.per_tensor_affine)


def _weight_fake_quant(ch_axis):
    """torch.ao's weight fake quant of ``W_SPEC`` along ``ch_axis``, per tensor (symmetric) where None."""
    if ch_axis is None:
        return FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127,
                                      dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    return FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=ch_axis)


_TRANSPOSED = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
_CALLS = (F.linear, F.conv2d, *_TRANSPOSED)


class _Calls(nn.Module):
    """Every kind of functional call in question, each of its own weight."""

    def __init__(self):
        super().__init__()
        self.t1, self.t2, self.t3 = (nn.Parameter(torch.randn(3, 2, *[2] * d)) for d in (1, 2, 3))
        self.table = nn.Parameter(torch.randn(10, 4))
        self.register_buffer("frozen", torch.randn(4, 4))
        self.a, self.b = nn.Parameter(torch.randn(4, 2)), nn.Parameter(torch.randn(2, 4))

    def forward(self, x1, x2, x3, ids, offsets, v):
        return (F.conv_transpose1d(x1, self.t1), F.conv_transpose2d(x2, self.t2), F.conv_transpose3d(x3, self.t3),
                F.embedding(ids, self.table), F.embedding_bag(ids, self.table, offsets), F.linear(v, self.frozen),
                F.linear(v, self.a @ self.b))


def _calls_inputs():
    return (torch.randn(2, 3, 5), torch.randn(2, 3, 5, 5), torch.randn(2, 3, 4, 4, 4), torch.randint(0, 10, (6,)),
            torch.tensor([0, 3]), torch.randn(2, 4))


def _weight_observed(prepared, call) -> bool:
    """Whether the weight argument of ``call`` (a node of a prepared model) comes out of a fake quant."""
    weight = call.args[1] if len(call.args) > 1 else call.kwargs["weight"]
    return weight.op == "call_module" and isinstance(prepared.get_submodule(weight.target), FakeQuantizeBase)


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])
def test_which_functional_calls_torch_ao_and_qstats_fake_quantize(backend):
    # the transposed convolutions, the buffer's and the computed weight's linear stayed in float (prepare warned,
    # claiming torch.ao fake-quantized F.embedding too)
    model, inputs = _Calls(), _calls_inputs()
    mapping = get_default_qat_qconfig_mapping(backend)
    for function in (F.embedding, F.embedding_bag):  # named with torch.ao's embedding qconfig: still in float
        mapping.set_object_type(function, default_embedding_qat_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_qat_fx(copy.deepcopy(model).train(), mapping, inputs)
    observed = {getattr(node.target, "__name__", str(node.target)) + f"#{i}": _weight_observed(prepared, node)
                for i, node in enumerate(n for n in prepared.graph.nodes if n.op == "call_function"
                                         and n.target in (*_TRANSPOSED, F.embedding, F.embedding_bag, F.linear))}
    assert observed == {"conv_transpose1d#0": True, "conv_transpose2d#1": True, "conv_transpose3d#2": True,
                        "embedding#3": False, "embedding_bag#4": False, "linear#5": True, "linear#6": True}
    layers = (nn.Linear, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Embedding, nn.EmbeddingBag)
    with pytest.warns(UserWarning, match=r"the calls F\.embedding\(weight 'table'\) in the model, "
                                         r"F\.embedding_bag\(weight 'table'\) in the model read weights .*"
                                         r"F\.embedding/F\.embedding_bag calls, which torch\.ao's prepare_qat_fx "
                                         r"leaves in float too.*: they stay in float"):
        qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC), layers=layers)
    assert qat.parameter_layers == {"t1": nn.ConvTranspose1d, "t2": nn.ConvTranspose2d, "t3": nn.ConvTranspose3d,
                                    "frozen": nn.Linear, "linear_1": nn.Linear}  # linear_1: of a @ b
    # by default (Linear, Conv1d/2d/3d) a transposed convolution stays in float, as an nn.ConvTranspose2d layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing is named: no embedding or transposed convolution is asked for
        assert qstats.qat.prepare(model, qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC)).layers == ("frozen", "linear_1")


class _Block(nn.Module):
    """A transposed convolution of a parameter and a projection and a convolution of buffers."""

    def __init__(self, groups: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(4, 6 // groups, 3, 3) * 0.3)
        self.up_bias = nn.Parameter(torch.randn(6) * 0.1)
        self.register_buffer("smooth", torch.randn(6, 6, 3, 3) * 0.2)
        self.register_buffer("proj", torch.randn(5, 6) * 0.4)
        self.shift = nn.Parameter(torch.randn(6) * 0.1)
        self.groups = groups

    def forward(self, x):
        h = F.conv_transpose2d(x, self.up, self.up_bias, stride=2, padding=1, groups=self.groups)
        # the sum has an output fake quant of its own in torch.ao; the mean shares the convolution's (observing
        # twice), which qstats has not
        h = F.conv2d(h, self.smooth, padding=1).mean((2, 3)) + self.shift
        return F.linear(h, self.proj)


class _Model(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.body, self.head = _Block(groups), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.body(x))


def _reference(model: nn.Module, example, per_channel: bool, computed=None) -> tuple:
    """``(torch.ao's prepared model, {"kind.key": its FakeQuantize}, [its output fake quants])``: the weight and
    input fake quants of each call, keyed by the parameter or buffer it reads, or for a computed weight by
    ``computed[the call's node name]``, and of each QAT Linear."""
    weight = _weight_fake_quant(0)
    transposed = _weight_fake_quant(1 if per_channel else None)  # along the output channels of [in, out, *k]
    mapping = (QConfigMapping().set_global(QConfig(activation=_ACTIVATION, weight=weight))
               .set_object_type(F.conv_transpose2d, QConfig(activation=_ACTIVATION, weight=transposed)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_qat_fx(copy.deepcopy(model).train(), mapping, (example,))
    points, others = {}, []
    for node in prepared.graph.nodes:
        module = prepared.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, FakeQuantize):
            (user,) = node.users
            if user.op == "call_function" and user.target in _CALLS and _weight_observed(prepared, user):
                read = (user.args[1] if len(user.args) > 1 else user.kwargs["weight"]).args[0]
                key = read.target if read.op == "get_attr" else computed[user.name]
                points[f"{'weights' if user.args[0] is not node else 'activations'}.{key}"] = module
            elif user.op == "call_module" and hasattr(prepared.get_submodule(user.target), "weight_fake_quant"):
                points[f"activations.{user.target}"] = module
            else:
                others.append(module)
        elif module is not None and hasattr(module, "weight_fake_quant"):
            points[f"weights.{node.target}"] = module.weight_fake_quant
    return prepared, points, others


def _train_beside_torch_ao(model, qat, batches, per_channel=True, computed=None):
    """SGD steps of ``qat`` and of torch.ao's prepared ``model`` through observe, fake-quantize and frozen phases:
    outputs and gradients every step, the ranges of every point at the end; returns qstats' parameters."""
    reference, points, others = _reference(model, batches[0], per_channel, computed)
    assert set(points) == {f"{kind}.{key}" for kind in ("weights", "activations") for key in qat.layers}
    return train_beside_prepared(qat, reference, points, others, batches, SCHEDULE, LR)


@pytest.mark.parametrize("per_channel, groups", [(True, 1), (False, 2)], ids=["per_channel", "per_tensor_groups"])
def test_transposed_convolution_and_buffer_calls_train_as_torch_ao_prepare_qat_fx(per_channel, groups):
    # they stayed in float (prepare warned); per channel, qstats' PerAxis(0) is along the output channels
    torch.manual_seed(0)
    model = _Model(groups)
    transposed = W_SPEC if per_channel else qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_symmetric)
    weights = {nn.ConvTranspose2d: qstats.moving_average_minmax(transposed, 0.01),
               nn.Module: qstats.moving_average_minmax(W_SPEC, 0.01)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stays in float: no warning
        qat = qstats.qat.prepare(model, weights, qstats.moving_average_minmax(ACT_SPEC, 0.01),
                                 layers=(nn.Linear, nn.Conv2d, nn.ConvTranspose2d))
    assert qat.layers == ("body.up", "body.smooth", "body.proj", "head")
    assert qat.parameter_layers == {"body.up": nn.ConvTranspose2d, "body.smooth": nn.Conv2d, "body.proj": nn.Linear}
    g = torch.Generator().manual_seed(1)
    params = _train_beside_torch_ao(model, qat, [torch.randn(3, 4, 4, 4, generator=g) * (1 + step / 3)
                                                 for step in range(7)], per_channel)
    # the weight as its point observes it: in a convolution's layout, output channel g * 6/groups + j being
    # column j of group g's input rows of the [in, out/groups, *k] weight
    observed, weight, rows, columns = qat.observed_weight(params, "body.up"), params["body.up"], 4 // groups, 6 // groups
    assert observed.shape == (6, rows, 3, 3)
    for g in range(groups):
        for j in range(columns):
            assert torch.equal(observed[g * columns + j], weight[g * rows:(g + 1) * rows, j])


class _HalfLinear(nn.Linear):
    """A Linear subclass whose forward changes its weight before F.linear."""

    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias)


class _Computed(nn.Module):
    """Weights computed in the forward: a masked convolution, a low-rank projection, a scaled Linear subclass."""

    def __init__(self):
        super().__init__()
        self.conv_weight = nn.Parameter(torch.randn(4, 3, 3, 3) * 0.3)
        self.register_buffer("mask", (torch.rand(4, 3, 3, 3) > 0.3).float())
        self.a, self.b = nn.Parameter(torch.randn(5, 2) * 0.5), nn.Parameter(torch.randn(2, 4) * 0.5)
        self.shift = nn.Parameter(torch.randn(4) * 0.1)
        self.scaled = _HalfLinear(5, 3)

    def forward(self, x):
        h = F.conv2d(x, self.conv_weight * self.mask, padding=1).mean((2, 3)) + self.shift
        return self.scaled(F.linear(h, self.a @ self.b).tanh())


def test_calls_of_computed_weights_train_as_torch_ao_prepare_qat_fx():
    # they stayed in float (prepare warned, naming "a computed weight" and the subclass as a layer in float)
    torch.manual_seed(0)
    model = _Computed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stays in float: no warning
        qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                                 qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.layers == ("conv2d", "linear", "scaled.linear_1")  # the calls' nodes, under the module making them
    assert qat.parameter_layers == {"conv2d": nn.Conv2d, "linear": nn.Linear, "scaled.linear_1": nn.Linear}
    g = torch.Generator().manual_seed(3)
    params = _train_beside_torch_ao(model, qat, [torch.randn(3, 3, 6, 6, generator=g) * (1 + step / 3)
                                                 for step in range(7)],
                                    computed={"conv2d": "conv2d", "linear": "linear", "linear_1": "scaled.linear_1"})
    for key, expected in (("linear", params["a"] @ params["b"]), ("conv2d", params["conv_weight"] * model.mask),
                          ("scaled.linear_1", params["scaled.weight"] * 0.5)):
        torch.testing.assert_close(qat.observed_weight(params, key), expected, rtol=0, atol=0, msg=key)
    # layer_phases switches the subclass's call with its path
    x, frozen = torch.randn(2, 3, 6, 6), qstats.QATPhase(observe=False, fake_quantize=False)
    state = qat.init(x)
    _, after = qat.apply(params, state, x, layer_phases={"scaled": frozen})
    assert torch.equal(after.activations["scaled.linear_1"].max_val, state.activations["scaled.linear_1"].max_val)
    assert not torch.equal(after.activations["linear"].max_val, state.activations["linear"].max_val)


class _FromInput(nn.Module):
    def forward(self, x, w):
        return F.linear(x, w.t())


def test_a_weight_computed_from_the_forwards_inputs_has_no_observed_weight():
    qat = qstats.qat.prepare(_FromInput(), qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    assert qat.layers == ("linear",)
    with pytest.raises(ValueError, match=r"the weight of 'linear' is computed from the forward's inputs"):
        qat.observed_weight({}, "linear")


def test_integer_input_of_a_fake_quantized_point_is_refused_naming_the_layer():
    # the TypeError named observe_fake_quantize only, not which of the model's layers got the integers
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    qat = qstats.qat.prepare(model, qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    x = torch.randint(0, 5, (2, 4))
    with pytest.raises(RuntimeError):  # torch's fake quant refuses integer tensors too
        torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)
    state = qat.init(x.float())
    with pytest.raises(TypeError, match=r"QATModel\.apply: the input of layer '0' \(fake-quantized\): x must be a "
                                        r"floating-point tensor, got torch\.int64"):
        qat.apply(qat.params(), state, x)


class _Twice(nn.Module):
    """One parameter read by two F.linear calls on different inputs."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x, y):
        return F.linear(x, self.w) + F.linear(y, self.w)


def test_calls_of_one_parameter_share_one_weight_point_and_one_input_state():
    """torch.ao's prepare_qat_fx reads the parameter once (torch.fx makes one node of it) into one weight fake quant,
    as qstats' one weight point; it observes each call's input (``x``, ``y``) with its own observer, where qstats' one
    input state observes ``x`` then ``y`` at every step, as torch.ao's eager one observer per module (docs/qat.md)."""
    torch.manual_seed(0)
    model = _Twice()
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.layers == ("w",)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = prepare_qat_fx(copy.deepcopy(model).train(), QConfigMapping().set_global(
            QConfig(activation=_ACTIVATION, weight=_weight_fake_quant(0))), (torch.randn(2, 4), torch.randn(2, 4)))
    calls = [node for node in reference.graph.nodes if node.op == "call_function" and node.target is F.linear]
    weights = {call.args[1] for call in calls}
    inputs = [reference.get_submodule(call.args[0].target) for call in calls]
    assert len(weights) == 1 and inputs[0] is not inputs[1]
    (weight_node,) = weights
    sequential = MovingAverageMinMaxObserver(averaging_constant=0.01)  # one observer, fed both inputs in call order
    state = qat.init(torch.randn(2, 4), torch.randn(2, 4))
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        x, y = torch.randn(5, 4, generator=g) * (1 + step), torch.randn(5, 4, generator=g) * 3
        reference(x, y)
        sequential(x)
        sequential(y)
        _, state = qat.apply(qat.params(), state, x, y, phase=qstats.QATPhase(observe=True, fake_quantize=False))
    weight_observer = reference.get_submodule(weight_node.target).activation_post_process
    torch.testing.assert_close(state.weights["w"].max_val, weight_observer.max_val, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state.activations["w"].max_val, sequential.max_val, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state.activations["w"].min_val, sequential.min_val, rtol=1e-6, atol=1e-7)
    for fq in inputs:  # torch.ao's: each input's own range
        assert not torch.allclose(state.activations["w"].max_val, fq.activation_post_process.max_val)


class _MaskedChild(nn.Module):
    """The forward passes a child Linear's masked weight to F.linear; the child itself is never called, so the call's
    node in the traced graph is named ``linear``, the child's own name."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("mask", (torch.rand(3, 4) > 0.3).float())

    def forward(self, x):
        return F.linear(x, self.linear.weight * self.mask, self.linear.bias)


def test_a_computed_call_named_as_a_module_of_the_model_takes_the_next_free_name():
    # prepare raised a ValueError asking to rename the module (a checkpoint's names cannot be changed)
    torch.manual_seed(0)
    model = _MaskedChild()
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.layers == ("linear_1",)
    g = torch.Generator().manual_seed(5)
    params = _train_beside_torch_ao(model, qat, [torch.randn(3, 4, generator=g) * (1 + step / 3) for step in range(7)],
                                    computed={"linear": "linear_1"})
    torch.testing.assert_close(qat.observed_weight(params, "linear_1"), params["linear.weight"] * model.mask,
                               rtol=0, atol=0)


class _ThroughLayer(nn.Module):
    """A weight computed by a quantized Linear from a parameter: no input of the forward reaches it."""

    def __init__(self):
        super().__init__()
        self.make, self.seed = nn.Linear(4, 12), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return F.linear(x, self.make(self.seed).view(3, 4))


def test_a_weight_computed_by_a_fake_quantized_layer_has_no_observed_weight_naming_that():
    # the error said the weight was computed from the forward's inputs, which it never reads
    qat = qstats.qat.prepare(_ThroughLayer(), qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC))
    assert qat.layers == ("make", "linear")
    with pytest.raises(ValueError, match=r"the weight of 'linear' is computed from the output of a fake-quantized "
                                         r"layer \(of the QAT state and phase\)"):
        qat.observed_weight(qat.params(), "linear")


class _Modulated(nn.Module):
    """StyleGAN2's modulated convolution: a weight per sample, the batch's samples convolved as groups."""

    def __init__(self):
        super().__init__()
        self.weight, self.affine = nn.Parameter(torch.randn(8, 4, 3, 3)), nn.Linear(6, 4)

    def forward(self, x, style):
        b, h = x.shape[0], x.shape[2]
        w = (self.weight[None] * self.affine(style)[:, None, :, None, None]).reshape(b * 8, 4, 3, 3)
        return F.conv2d(x.reshape(1, b * 4, h, h), w, padding=1, groups=b).reshape(b, 8, h, h)


def test_a_per_sample_weight_needs_its_init_batch_size_per_channel_as_torch_ao():
    # such a call stayed in float before its computed weight was fake-quantized; docs/qat.md says what to do
    torch.manual_seed(0)
    model, two, three = _Modulated(), (torch.randn(2, 4, 5, 5), torch.randn(2, 6)), (torch.randn(3, 4, 5, 5),
                                                                                      torch.randn(3, 6))
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01))
    assert qat.layers == ("affine", "conv2d")
    state = qat.init(*two)
    with pytest.raises(ValueError, match=r"gives quantization parameters of shape \(24,\), but the state has shape "
                                         r"\(16,\)"):
        qat.apply(qat.params(), state, *three)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = prepare_qat_fx(copy.deepcopy(model).train(), get_default_qat_qconfig_mapping("x86"), two)
    reference(*two)
    # torch.ao's per-channel weight fake quant is sized on the first batch too: 16 channels for a batch of 2,
    # where a batch of 3 gives 24 (its fused kernel is not called on those: it writes past its 16 channels
    # before it refuses them, and the process aborts at random)
    conv = next(node for node in reference.graph.nodes if node.target in (torch.conv2d, F.conv2d))
    weight_fake_quant = reference.get_submodule(conv.args[1].target)
    assert weight_fake_quant.ch_axis == 0 and weight_fake_quant.scale.shape == state.weights["conv2d"].max_val.shape
    assert state.weights["conv2d"].max_val.shape == (16,)
    off = qstats.QATPhase(observe=False, fake_quantize=False)
    _, after = qat.apply(qat.params(), state, *three, layer_phases={"conv2d": off})  # the Linear observed
    assert torch.equal(after.weights["conv2d"].max_val, state.weights["conv2d"].max_val)
    assert not torch.equal(after.activations["affine"].max_val, state.activations["affine"].max_val)
    out, _ = qat.apply(qat.params(), state, *three, phase=off, layer_phases={"conv2d": off})
    torch.testing.assert_close(out, model(*three), rtol=0, atol=0)  # in float, as the model computes it
