"""torchao PT2E flows no other test ran, each against the same flow with torchao's own observers:
EmbeddingQuantizer inside a ComposableQuantizer, X86InductorQuantizer's dynamic and QAT
configurations and float16/bfloat16 graphs, and a custom quantizer with a DerivedQuantizationSpec
bias (input scale times weight scale), SharedQuantizationSpec add/cat and a fixed-qparams sigmoid,
whose converted program is saved and loaded with torch.export. Every q/dq node's scale and zero point
and the outputs equal torchao's."""

import dataclasses
import io
import warnings

import pytest
import torch

import qstats

pt2e = pytest.importorskip("torchao.quantization.pt2e")
quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
quantizer = pytest.importorskip("torchao.quantization.pt2e.quantizer")
x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
embedding_quantizer = pytest.importorskip("torchao.quantization.pt2e.quantizer.embedding_quantizer")
composable = pytest.importorskip("torchao.quantization.pt2e.quantizer.composable_quantizer")
xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
fake_quantize = pytest.importorskip("torchao.quantization.pt2e.fake_quantize")

from qstats.torchao_pt2e import QstatsPT2EObserver, QstatsPT2EPerChannelObserver  # noqa: E402
# torchao's HistogramObserver becomes MinMaxObserver in both flows there (bit-exact comparisons)
from test_torchao_pt2e_xnnpack_quantizer import _qparams, _swapped  # noqa: E402

warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")


def _assert_same_graph_qparams(ours, reference, at_least):
    mine, theirs = _qparams(ours), _qparams(reference)
    assert len(theirs) >= at_least and [t for t, _ in mine] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(mine, theirs):
        for p, q in zip(a, b):
            assert (torch.equal(p, q) and p.dtype == q.dtype) if isinstance(q, torch.Tensor) else p == q


class _EmbeddingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4)

    def forward(self, i):
        return self.fc(self.emb(i))


def test_embedding_quantizer_in_a_composable_quantizer(monkeypatch):
    """EmbeddingQuantizer's per-channel float-qparams weight observer (uint8) replaced by the qstats
    drop-in, composed with XNNPACKQuantizer: the embedding's scales and zero points and the outputs are
    torchao's PerChannelMinMaxObserver's."""
    original = embedding_quantizer.get_embedding_operators_config
    idx = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(0))

    def run(observer):
        def config():
            operators = original()
            weight = dataclasses.replace(operators.config.weight, observer_or_fake_quant_ctr=observer)
            return operators._replace(config=dataclasses.replace(operators.config, weight=weight))

        monkeypatch.setattr(embedding_quantizer, "get_embedding_operators_config", config)
        composed = composable.ComposableQuantizer([
            embedding_quantizer.EmbeddingQuantizer(),
            xnnpack.XNNPACKQuantizer().set_global(xnnpack.get_symmetric_quantization_config())])
        torch.manual_seed(0)
        exported = torch.export.export(_EmbeddingNet().eval(), (idx,)).module()
        prepared = quantize_pt2e.prepare_pt2e(exported, composed)
        prepared(idx)
        return quantize_pt2e.convert_pt2e(prepared)

    ours = run(QstatsPT2EPerChannelObserver.with_args(eps=2**-12))
    reference = run(pt2e.PerChannelMinMaxObserver.with_args(eps=2**-12))
    assert any("per_channel" in t for t, _ in _qparams(reference))
    _assert_same_graph_qparams(ours, reference, at_least=3)
    assert torch.equal(ours(idx), reference(idx))


class _Linears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("dynamic,qat,dtype", [(True, False, torch.float32), (False, True, torch.float32),
                                               (True, True, torch.float32), (False, False, torch.bfloat16),
                                               (False, False, torch.float16)])
def test_x86_inductor_dynamic_qat_and_half_precision_graphs(dynamic, qat, dtype):
    config = x86.get_default_x86_inductor_quantization_config(is_dynamic=dynamic, is_qat=qat)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g) * (1 + i)).to(dtype) for i in range(4)]

    def run(ours):
        def replace(spec):
            return None if spec is None else dataclasses.replace(
                spec, observer_or_fake_quant_ctr=_swapped(spec.observer_or_fake_quant_ctr, ours))

        swapped = dataclasses.replace(config, input_activation=replace(config.input_activation),
                                      output_activation=replace(config.output_activation),
                                      weight=replace(config.weight))
        torch.manual_seed(0)
        exported = torch.export.export(_Linears().to(dtype).train(qat), (batches[0],)).module()
        prepare = quantize_pt2e.prepare_qat_pt2e if qat else quantize_pt2e.prepare_pt2e
        prepared = prepare(exported, x86.X86InductorQuantizer().set_global(swapped))
        for batch in batches:
            prepared(batch)
        return quantize_pt2e.convert_pt2e(prepared)

    ours, reference = run(True), run(False)
    _assert_same_graph_qparams(ours, reference, at_least=4)
    x = batches[2] * 1.5
    out = ours(x)
    assert torch.equal(out, reference(x))
    torch.manual_seed(0)
    assert not torch.equal(out, _Linears().to(dtype)(x))  # quantized: the comparison can fail


class _SharedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.conv2 = torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        a = self.conv(x)
        return torch.sigmoid(torch.cat([a, a + self.conv2(x)], 1))


def _bias_qparams(observers):
    (activation_scale, _), (weight_scale, _) = (obs.calculate_qparams() for obs in observers)
    scale = (activation_scale * weight_scale).float()
    return scale, torch.zeros_like(scale, dtype=torch.int32)


class _SpecsQuantizer(quantizer.Quantizer):
    """Convs with a derived int32 bias (input scale times weight scale, per channel), add and cat
    sharing their first input's observer, a sigmoid with fixed qparams (1/256, 0)."""

    def __init__(self, activation, weight, fixed):
        super().__init__()
        self.activation, self.weight, self.fixed = activation, weight, fixed

    def annotate(self, model):
        def spec(ctr):
            return quantizer.QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255,
                                              qscheme=torch.per_tensor_affine, observer_or_fake_quant_ctr=ctr)

        act = spec(self.activation)
        weight = quantizer.QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127,
                                            qscheme=torch.per_channel_symmetric, ch_axis=0,
                                            observer_or_fake_quant_ctr=self.weight)
        aten = torch.ops.aten
        for n in model.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target == aten.conv2d.default:
                x, w, b = n.args[:3]
                bias = quantizer.DerivedQuantizationSpec(
                    derived_from=[(x, n), (w, n)], derive_qparams_fn=_bias_qparams, dtype=torch.int32,
                    quant_min=-2**31, quant_max=2**31 - 1, qscheme=torch.per_channel_symmetric, ch_axis=0)
                inputs, output = {x: act, w: weight, b: bias}, act
            elif n.target in (aten.add.Tensor, aten.cat.default):
                first, *others = n.args[0] if n.target == aten.cat.default else n.args
                shared = quantizer.SharedQuantizationSpec((first, n))
                inputs, output = {first: act, **{other: shared for other in others}}, shared
            elif n.target == aten.sigmoid.default:
                inputs, output = {n.args[0]: act}, spec(self.fixed)
            else:
                continue
            n.meta["quantization_annotation"] = quantizer.QuantizationAnnotation(
                input_qspec_map=inputs, output_qspec=output, _annotated=True)
        return model

    def validate(self, model):
        pass


@pytest.mark.parametrize("moving", [False, True])
def test_derived_bias_shared_add_cat_and_fixed_qparams_specs_saved_and_loaded(moving):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 6, 6, generator=g) * (1 + i) for i in range(4)]
    if moving:
        activations = (QstatsPT2EObserver.with_args(observer=qstats.moving_average_minmax, averaging_constant=0.3),
                       pt2e.MovingAverageMinMaxObserver.with_args(averaging_constant=0.3))
    else:
        activations = (QstatsPT2EObserver, pt2e.MinMaxObserver)
    fixed = (QstatsPT2EObserver.with_args(observer=qstats.fixed_qparams, scale=1 / 256, zero_point=0),
             pt2e.FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0))

    def run(ours):
        index = 0 if ours else 1
        weight = QstatsPT2EPerChannelObserver if ours else pt2e.PerChannelMinMaxObserver
        torch.manual_seed(0)
        exported = torch.export.export(_SharedNet().eval(), (batches[0],)).module()
        prepared = quantize_pt2e.prepare_pt2e(exported, _SpecsQuantizer(activations[index], weight, fixed[index]))
        for batch in batches:
            prepared(batch)
        converted = quantize_pt2e.convert_pt2e(prepared)
        buffer = io.BytesIO()
        torch.export.save(torch.export.export(converted, (batches[0],)), buffer)
        buffer.seek(0)
        return converted, torch.export.load(buffer).module()

    (ours, ours_loaded), (reference, reference_loaded) = run(True), run(False)
    _assert_same_graph_qparams(ours, reference, at_least=12)
    targets = [t for t, _ in _qparams(reference)]
    assert sum("per_channel" in t for t in targets) >= 4  # the weights' and the derived biases'
    x = batches[3] * 1.5
    out = ours(x)
    assert torch.equal(out, reference(x)) and torch.equal(ours_loaded(x), reference_loaded(x))
    assert torch.equal(ours_loaded(x), out)
    torch.manual_seed(0)
    assert not torch.equal(out, _SharedNet().eval()(x))

