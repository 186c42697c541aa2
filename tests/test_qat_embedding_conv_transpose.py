"""`qstats.qat.prepare` on Embedding, EmbeddingBag and ConvTranspose1d/2d/3d layers.

References: torch.ao's QAT ``Embedding``/``EmbeddingBag`` modules with ``default_embedding_qat_qconfig``
(8 and 4 bits; also as ``prepare_qat_fx`` swaps them in), and torch.ao ``FakeQuantize`` modules on a
transposed convolution's input and weight (torch.ao's eager and FX QAT keep ConvTranspose weights in
float, and refuse per-channel observers for them: the reference fake-quantizes the weight per output
channel, ``ch_axis=1``, one FakeQuantize per group), over several training steps: outputs, gradients of
weights, biases and float inputs, and the final qparams.
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
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    QConfigMapping,
    default_embedding_qat_qconfig,
    default_embedding_qat_qconfig_4bit,
)
import torch.ao.nn.qat as nnqat

import qstats
from _shared import exit_rank, fork_ranks, gloo_group
from qstats import QATPhase, QATSchedule

SCHEDULE = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=4)
STEPS = 6
ACT_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
# a transposed convolution's weight spec reads as a convolution's: axis 0 is the output channel
W_PER_CHANNEL = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)
W_PER_TENSOR = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_symmetric)
EMBEDDING_QCONFIGS = {
    8: (default_embedding_qat_qconfig, torch.quint8),
    4: (default_embedding_qat_qconfig_4bit, torch.quint4x2),
}


def _embedding_observer(bits: int) -> qstats.Observer:
    """torch.ao's embedding weight fake quant: MovingAveragePerChannelMinMaxObserver (averaging
    constant 1) with per_channel_affine_float_qparams on the rows."""
    spec = qstats.QuantSpec.from_torch_ao(EMBEDDING_QCONFIGS[bits][1], torch.per_channel_affine_float_qparams, ch_axis=0)
    return qstats.moving_average_minmax(spec, 1.0)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)).sum()


def _set_phase(fake_quants, phase: QATPhase) -> None:
    for fq in fake_quants:
        fq.enable_observer(phase.observe)
        fq.enable_fake_quant(phase.fake_quantize)


def _train_against(qat, reference, fake_quants, batches, float_inputs=(), schedule=SCHEDULE):
    """``STEPS`` SGD steps of ``qat`` (torch.func.grad) and of ``reference`` (autograd) on the same
    batches: outputs, every parameter gradient and the gradients of the inputs at ``float_inputs``
    agree at each step. Returns the final state."""
    params = {k: v.detach().clone() for k, v in qat.params().items()}
    state = qat.init(*batches(0))

    def loss_fn(params, floats, state, inputs, phase):
        inputs = tuple(floats.get(i, t) for i, t in enumerate(inputs))  # integer ids take no gradient
        out, new_state = qat.apply(params, state, *inputs, phase=phase)
        return _loss(out), (out, new_state)

    grad_fn = torch.func.grad(loss_fn, argnums=(0, 1), has_aux=True)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        phase = schedule(step)
        inputs = batches(step)
        ref_inputs = tuple(t.clone().requires_grad_(i in float_inputs) if t is not None else None
                           for i, t in enumerate(inputs))
        _set_phase(fake_quants, phase)
        optimizer.zero_grad()
        expected = reference(*ref_inputs)
        _loss(expected).backward()
        floats = {i: inputs[i] for i in float_inputs}
        (grads, input_grads), (out, state) = grad_fn(params, floats, state, inputs, phase)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6, msg=f"output at step {step}")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad.to_dense(), rtol=1e-5, atol=1e-6,
                                       msg=f"{name} at step {step}")
        for i in float_inputs:
            torch.testing.assert_close(input_grads[i], ref_inputs[i].grad, rtol=1e-5, atol=1e-6,
                                       msg=f"input {i} at step {step}")
        optimizer.step()
        params = {k: v - 0.05 * grads[k] for k, v in params.items()}
    return state


def _assert_qparams(state, spec, fake_quant, layout=lambda t: t) -> None:
    qp = qstats.compute_qparams(state, spec)
    torch.testing.assert_close(layout(qp.scale).reshape(-1), fake_quant.scale.reshape(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(layout(qp.zero_point).reshape(-1).float(), fake_quant.zero_point.reshape(-1).float(),
                               rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Embedding and EmbeddingBag against torch.ao's QAT modules


class _Lookup(nn.Module):
    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embedding = embedding

    def forward(self, ids):
        return self.embedding(ids)


def _torch_ao_qat(layer: nn.Module, bits: int, fx: bool) -> nn.Module:
    """``_Lookup(layer)`` with torch.ao's QAT embedding: swapped by ``prepare_qat_fx`` or built with from_float."""
    qconfig = EMBEDDING_QCONFIGS[bits][0]
    if fx:
        from torch.ao.quantization.quantize_fx import prepare_qat_fx
        mapping = QConfigMapping().set_object_type(type(layer), qconfig)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return prepare_qat_fx(_Lookup(layer).train(), mapping, (torch.tensor([[0, 1]]),))
    layer.qconfig = qconfig
    qat_type = nnqat.Embedding if isinstance(layer, nn.Embedding) else nnqat.EmbeddingBag
    return _Lookup(qat_type.from_float(layer))


def _ids(step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 12, (3, 5), generator=g),)


@pytest.mark.parametrize("options", [
    {}, {"padding_idx": 3}, {"max_norm": 0.8}, {"max_norm": 1.5, "norm_type": 1.0}, {"scale_grad_by_freq": True},
])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("fx", [False, True])
def test_embedding_training_matches_torch_ao_qat_embedding(options, bits, fx):
    torch.manual_seed(0)
    layer = nn.Embedding(12, 6, **options)
    reference = _torch_ao_qat(copy.deepcopy(layer), bits, fx)
    qat = qstats.qat.prepare(_Lookup(layer), _embedding_observer(bits), layers=nn.Embedding)
    weight_before = layer.weight.detach().clone()
    # with max_norm, fake quant from the first step: torch.ao's QAT Embedding renorms its parameter in place
    # while its fake quant is off (FakeQuantize returns the parameter itself), qstats never changes it
    schedule = QATSchedule(observe_at=0, fake_quantize_at=0, freeze_ranges_at=4) if "max_norm" in options else SCHEDULE
    state = _train_against(qat, reference, [reference.embedding.weight_fake_quant], _ids, schedule=schedule)
    assert qat.activation_layers == () and set(state.weights) == {"embedding"} and state.activations == {}
    _assert_qparams(state.weights["embedding"], qat.weight_observer.spec, reference.embedding.weight_fake_quant)
    assert torch.equal(layer.weight, weight_before)  # max_norm renorms a copy, never the parameter


def test_sparse_embedding_gradient_is_torch_ao_sparse_gradient_densified():
    torch.manual_seed(0)
    layer = nn.Embedding(12, 6, sparse=True)
    reference = _torch_ao_qat(copy.deepcopy(layer), 8, fx=False)
    with pytest.warns(UserWarning, match="sparse=True"):
        qat = qstats.qat.prepare(_Lookup(layer), _embedding_observer(8), layers=nn.Embedding)
    _train_against(qat, reference, [reference.embedding.weight_fake_quant], _ids)
    assert reference.embedding.weight.grad.layout == torch.sparse_coo  # torch.ao's; qstats' is dense


class _Bag(nn.Module):
    def __init__(self, bag: nn.Module):
        super().__init__()
        self.embedding = bag

    def forward(self, ids, offsets, per_sample_weights):
        return self.embedding(ids, offsets, per_sample_weights=per_sample_weights)


def _bag_batches(weighted: bool, include_last_offset: bool):
    def batches(step: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 12, (10,), generator=g)
        offsets = torch.tensor([0, 3, 3, 7] + ([10] if include_last_offset else []))  # an empty bag too
        return ids, offsets, torch.rand(10, generator=g) if weighted else None
    return batches


@pytest.mark.parametrize("mode, weighted, options", [
    ("sum", False, {}),
    ("sum", True, {}),
    ("mean", False, {"padding_idx": 2}),
    ("max", False, {"include_last_offset": True}),
    ("sum", True, {"max_norm": 0.9, "include_last_offset": True}),
])
def test_embedding_bag_training_matches_torch_ao_qat_embedding_bag(mode, weighted, options):
    torch.manual_seed(0)
    layer = nn.EmbeddingBag(12, 6, mode=mode, **options)
    layer.qconfig = default_embedding_qat_qconfig
    reference = _Bag(nnqat.EmbeddingBag.from_float(copy.deepcopy(layer)))
    qat = qstats.qat.prepare(_Bag(layer), _embedding_observer(8), layers=nn.EmbeddingBag)
    batches = _bag_batches(weighted, options.get("include_last_offset", False))
    schedule = QATSchedule(observe_at=0, fake_quantize_at=0, freeze_ranges_at=4) if "max_norm" in options else SCHEDULE
    state = _train_against(qat, reference, [reference.embedding.weight_fake_quant], batches,
                           float_inputs=(2,) if weighted else (), schedule=schedule)
    _assert_qparams(state.weights["embedding"], qat.weight_observer.spec, reference.embedding.weight_fake_quant)


class _Tagger(nn.Module):
    """Token ids -> embedding -> Linear: the ids are never observed, the Linear's input is."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(12, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(self.embedding(ids))


def test_embedding_among_layers_with_activation_points_has_none_of_its_own():
    torch.manual_seed(0)
    model = _Tagger()
    qat = qstats.qat.prepare(model, qstats.minmax(W_PER_CHANNEL), qstats.minmax(ACT_SPEC),
                             layers=(nn.Embedding, nn.Linear))
    ids = _ids(0)[0]
    state = qat.init(ids)
    out, state = qat.apply(qat.params(), state, ids)
    assert qat.layers == ("embedding", "head") and qat.activation_layers == ("head",)
    assert set(state.activations) == {"head"} and set(state.weights) == {"embedding", "head"}
    # independently: torch.ao FakeQuantize modules with the same observers at the same points
    weight_fq = [FakeQuantize(observer=torch.ao.quantization.PerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                              dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0) for _ in range(2)]
    act_fq = FakeQuantize(observer=torch.ao.quantization.MinMaxObserver, quant_min=0, quant_max=255,
                          dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    rows = F.embedding(ids, weight_fq[0](model.embedding.weight))
    expected = F.linear(act_fq(rows), weight_fq[1](model.head.weight), model.head.bias)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# ConvTranspose against torch.ao FakeQuantize modules


def _weight_fq(per_channel: bool) -> FakeQuantize:
    if per_channel:  # a transposed convolution's output channels are the weight's axis 1
        return FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                            dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=1, averaging_constant=0.1)
    return FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
                        qscheme=torch.per_tensor_symmetric, averaging_constant=0.1)


class _Upsample(nn.Module):
    def __init__(self, layer: nn.Module, output_size=None):
        super().__init__()
        self.layer, self.output_size = layer, output_size

    def forward(self, x):
        if self.output_size is None:
            return F.relu(self.layer(x))
        return F.relu(self.layer(x, output_size=self.output_size))


class _TorchAoUpsample(nn.Module):
    """`_Upsample` with torch.ao FakeQuantize modules on the input and on the weight: per channel, one
    per group (each group's rows ``[in/groups, out/groups, *k]`` hold its output channels on axis 1)."""

    def __init__(self, layer: nn.Module, output_size, per_channel: bool):
        super().__init__()
        self.layer, self.output_size = layer, output_size
        self.act = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
                                qscheme=torch.per_tensor_affine, averaging_constant=0.1)
        self.weight_fqs = nn.ModuleList(_weight_fq(per_channel) for _ in range(layer.groups if per_channel else 1))

    def forward(self, x):
        layer = self.layer
        chunks = layer.weight.chunk(len(self.weight_fqs), dim=0)
        weight = torch.cat([fq(chunk) for fq, chunk in zip(self.weight_fqs, chunks)])
        dims = len(layer.kernel_size)
        output_padding = layer._output_padding(x, self.output_size, layer.stride, layer.padding, layer.kernel_size,
                                               dims, layer.dilation)
        function = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
        return F.relu(function(self.act(x), weight, layer.bias, layer.stride, layer.padding, output_padding,
                               layer.groups, layer.dilation))


CONV_TRANSPOSE_CASES = {
    "1d": (nn.ConvTranspose1d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1,
                                    output_padding=1), (2, 4, 7), None),
    "1d groups dilation": (nn.ConvTranspose1d, dict(in_channels=4, out_channels=6, kernel_size=3, groups=2,
                                                    dilation=2, bias=False), (2, 4, 7), None),
    "2d groups": (nn.ConvTranspose2d, dict(in_channels=6, out_channels=9, kernel_size=(2, 3), stride=(2, 1),
                                           padding=(0, 1), groups=3), (2, 6, 4, 5), None),
    "2d output_size": (nn.ConvTranspose2d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
                       (2, 3, 4, 5), [8, 10]),
    "3d": (nn.ConvTranspose3d, dict(in_channels=2, out_channels=4, kernel_size=2, stride=2, groups=2),
           (1, 2, 3, 2, 3), None),
}


@pytest.mark.parametrize("case", list(CONV_TRANSPOSE_CASES))
@pytest.mark.parametrize("per_channel", [True, False])
def test_conv_transpose_training_matches_torch_ao_fake_quantize_per_output_channel(case, per_channel):
    layer_type, options, shape, output_size = CONV_TRANSPOSE_CASES[case]
    torch.manual_seed(0)
    layer = layer_type(**options)
    reference = _TorchAoUpsample(copy.deepcopy(layer), output_size, per_channel)
    spec = W_PER_CHANNEL if per_channel else W_PER_TENSOR
    qat = qstats.qat.prepare(_Upsample(layer, output_size), qstats.moving_average_minmax(spec, 0.1),
                             qstats.moving_average_minmax(ACT_SPEC, 0.1), layers=layer_type)

    def batches(step):
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(step)) * (1 + step),)

    state = _train_against(qat, reference, [reference.act, *reference.weight_fqs], batches, float_inputs=(0,))
    _assert_qparams(state.activations["layer"], ACT_SPEC, reference.act)
    qp = qstats.compute_qparams(state.weights["layer"], spec)
    expected = torch.cat([fq.scale.reshape(-1) for fq in reference.weight_fqs])
    torch.testing.assert_close(qp.scale.reshape(-1), expected, rtol=1e-6, atol=0)
    if per_channel:
        assert qp.scale.numel() == layer.out_channels  # per output channel, every group's own


def test_conv_transpose_per_output_channel_differs_from_per_weight_axis_with_groups():
    # with groups, axis 1 of the weight holds out/groups channels: ranges shared across groups would
    # be wrong; qstats' ranges are the output channels' (the reference above, one FakeQuantize per group)
    torch.manual_seed(0)
    layer = nn.ConvTranspose1d(4, 6, 3, groups=2)
    with torch.no_grad():
        layer.weight[2:] *= 10  # the second group's weights are wider
    qat = qstats.qat.prepare(_Upsample(layer), qstats.minmax(W_PER_CHANNEL), layers=nn.ConvTranspose1d)
    x = torch.randn(1, 4, 5)
    _, state = qat.apply(qat.params(), qat.init(x), x)
    amax = layer.weight.detach().reshape(2, 2, 3, 3).abs().amax(dim=(1, 3)).reshape(-1)  # [group, out/groups]
    torch.testing.assert_close(state.weights["layer"].max_val.reshape(-1).abs().maximum(
        state.weights["layer"].min_val.reshape(-1).abs()), amax)


# ------------------------------------------------------------------------------------------------
# The other QAT flows: learned ranges, compile, sync


def test_learned_ranges_of_conv_transpose_and_embedding_match_torch_learnable_kernels():
    torch.manual_seed(0)
    layer = nn.ConvTranspose2d(3, 4, 2, stride=2)
    qat = qstats.qat.prepare(_Upsample(layer), qstats.minmax(W_PER_CHANNEL), qstats.minmax(ACT_SPEC),
                             layers=nn.ConvTranspose2d, grad_scale=None)
    x = torch.randn(2, 3, 4, 4)
    state = qat.apply(qat.params(), qat.init(x), x, phase=QATPhase(True, False))[1]
    ranges = qat.learnable_ranges(state, weights=True)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in qat.params().items()}
    out, _ = qat.apply(params, state, x, phase=QATPhase(False, True), ranges=ranges)
    _loss(out).backward()

    w_range, a_range = ranges["weights"]["layer"], ranges["activations"]["layer"]
    ref = {name: t.detach().clone().requires_grad_(True)
           for name, t in (("w", params["layer.weight"]), ("ws", w_range.scale), ("wz", w_range.zero_point),
                           ("as", a_range.scale), ("az", a_range.zero_point))}
    xq = torch._fake_quantize_learnable_per_tensor_affine(x, ref["as"].reshape(1), ref["az"].reshape(1), 0, 255, 1.0)
    wq = torch._fake_quantize_learnable_per_channel_affine(ref["w"], ref["ws"], ref["wz"], 1, -128, 127, 1.0)
    expected = F.relu(F.conv_transpose2d(xq, wq, layer.bias, stride=2))
    _loss(expected).backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(params["layer.weight"].grad, ref["w"].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_range.scale.grad, ref["ws"].grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a_range.scale.grad.reshape(()), ref["as"].grad.reshape(()), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a_range.zero_point.grad.reshape(()), ref["az"].grad.reshape(()), rtol=1e-4, atol=1e-6)

    embedding = nn.Embedding(12, 6)
    emb_qat = qstats.qat.prepare(_Lookup(embedding), _embedding_observer(8), layers=nn.Embedding, grad_scale=None)
    ids = _ids(0)[0]
    state = emb_qat.apply(emb_qat.params(), emb_qat.init(ids), ids, phase=QATPhase(True, False))[1]
    learned = emb_qat.learnable_ranges(state, weights=True, activations=False)["weights"]["embedding"]
    weight = embedding.weight.detach().clone().requires_grad_(True)
    out, _ = emb_qat.apply({"embedding.weight": weight}, state, ids, phase=QATPhase(False, True),
                           ranges={"weights": {"embedding": learned}})
    _loss(out).backward()
    # torch's fake quant with float zero points (torch.ao's embedding kernel; its learnable kernels round
    # the zero point to an integer) at the learned scale and zero point: the forward and the clipped
    # straight-through gradient of the weight
    ref_weight = embedding.weight.detach().clone().requires_grad_(True)
    expected = F.embedding(ids, torch.fake_quantize_per_channel_affine(
        ref_weight, learned.scale.detach(), learned.zero_point.detach(), 0, 0, 255))
    _loss(expected).backward()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-5, atol=1e-6)
    assert learned.scale.grad.abs().sum() > 0 and torch.isfinite(learned.zero_point.grad).all()


def _sync_rank(rank, port):
    with gloo_group(rank, port):  # one thread from here on: a forked OpenMP pool would hang
        torch.manual_seed(0)
        layer = nn.ConvTranspose1d(4, 6, 3, stride=2)
        qat = qstats.qat.prepare(_Upsample(layer), qstats.minmax(W_PER_CHANNEL), qstats.minmax(ACT_SPEC),
                                 layers=nn.ConvTranspose1d)
        xs = [torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(r)) * (1 + 3 * r) for r in range(2)]
        state = qat.apply(qat.params(), qat.init(xs[rank]), xs[rank])[1]
        merged = qat.sync(state, weights=True)
        whole = torch.cat(xs)
        expected = qat.apply(qat.params(), qat.init(whole), whole)[1]
    same = all(torch.equal(a, b) for a, b in zip(merged.activations["layer"], expected.activations["layer"]))
    exit_rank(0 if same and merged.weights["layer"].max_val.shape == (6,) else 1)


def test_sync_merges_conv_transpose_activation_ranges_across_ranks():
    assert fork_ranks(_sync_rank, timeout=90) == [0, 0]


def test_compiled_training_step_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2), nn.ReLU())
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_PER_CHANNEL, 0.1),
                             qstats.moving_average_minmax(ACT_SPEC, 0.1), layers=nn.ConvTranspose1d)
    emb_qat = qstats.qat.prepare(_Lookup(nn.Embedding(12, 4, max_norm=1.0)), _embedding_observer(8),
                                 layers=nn.Embedding)
    for q, inputs in ((qat, torch.randn(2, 4, 5)), (emb_qat, _ids(0)[0])):
        def step(params, state, x, q=q):
            grads, (out, state) = torch.func.grad(
                lambda p, s: (lambda o: (_loss(o[0]), o))(q.apply(p, s, x)), has_aux=True)(params, state)
            return {k: v - 0.1 * grads[k] for k, v in params.items()}, state, out

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        params = {k: v.detach().clone() for k, v in q.params().items()}
        state = q.init(inputs)
        eager_values = compiled_values = (params, state)
        for _ in range(3):
            *eager_values, eager_out = step(*eager_values, inputs)
            *compiled_values, compiled_out = compiled(*compiled_values, inputs)
            torch.testing.assert_close(compiled_out, eager_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(compiled_values, eager_values, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Bad input


def test_integer_embedding_weight_is_refused_naming_the_layer():
    layer = nn.Embedding(12, 6)
    layer.weight = nn.Parameter(torch.randint(-5, 5, (12, 6)), requires_grad=False)
    with pytest.raises(TypeError, match="'embedding' .*torch.int64 weight"):
        qstats.qat.prepare(_Lookup(layer), _embedding_observer(8), layers=nn.Embedding)


def test_activation_observer_for_embeddings_only_is_refused():
    with pytest.raises(ValueError, match=r"activation_observer.*\['embedding'\].*integer ids"):
        qstats.qat.prepare(_Lookup(nn.Embedding(12, 6)), _embedding_observer(8), qstats.minmax(ACT_SPEC),
                           layers=nn.Embedding)


def test_embedding_bag_called_with_arguments_it_does_not_take_is_refused():
    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.EmbeddingBag(12, 6)

        def forward(self, ids, offsets):
            return self.embedding(ids, offsets, bags=offsets)

    with pytest.raises(ValueError, match="'embedding' \\(EmbeddingBag\\) is called with arguments"):
        qstats.qat.prepare(Wrong(), _embedding_observer(8), layers=nn.EmbeddingBag)


def test_default_layers_leave_embeddings_and_transposed_convolutions_in_float():
    model = nn.Sequential(nn.ConvTranspose1d(4, 4, 3), nn.Flatten(), nn.Linear(28, 2))
    qat = qstats.qat.prepare(model, qstats.minmax(W_PER_CHANNEL))
    assert qat.layers == ("2",)


def test_a_layer_type_prepare_cannot_quantize_is_refused():
    with pytest.raises(TypeError, match="cannot quantize a GRU; supported: .*ConvTranspose1d/2d/3d, Embedding"):
        qstats.qat.prepare(nn.Sequential(nn.GRU(4, 4)), qstats.minmax(W_PER_CHANNEL), layers=nn.GRU)


class _ScaledEmbedding(nn.Embedding):
    """Its own forward passes self.weight to F.embedding: traced through, quantized under its name."""

    def forward(self, ids):
        return F.embedding(ids, self.weight, self.padding_idx) * 2.0


class _ScaledConvTranspose(nn.ConvTranspose1d):
    def forward(self, x):
        return F.conv_transpose1d(x, self.weight, self.bias, self.stride, groups=self.groups) * 2.0


def test_traced_through_forwards_quantize_the_functional_call_as_torch_ao_fake_quantize():
    torch.manual_seed(0)
    embedding, conv = _ScaledEmbedding(12, 6, padding_idx=1), _ScaledConvTranspose(4, 6, 3, stride=2, groups=2)
    emb_qat = qstats.qat.prepare(_Lookup(embedding), qstats.minmax(_embedding_observer(8).spec), layers=nn.Embedding)
    conv_qat = qstats.qat.prepare(_Upsample(conv), qstats.minmax(W_PER_CHANNEL), layers=nn.ConvTranspose1d)
    ids, x = _ids(0)[0], torch.randn(2, 4, 5)
    emb_out, _ = emb_qat.apply(emb_qat.params(), emb_qat.init(ids), ids)
    conv_out, _ = conv_qat.apply(conv_qat.params(), conv_qat.init(x), x)
    rows = FakeQuantize(observer=torch.ao.quantization.PerChannelMinMaxObserver, quant_min=0, quant_max=255,
                        dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0)
    torch.testing.assert_close(emb_out, F.embedding(ids, rows(embedding.weight), 1) * 2.0, rtol=0, atol=0)
    per_group = [FakeQuantize(observer=torch.ao.quantization.PerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                              dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=1) for _ in range(2)]
    weight = torch.cat([fq(chunk) for fq, chunk in zip(per_group, conv.weight.chunk(2))])
    expected = F.relu(F.conv_transpose1d(x, weight, conv.bias, 2, groups=2) * 2.0)
    torch.testing.assert_close(conv_out, expected, rtol=1e-6, atol=1e-6)


def _unfused(config):
    """An XNNPACK QAT config with torchao's FakeQuantize for its FusedMovingAvgObsFakeQuantize (same observers):
    the fused kernel's symmetric scale is ``max(-min / 128, max / 127)``, its observers' (and qstats')
    ``max(-min, max) / 127.5`` (docs/differences.md)."""
    import dataclasses
    from torchao.quantization.pt2e.fake_quantize import FakeQuantize as PT2EFakeQuantize
    from torchao.quantization.pt2e.observer import MovingAverageMinMaxObserver as PT2EMovingAverage

    def unfused(spec):
        return dataclasses.replace(spec, observer_or_fake_quant_ctr=PT2EFakeQuantize.with_args(
            observer=PT2EMovingAverage, eps=2**-12))
    return dataclasses.replace(config, input_activation=unfused(config.input_activation),
                               output_activation=unfused(config.output_activation), weight=unfused(config.weight))


class _ConvTransposeRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        return F.relu(self.layer(x))


def test_conv_transpose_training_matches_pt2e_qat_with_xnnpack_quantizer():
    """torchao's PT2E QAT (``prepare_qat_pt2e``, its XNNPACK test quantizer's conv_transpose + relu, per-tensor
    weights, unfused fake quant): fake quant of the input and the weight, and of the ReLU's output, which the
    qstats loop fake-quantizes with `observe_fake_quantize` (prepare quantizes layer inputs only)."""
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    torch.manual_seed(0)
    model = _ConvTransposeRelu()
    x0 = torch.randn(2, 3, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(copy.deepcopy(model), (x0,)).module()
        quantizer = xnnpack.XNNPACKQuantizer().set_global(_unfused(xnnpack.get_symmetric_quantization_config(is_qat=True)))
        reference = pt2e.prepare_qat_pt2e(exported, quantizer)
    from torchao.quantization.pt2e.fake_quantize import FakeQuantizeBase
    fake_quants = [m for m in reference.modules() if isinstance(m, FakeQuantizeBase)]
    assert len(fake_quants) == 3  # input, weight, output
    act = qstats.moving_average_minmax(qstats.QuantSpec.from_torch_ao(
        torch.qint8, torch.per_tensor_affine, quant_min=-128, quant_max=127, eps=2**-12), 0.01)
    weight = qstats.moving_average_minmax(qstats.QuantSpec.from_torch_ao(
        torch.qint8, torch.per_tensor_symmetric, quant_min=-127, quant_max=127, eps=2**-12), 0.01)
    qat = qstats.qat.prepare(model, weight, act, layers=nn.ConvTranspose2d)
    params = {k: v.detach().clone() for k, v in qat.params().items()}
    state = qat.init(x0)
    out_state = act.init(torch.zeros(()))

    def loss_fn(params, x, state, out_state, phase):
        out, state = qat.apply(params, state, x, phase=phase)
        out, out_state = qstats.observe_fake_quantize(out, out_state, act, phase)
        return _loss(out), (out, state, out_state)

    grad_fn = torch.func.grad(loss_fn, argnums=(0, 1), has_aux=True)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        phase = SCHEDULE(step)
        x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(step)) * (1 + step)
        _set_phase(fake_quants, phase)
        optimizer.zero_grad()
        x_ref = x.clone().requires_grad_(True)
        expected = reference(x_ref)
        _loss(expected).backward()
        (grads, x_grad), (out, state, out_state) = grad_fn(params, x, state, out_state, phase)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"output at step {step}")
        torch.testing.assert_close(x_grad, x_ref.grad, rtol=1e-5, atol=1e-6, msg=f"input gradient at step {step}")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-6, msg=name)
        pass
        optimizer.step()
        params = {k: v - 0.05 * grads[k] for k, v in params.items()}
