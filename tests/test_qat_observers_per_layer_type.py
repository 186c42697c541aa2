"""`qstats.qat.prepare` with observers per layer type: ``{layer type: Observer or None}`` mappings.

Reference: torch.ao's ``prepare_qat_fx`` with a ``QConfigMapping`` giving embeddings
``default_embedding_qat_qconfig`` (weight-only, per-row float qparams) and every other layer a QAT
qconfig (int8 weights per tensor or per channel, uint8 activations), trained side by side over several
SGD steps: outputs, parameter gradients and the final qparams of every fake-quantized point.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    MovingAveragePerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
    default_embedding_qat_qconfig,
    default_qat_qconfig,
)
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats
from _shared import exit_rank, fork_ranks, gloo_group
from qstats import QATSchedule

STEPS = 6
SCHEDULE = QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=4)
LR = 0.05
# torch.ao's default_fake_quant (activations of default_qat_qconfig): reduced uint8 range, averaging 0.01
ACT_OBSERVER = qstats.moving_average_minmax(
    qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine, reduce_range=True, quant_min=0,
                                   quant_max=255), 0.01)
EMBEDDING_OBSERVER = qstats.moving_average_minmax(
    qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine_float_qparams, ch_axis=0), 1.0)
PER_CHANNEL_QAT_QCONFIG = QConfig(
    activation=default_qat_qconfig.activation,
    weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
WEIGHT_QCONFIGS = {  # name -> (torch.ao qconfig of the non-embedding layers, the qstats weight observer)
    "per_tensor": (default_qat_qconfig, qstats.moving_average_minmax(
        qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_symmetric), 0.01)),
    "per_channel": (PER_CHANNEL_QAT_QCONFIG, qstats.moving_average_minmax(
        qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0), 0.01)),
}


class _Tagger(nn.Module):
    """ids ``[batch, 7]`` -> Embedding -> Conv1d (the 7 positions as channels) -> Linear -> ReLU -> Linear:
    every layer takes the previous one's output as it is (torch.ao's FX gives a transpose's output its
    input's fake quant, which would then observe twice per step)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(20, 6)
        self.conv = nn.Conv1d(7, 5, 3, padding=1)
        self.hidden = nn.Linear(6, 8)
        self.relu = nn.ReLU()
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.relu(self.hidden(self.conv(self.embedding(ids)))))


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 20, (4, 7), generator=torch.Generator().manual_seed(step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)).sum()


def _torch_ao_reference(model: nn.Module, qconfig) -> tuple:
    """``(prepared model, {"kind.layer": FakeQuantize}, [other FakeQuantize])``: torch.ao's prepare_qat_fx with
    embeddings on ``default_embedding_qat_qconfig`` and the rest on ``qconfig``. Its fake quants that feed a
    layer are the layers' input points; the others (the model's output) are returned apart: qstats
    fake-quantizes layer inputs only."""
    mapping = QConfigMapping().set_global(qconfig).set_object_type(nn.Embedding, default_embedding_qat_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = prepare_qat_fx(copy.deepcopy(model).train(), mapping, (_ids(0),))
    points, others = {}, []
    for node in reference.graph.nodes:
        module = reference.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, FakeQuantize):
            (user,) = node.users
            if user.op == "call_module" and hasattr(reference.get_submodule(user.target), "weight_fake_quant"):
                points[f"activations.{user.target}"] = module
            else:
                others.append(module)
        elif module is not None:
            points[f"weights.{node.target}"] = module.weight_fake_quant
    # "relu" is fused into "hidden" (LinearReLU), whose output is "head"'s input: the model's output is the
    # one point qstats lacks
    assert len(others) == 1 and len(points) == 7 and len({id(fq) for fq in points.values()}) == 7
    return reference, points, others


def _qstats_observers(weight_observer) -> dict:
    return dict(weight_observer={nn.Embedding: EMBEDDING_OBSERVER, nn.Module: weight_observer},
                activation_observer={nn.Module: ACT_OBSERVER})


@pytest.mark.parametrize("weights", sorted(WEIGHT_QCONFIGS))
def test_embedding_linear_conv_with_their_own_observers_match_torch_ao_qconfig_mapping(weights):
    qconfig, weight_observer = WEIGHT_QCONFIGS[weights]
    torch.manual_seed(0)
    model = _Tagger()
    reference, points, others = _torch_ao_reference(model, qconfig)
    qat = qstats.qat.prepare(model, layers=(nn.Embedding, nn.Linear, nn.Conv1d), **_qstats_observers(weight_observer))
    assert qat.layers == ("embedding", "conv", "hidden", "head") and qat.activation_layers == ("conv", "hidden", "head")
    assert qat.weight_observers["embedding"] is EMBEDDING_OBSERVER and qat.weight_observers["conv"] is weight_observer

    params = {k: v.detach().clone() for k, v in qat.params().items()}
    state = qat.init(_ids(0))

    def loss_fn(params, state, ids, phase):
        out, new_state = qat.apply(params, state, ids, phase=phase)
        return _loss(out), (out, new_state)

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        phase = SCHEDULE(step)
        for fq in points.values():
            fq.enable_observer(phase.observe)
            fq.enable_fake_quant(phase.fake_quantize)
        for fq in others:
            fq.disable_observer()
            fq.disable_fake_quant()
        optimizer.zero_grad()
        expected = reference(_ids(step))
        _loss(expected).backward()
        grads, (out, state) = grad_fn(params, state, _ids(step), phase)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6, msg=f"output at step {step}")
        assert set(grads) == {name for name, _ in reference.named_parameters()}
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{name} at step {step}")
        optimizer.step()
        params = {k: v - LR * grads[k] for k, v in params.items()}

    observers = {"weights": qat.weight_observers, "activations": qat.activation_observers}
    for kind in observers:
        assert set(getattr(state, kind)) == {name.split(".")[1] for name in points if name.startswith(kind)}
        for layer, layer_state in getattr(state, kind).items():
            qp = qstats.compute_qparams(layer_state, observers[kind][layer].spec)
            fq = points[f"{kind}.{layer}"]
            torch.testing.assert_close(qp.scale.reshape(-1), fq.scale.reshape(-1), rtol=1e-6, atol=0,
                                       msg=f"{kind} of {layer}")
            torch.testing.assert_close(qp.zero_point.reshape(-1).float(), fq.zero_point.reshape(-1).float(),
                                       rtol=1e-6, atol=1e-6, msg=f"{kind} of {layer}")


# ------------------------------------------------------------------------------------------------
# The mapping's rules


W_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)
ACT_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
LAYERS = (nn.Embedding, nn.Linear, nn.Conv1d)


class _OwnLinear(nn.Linear):
    pass


def test_one_observer_for_every_type_is_the_single_observer_form():
    torch.manual_seed(0)
    model = _Tagger()
    weight, activation = qstats.minmax(W_SPEC), qstats.minmax(ACT_SPEC)
    single = qstats.qat.prepare(model, weight, activation, layers=(nn.Linear, nn.Conv1d))
    mapped = qstats.qat.prepare(model, {nn.Module: weight}, {nn.Module: activation}, layers=(nn.Linear, nn.Conv1d))
    results = [qat.apply(qat.params(), qat.init(_ids(0)), _ids(1)) for qat in (single, mapped)]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(torch.stack([s.min_val for s in results[0][1].activations.values()]),
                       torch.stack([s.min_val for s in results[1][1].activations.values()]))
    assert single.weight_observers == mapped.weight_observers == {"conv": weight, "hidden": weight, "head": weight}


def test_types_without_an_entry_or_with_none_stay_in_float_as_torch_ao_without_a_global_qconfig():
    # torch.ao's QConfigMapping gives a module whose type it does not name the global qconfig: None
    # unless set_global, and then the module stays in float
    torch.manual_seed(0)
    model = _Tagger()
    weight = qstats.minmax(W_SPEC)
    for weights in ({nn.Linear: weight}, {nn.Conv1d: None, nn.Embedding: None, nn.Module: weight}):
        qat = qstats.qat.prepare(model, weights, {nn.Conv1d: qstats.minmax(ACT_SPEC)}, layers=LAYERS)
        ids = _ids(2)
        out, state = qat.apply(qat.params(), qat.init(ids), ids)
        assert set(state.weights) == {"hidden", "head"} and set(state.activations) == {"conv"}
        # independently: torch.ao FakeQuantize modules at those points only
        act_fq = FakeQuantize(observer=torch.ao.quantization.MinMaxObserver, quant_min=0, quant_max=255,
                              dtype=torch.quint8, qscheme=torch.per_tensor_affine)
        weight_fq = [FakeQuantize(observer=torch.ao.quantization.PerChannelMinMaxObserver, quant_min=-128,
                                  quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
                     for _ in range(2)]
        x = model.conv(act_fq(model.embedding(ids)))
        x = torch.relu(torch.nn.functional.linear(x, weight_fq[0](model.hidden.weight), model.hidden.bias))
        expected = torch.nn.functional.linear(x, weight_fq[1](model.head.weight), model.head.bias)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_a_layer_takes_the_first_type_it_is_an_instance_of():
    model = nn.Sequential(_OwnLinear(4, 4), nn.Linear(4, 2))
    own, other = qstats.minmax(W_SPEC), qstats.memoryless_minmax(W_SPEC)
    qat = qstats.qat.prepare(model, {_OwnLinear: own, nn.Linear: other})
    assert qat.weight_observers == {"0": own, "1": other} and qat.activation_observers == {}


@pytest.mark.parametrize("weights, activations, error, match", [
    ({nn.Linear: "W", _OwnLinear: "W"}, None, ValueError, "names _OwnLinear after Linear.*put _OwnLinear first"),
    ({nn.BatchNorm1d: "W"}, None, ValueError, r"weight_observer names BatchNorm1d, which is no type of layers"),
    ({nn.EmbeddingBag: "W", nn.Module: "W"}, None, ValueError, "names EmbeddingBag.*add EmbeddingBag to layers="),
    ({"Linear": "W"}, None, TypeError, "weight_observer has the key 'Linear'; its keys must be layer types"),
    ({nn.Linear: "minmax"}, None, TypeError, r"weight_observer\[Linear\] must be a qstats Observer or None, got str"),
    (None, {nn.Embedding: "A", nn.Module: "A"}, ValueError, r"activation_observer maps \['Embedding'\] to an observer"),
    (None, ["A"], TypeError, "activation_observer must be a qstats Observer, None, or a mapping"),
])
def test_bad_mappings_are_refused_naming_the_entry(weights, activations, error, match):
    observers = {"W": qstats.minmax(W_SPEC), "A": qstats.minmax(ACT_SPEC)}

    def resolved(given):
        if isinstance(given, dict):
            return {key: observers.get(value, value) for key, value in given.items()}
        return [observers[value] for value in given] if isinstance(given, list) else given

    with pytest.raises(error, match=match):
        qstats.qat.prepare(_Tagger(), resolved(weights), resolved(activations), layers=LAYERS)


# ------------------------------------------------------------------------------------------------
# Downstream of prepare: sync, save/load, learnable ranges, compile, dynamic activations


UINT4_SPEC = qstats.QuantSpec("uint4", "asymmetric")


def _mixed_qat():
    """Embedding (per-row float qparams), Conv1d and Linears with observers of other families and specs."""
    torch.manual_seed(0)
    weights = {nn.Embedding: EMBEDDING_OBSERVER, nn.Conv1d: qstats.minmax(W_SPEC), nn.Linear: qstats.memoryless_minmax(W_SPEC)}
    activations = {nn.Conv1d: qstats.minmax(ACT_SPEC), nn.Linear: qstats.moving_average_minmax(UINT4_SPEC, 0.1)}
    return qstats.qat.prepare(_Tagger(), weights, activations, layers=LAYERS)


def _trained_state(qat, steps, first: int = 0):
    state = qat.init(_ids(first))
    for step in range(first, first + steps):
        _, state = qat.apply(qat.params(), state, _ids(step))
    return state


def _sync_mixed_rank(rank, port):
    """Exit 0 where every activation state after sync is the merge of both ranks' with its own observer
    (computed here from both ranks' batches), and weight states stay this rank's."""
    qat = _mixed_qat()
    states = [_trained_state(qat, 2, first=10 * r) for r in range(2)]
    with gloo_group(rank, port):
        synced = qat.sync(states[rank])
    ok = all(torch.equal(synced.weights[k].min_val, states[rank].weights[k].min_val) for k in synced.weights)
    for layer, observer in qat.activation_observers.items():
        expected = observer.merge(states[0].activations[layer], states[1].activations[layer])
        ok = ok and all(torch.equal(a, b) for a, b in zip(synced.activations[layer], expected))
    ok = ok and any(not torch.equal(states[0].activations[k].min_val, states[1].activations[k].min_val)
                    for k in qat.activation_observers)  # the ranks' ranges differ before the merge
    exit_rank(0 if ok else 1)


def test_sync_merges_every_activation_state_with_its_own_observer_on_two_ranks():
    # spawned: a rank forked after this process ran autograd (the tests above) can hang in torch's thread pools
    assert fork_ranks(_sync_mixed_rank, timeout=120, start_method="spawn") == [0, 0]


def test_saved_state_resumes_training_as_the_one_kept_in_memory(tmp_path):
    qat = _mixed_qat()
    state = _trained_state(qat, 2)
    qstats.save(tmp_path / "state.safetensors", state)
    loaded = qstats.load(tmp_path / "state.safetensors")
    assert type(loaded) is qstats.QATState
    for kind in ("weights", "activations"):
        for layer, layer_state in getattr(state, kind).items():
            assert type(getattr(loaded, kind)[layer]) is type(layer_state)
    ids = _ids(7)
    (out, resumed), (expected, kept) = (qat.apply(qat.params(), s, ids) for s in (loaded, state))
    assert torch.equal(out, expected)
    assert torch.equal(resumed.activations["head"].min_val, kept.activations["head"].min_val)


def test_learnable_ranges_start_from_each_layers_own_spec_and_train():
    qat = _mixed_qat()
    state = _trained_state(qat, 2)
    ranges = qat.learnable_ranges(state)
    assert set(ranges) == {"activations"} and set(ranges["activations"]) == {"conv", "hidden", "head"}
    for layer, learned in ranges["activations"].items():
        spec = qat.activation_observers[layer].spec
        expected = qstats.lsq_init(state.activations[layer], spec)
        assert torch.equal(learned.scale, expected.scale) and torch.equal(learned.zero_point, expected.zero_point)
    out, _ = qat.apply(qat.params(), state, _ids(3), ranges=ranges)
    _loss(out).backward()
    assert all(learned.scale.grad is not None for learned in ranges["activations"].values())


def test_compiled_step_equals_eager_with_observers_per_layer():
    qat = _mixed_qat()
    state = _trained_state(qat, 1)
    phase = qstats.QATPhase()

    def step(params, state, ids):
        return qat.apply(params, state, ids, phase=phase)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    (out, new_state), (expected, expected_state) = (f(qat.params(), state, _ids(4)) for f in (compiled, step))
    assert torch.equal(out, expected)
    for kind in ("weights", "activations"):
        for layer, layer_state in getattr(expected_state, kind).items():
            assert all(torch.equal(a, b) for a, b in zip(getattr(new_state, kind)[layer], layer_state))


def test_dynamic_activation_ranges_of_some_types_beside_static_ones():
    # per-token activation ranges are each batch's own (no range to learn, nothing to sync); the conv's
    # per-tensor range stays static, learnable and synchronised
    per_token = qstats.memoryless_minmax(qstats.QuantSpec("int8", "asymmetric", granularity=qstats.PerToken()))
    qat = qstats.qat.prepare(_Tagger(), qstats.minmax(W_SPEC), {nn.Conv1d: qstats.minmax(ACT_SPEC), nn.Linear: per_token},
                             layers=(nn.Linear, nn.Conv1d))
    assert qat.dynamic_layers == ("hidden", "head") and not qat.dynamic_activations
    state = _trained_state(qat, 1)
    ranges = qat.learnable_ranges(state)
    assert set(ranges["activations"]) == {"conv"}
    with pytest.raises(ValueError, match=r"ranges\['activations'\] gives learned ranges of \['hidden'\]"):
        qat.apply(qat.params(), state, _ids(1), ranges={"activations": {"hidden": ranges["activations"]["conv"]}})
    out, _ = qat.apply(qat.params(), state, _ids(1), ranges=ranges)
    assert out.shape == (4, 5, 3)
