"""calibrate / fake_quantized / report on models whose parameters are not plain tensors of their
own: accelerate-offloaded modules (meta parameters, data in the hook), stacked experts sharing one
memory (an expanded, stride-0 stack); a torch.compile wrapper run before the hooks exist; and
report's checks of its batches. Statistics are compared with torch.ao observers and plain torch
computations written here."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

import qstats

sys.path.insert(0, str(Path(__file__).parent))
from _shared import ExpertsLayer, TiedExperts, qwen3_moe_config  # noqa: E402

accelerate = pytest.importorskip("accelerate")

ASYM = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
PER_CHANNEL = qstats.QuantSpec.from_torch_ao(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()


def _recipe():
    return qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), spec=PER_CHANNEL),
        qstats.Rule("Linear", sites=("input",), spec=ASYM),
    ])


def _offloaded(model):
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    assert model[0].weight.device.type == "meta"
    return model


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_offloaded_weights_are_observed_and_measured_as_torch_ao():
    # the weight states were silently meta tensors (no data); report's SQNR then failed deep in torch
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    reference = _mlp()
    model, recipe = _offloaded(_mlp()), _recipe()
    states = _quiet(qstats.calibrate, model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    inputs = {"0": batches, "2": [torch.relu(reference[0](x)).detach() for x in batches]}
    for path in ("0", "2"):
        weight = getattr(reference, path).weight.detach()
        observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        assert torch.equal(qparams[path]["weight"].scale, scale)
        assert torch.equal(qparams[path]["weight"].zero_point.long(), zero_point.long())
        activation = MinMaxObserver(dtype=torch.quint8)
        for x in inputs[path]:
            activation(x)
        scale, zero_point = activation.calculate_qparams()
        assert torch.equal(qparams[path]["input"].scale, scale.reshape(()))
        # report's weight SQNR against torch's fake quantization of the float weight
        fake = torch.fake_quantize_per_channel_affine(
            weight, qparams[path]["weight"].scale, qparams[path]["weight"].zero_point, 0, -128, 127
        )
        expected = 10 * torch.log10(weight.pow(2).sum() / (weight - fake).pow(2).sum())
        rows = _quiet(qstats.report, states, qparams, model, recipe)
        row = [r for r in rows if (r.module, r.site) == (path, "weight")]
        assert row[0].sqnr_db == pytest.approx(float(expected), rel=1e-5)
    assert model[0].weight.device.type == "meta"  # still offloaded afterwards


def test_offloaded_or_unloaded_weights_are_refused_by_name():
    recipe = _recipe()
    qparams = qstats.compute_qparams_tree(_quiet(qstats.calibrate, _mlp(), [torch.randn(2, 6)], recipe, progress=False),
                                          recipe, _mlp())
    model = _offloaded(_mlp())
    with pytest.raises(ValueError, match=r"fake_quantized: module '0' parameter 'weight' is on the meta device"):
        with qstats.fake_quantized(model, qparams, recipe):
            pass
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in _mlp().named_parameters()]
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(6, 5))
    with pytest.raises(ValueError, match=r"calibrate: parameter 'weight' of module '0' is on the meta device"):
        qstats.calibrate(empty, [], recipe, progress=False)


def test_expanded_experts_errors_name_the_shared_memory_and_a_copy_calibrates():
    # the error said only "no per-expert matmul ... was found", hiding that the experts share memory
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    batch = (x, torch.arange(10).remainder(3).reshape(10, 1), torch.ones(10, 1))
    shared = r"the experts of \[.*'down_proj'\] share one memory \(stride 0"
    recipe = qstats.Recipe([qstats.Rule("TiedExperts", sites=("down_proj.input",), spec=qstats.QuantSpec())])
    with pytest.raises(ValueError, match=r"calibrate: site 'down_proj.input' .*" + shared):
        qstats.calibrate(ExpertsLayer(TiedExperts(3)), [batch], recipe, progress=False)
    inputs = qstats.Recipe([qstats.Rule("TiedExperts", sites=("input",), spec=qstats.QuantSpec())])
    tied = ExpertsLayer(TiedExperts(3))
    qparams = qstats.compute_qparams_tree(qstats.calibrate(tied, [batch], inputs, progress=False), inputs, tied)
    with pytest.raises(ValueError, match=r"fake_quantized: site\(s\) \['input'\] .*" + shared):
        with qstats.fake_quantized(tied, qparams, inputs):
            tied(*batch)
    # the fix the message gives: each expert its own copy; states against plain torch per expert
    own = ExpertsLayer(TiedExperts(3, own_copies=True))
    state = qstats.calibrate(own, [batch], recipe, progress=False)["experts"]["down_proj.input"]
    with torch.no_grad():
        for expert in range(3):
            rows = own.experts.intermediate(x[batch[1][:, 0] == expert], expert)
            assert int(state.count[expert].sum()) == rows.numel()
            assert torch.equal(state.min_val[expert].reshape(()), rows.min())
            assert torch.equal(state.max_val[expert].reshape(()), rows.max())


def test_offloaded_experts_name_the_offload_in_calibrate_and_report():
    # calibrate's error hid the cause; report silently measured nothing for the experts' input
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config()).eval()
    batches = [torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    inputs = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input",), spec=qstats.QuantSpec())])
    states = _quiet(qstats.calibrate, model, batches, inputs, progress=False)
    qparams = qstats.compute_qparams_tree(states, inputs, model)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    offloaded = r"\['gate_up_proj', 'down_proj'\] are offloaded by accelerate"
    with pytest.raises(ValueError, match=r"report: site\(s\) \['input'\] of the experts module .*" + offloaded):
        _quiet(qstats.report, states, qparams, model, inputs, batches=batches)
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("down_proj.input",), spec=qstats.QuantSpec())])
    with pytest.raises(ValueError, match=r"calibrate: site 'down_proj.input' .*\['down_proj'\] are offloaded"):
        _quiet(qstats.calibrate, model, batches, recipe, progress=False)


def test_report_refuses_one_batch_and_weights_that_are_not_tensors_and_warns_in_training_mode():
    # a Tensor was iterated row by row, a dict key by key (TypeError deep in F.linear); a list weight
    # raised AttributeError
    model, recipe = _mlp(), _recipe()
    batches = [torch.randn(4, 6)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for one in (batches[0], {"input": batches[0]}):
        with pytest.raises(TypeError, match=r"report: batches must be an iterable of batches \(got a single"):
            qstats.report(states, qparams, model, recipe, batches=one)
    with pytest.raises(TypeError, match=r"report: observation_weight\(batch\) must return a tensor or None, got list"):
        qstats.report(states, qparams, model, recipe, batches=batches, observation_weight=lambda b: [1] * 4)
    dropping = torch.nn.Sequential(model[0], torch.nn.Dropout(0.5), model[2]).train()
    with pytest.warns(UserWarning, match=r"report: module '1' \(Dropout\) is in training mode"):
        qstats.report(states, qparams, dropping, recipe, batches=batches)


def test_a_compiled_wrapper_run_before_calibrate_is_refused_and_reset_calibrates_as_torch_ao():
    # the graph compiled before the hooks called none of them: calibrate returned the weights only,
    # with a warning saying the model was not run
    model = _mlp()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=ASYM)])
    batches = [torch.randn(3, 6, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    torch.compiler.reset()
    compiled = torch.compile(model, backend="eager")
    try:
        with torch.no_grad():
            compiled(batches[0])
        with pytest.raises(ValueError, match=r"calibrate: the model ran 2 batch\(es\) but none of its hooks ran: "
                                             r"a torch.compile'd model that ran before"):
            qstats.calibrate(compiled, batches, recipe, progress=False)
        with pytest.warns(qstats.UncalibratedWarning, match=r"call torch.compiler.reset\(\) first"):
            with qstats.observing(compiled, recipe), torch.no_grad():
                compiled(batches[0])
        torch.compiler.reset()
        states = qstats.calibrate(compiled, batches, recipe, progress=False)
    finally:
        torch.compiler.reset()
    observer = MinMaxObserver(dtype=torch.quint8)
    for x in batches:
        observer(x)
    assert torch.equal(states["0"]["input"].min_val, observer.min_val)
    assert torch.equal(states["0"]["input"].max_val, observer.max_val)


def test_a_plan_resolved_on_the_compiled_wrapper_calibrates_it_as_torch_ao():
    # Recipe.resolve(torch.compile(model)) named the sites "_orig_mod.0", and calibrate refused that
    # Plan with the same wrapper ("resolved on another model"); both now see the model's own paths
    model = _mlp()
    batches = [torch.randn(3, 6, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    torch.compiler.reset()
    try:
        compiled = torch.compile(model, backend="eager")
        plan = _recipe().resolve(compiled)
        states = qstats.calibrate(compiled, batches, plan, progress=False)
    finally:
        torch.compiler.reset()
    assert sorted(states) == ["0", "2"]
    weights = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    weights(model[0].weight.detach())
    inputs = MinMaxObserver(dtype=torch.quint8)
    for x in batches:
        inputs(x)
    assert torch.equal(states["0"]["weight"].max_val, weights.max_val)
    assert torch.equal(states["0"]["input"].min_val, inputs.min_val)
    assert torch.equal(states["0"]["input"].max_val, inputs.max_val)
