"""torch.export of a model that holds drop-ins (a PT2E-prepared model, saved and loaded to calibrate
elsewhere): torch.ao's observers write their buffers in place, which the exported program keeps as
buffer mutations, so the loaded module calibrates on; the drop-in must too (it replaced its
buffers by new attributes, which the exported graph left out: the loaded module observed nothing)."""

import copy
import io
import warnings

import pytest
import torch
import torch.ao.quantization as tq

from qstats import torch_ao

warnings.filterwarnings("ignore")


class _Observed(torch.nn.Module):
    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def forward(self, x):
        return self.observer(x) * 2


def _saved_and_loaded(model, example):
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(model, (example,)), buffer)
    buffer.seek(0)
    return torch.export.load(buffer).module()


def _copy_buffers(source, target):
    """``source``'s buffers set on ``target`` by name (a loaded module's ``state_dict`` carries no
    observer version, so torch.ao's per-channel observers would read it as version 1's)."""
    for key, value in source.named_buffers():
        owner, _, name = key.rpartition(".")
        setattr(target.get_submodule(owner), name, value.clone())


_PER_TENSOR = (lambda: torch_ao.QstatsObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
               lambda: tq.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric))
_PER_CHANNEL = (lambda: torch_ao.QstatsObserver(qscheme=torch.per_channel_affine, ch_axis=1),
                lambda: tq.PerChannelMinMaxObserver(qscheme=torch.per_channel_affine, ch_axis=1))


@pytest.mark.parametrize("ours, reference", [_PER_TENSOR, _PER_CHANNEL], ids=("per_tensor", "per_channel"))
def test_an_exported_and_loaded_model_calibrates_on_as_torch_aos(ours, reference):
    torch.manual_seed(0)
    batches = [torch.randn(4, 6) * scale for scale in (1.0, 5.0, 0.5)]
    qparams = []
    for make in (ours, reference):
        model = _Observed(make())
        model(batches[0])
        loaded = _saved_and_loaded(model, batches[0])
        for batch in batches[1:]:
            loaded(batch)
        fresh = _Observed(make())
        _copy_buffers(loaded, fresh)
        qparams.append(fresh.observer.calculate_qparams())
    (scale, zero_point), (reference_scale, reference_zero_point) = qparams
    assert torch.equal(scale, reference_scale) and torch.equal(zero_point, reference_zero_point)


@pytest.mark.parametrize("ours, reference", [_PER_TENSOR, _PER_CHANNEL], ids=("per_tensor", "per_channel"))
def test_a_model_calibrated_under_inference_mode_exports_and_calibrates_on_as_torch_aos(ours, reference):
    """Calibrated under torch.inference_mode (torch.ao's buffers stay normal tensors, written in place):
    the drop-in's buffers were inference tensors, which torch.export could not write in place."""
    torch.manual_seed(0)
    batches = [torch.randn(4, 6) * scale for scale in (1.0, 5.0)]
    qparams = []
    for make in (ours, reference):
        model = _Observed(make())
        with torch.inference_mode():
            model(batches[0])
        loaded = _saved_and_loaded(model, batches[0])
        loaded(batches[1])
        fresh = _Observed(make())
        _copy_buffers(loaded, fresh)
        qparams.append(fresh.observer.calculate_qparams())
    assert all(torch.equal(a, b) for a, b in zip(*qparams))


def test_exporting_before_any_data_is_refused_by_name():
    """Before any data the drop-in's state is empty, so the exported graph would build it from every
    call's input alone (torch.ao's per-channel observers do: their loaded module does not hold the
    extremes of what it saw); it raises instead."""
    batches = [torch.randn(4, 6) * 5, torch.randn(4, 6)]
    reference = _saved_and_loaded(_Observed(_PER_CHANNEL[1]()), batches[0])
    for batch in batches:
        reference(batch)
    assert not torch.equal(reference.observer.min_val, torch.cat(batches).amin(0))  # not what it saw
    with pytest.raises(RuntimeError, match="seen no data.*run it on a batch first"):
        torch.export.export(_Observed(_PER_CHANNEL[0]()), (batches[0],))


def test_a_pt2e_prepared_model_exported_and_loaded_converts_as_torch_aos():
    """torchao's PT2E: prepare, calibrate, export and save; load, calibrate on, load the state back
    into the prepared model and convert: the outputs are torch.ao's observers' bit for bit."""
    pt2e = pytest.importorskip("torchao.quantization.pt2e")
    quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    quantizer_module = pytest.importorskip("torchao.quantization.pt2e.quantizer")
    from qstats.torchao_pt2e import QstatsPT2EObserver, QstatsPT2EPerChannelObserver

    class LinearQuantizer(quantizer_module.Quantizer):
        def __init__(self, activation, weight):
            super().__init__()
            self.activation, self.weight = activation, weight

        def annotate(self, model):
            act = quantizer_module.QuantizationSpec(
                dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine,
                observer_or_fake_quant_ctr=self.activation)
            weight = quantizer_module.QuantizationSpec(
                dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=0,
                observer_or_fake_quant_ctr=self.weight)
            for node in model.graph.nodes:
                if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                    node.meta["quantization_annotation"] = quantizer_module.QuantizationAnnotation(
                        input_qspec_map={node.args[0]: act, node.args[1]: weight}, output_qspec=act, _annotated=True)
            return model

        def validate(self, model):
            pass

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    batches = [torch.randn(4, 16) * scale for scale in (1.0, 4.0, 0.5)]

    def run(activation, weight):
        exported = torch.export.export(copy.deepcopy(plain), (batches[0],)).module()
        prepared = quantize_pt2e.prepare_pt2e(exported, LinearQuantizer(activation, weight))
        prepared(batches[0])
        loaded = _saved_and_loaded(prepared, batches[0])
        for batch in batches[1:]:
            loaded(batch)
        _copy_buffers(loaded, prepared)
        return quantize_pt2e.convert_pt2e(prepared)(batches[1])

    ours = run(QstatsPT2EObserver, QstatsPT2EPerChannelObserver)
    assert torch.equal(ours, run(pt2e.MinMaxObserver, pt2e.PerChannelMinMaxObserver))


def test_a_placeholder_exports_before_any_data_as_torch_aos():
    """A placeholder keeps no statistics (torch.ao's saves no entries): a dynamic model's exports as it is."""
    for observer in (torch_ao.default_dynamic_quant_observer(), tq.default_dynamic_quant_observer()):
        x = torch.randn(4, 6)
        assert torch.equal(_saved_and_loaded(_Observed(observer), x)(x), x * 2)


@pytest.mark.parametrize("calibrated", (True, False))
def test_a_fixed_qparams_observer_exports_as_torch_aos(calibrated):
    """A sigmoid's fixed qparams: torch.ao's FixedQParamsObserver exports (its forward reads nothing);
    the drop-in failed in torch.export on its constants' checks (a data-dependent guard)."""
    qparams = []
    for observer in (torch_ao.default_fixed_qparams_range_0to1_observer(),
                     tq.default_fixed_qparams_range_0to1_observer()):
        x = torch.rand(4, 6)
        if calibrated:
            observer(x)
        loaded = _saved_and_loaded(_Observed(observer), x)
        assert torch.equal(loaded(x), x * 2)
        qparams.append(observer.calculate_qparams())
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*qparams))


def test_a_jit_traced_model_calibrates_on_as_torch_aos():
    """torch.jit.trace records torch.ao's in-place writes as torch.export does: the traced module of a
    calibrated per-tensor observer calibrates on (the drop-in's observed nothing)."""
    torch.manual_seed(0)
    batches = [torch.randn(4, 6), torch.randn(4, 6) * 50]
    extremes = []
    for observer in _PER_TENSOR[0](), _PER_TENSOR[1]():
        model = _Observed(observer)
        model(batches[0])
        traced = torch.jit.trace(model, (batches[0],))
        traced(batches[1])
        extremes.append([traced.observer.min_val, traced.observer.max_val])
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(*extremes))
    assert float(extremes[1][1]) == float(torch.cat(batches).max())
