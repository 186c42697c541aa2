"""torchao users' flows against torchao itself: ``QstatsPT2EObserver`` in ``prepare_pt2e`` /
``convert_pt2e`` where the ``QuantizationSpec`` and ``spec=`` disagree or the ``QuantizationSpec``
names a ``ch_axis`` (torchao's ``PerChannelMinMaxObserver`` is the reference),
``convention="torchao"`` bf16/fp16 arithmetic under ``torch.compile``, and ``from_torchao`` of a
``QuantizeTensorToFloat8Kwargs`` (``Float8Tensor.from_hp`` is the reference).
"""

import copy
import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

pt2e = pytest.importorskip("torchao.quantization.pt2e")
quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
quantizer_module = pytest.importorskip("torchao.quantization.pt2e.quantizer")
from qstats.torchao_pt2e import QstatsPT2EObserver, QstatsPT2EPerChannelObserver  # noqa: E402

ACT = dict(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_affine)


class _LinearQuantizer(quantizer_module.Quantizer):
    """Annotates every linear: input and output with ``act``, weight with ``weight`` (QuantizationSpecs)."""

    def __init__(self, act, weight):
        super().__init__()
        self.act, self.weight = act, weight

    def annotate(self, model):
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                node.meta["quantization_annotation"] = quantizer_module.QuantizationAnnotation(
                    input_qspec_map={node.args[0]: self.act, node.args[1]: self.weight}, output_qspec=self.act,
                    _annotated=True)
        return model

    def validate(self, model):
        pass


def _convert(act_ctr, weight_ctr, weight_args):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(3)]
    act = quantizer_module.QuantizationSpec(observer_or_fake_quant_ctr=act_ctr, **ACT)
    weight = quantizer_module.QuantizationSpec(observer_or_fake_quant_ctr=weight_ctr, **weight_args)
    exported = torch.export.export(copy.deepcopy(plain), (batches[0],)).module()
    prepared = quantize_pt2e.prepare_pt2e(exported, _LinearQuantizer(act, weight))
    for batch in batches:
        prepared(batch)
    return quantize_pt2e.convert_pt2e(prepared)


def _weight_args(ch_axis):
    return dict(dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=torch.per_channel_symmetric, ch_axis=ch_axis)


@pytest.mark.parametrize("ch_axis", (0, 1))
def test_per_channel_observer_takes_the_quantization_specs_ch_axis(ch_axis):
    """prepare_pt2e passes ch_axis only to classes named PerChannel...: QstatsPT2EObserver took axis
    0 for a QuantizationSpec with ch_axis=1 (torchao's observer reduces along 1)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(9)) * 2
    reference = _convert(pt2e.MinMaxObserver, pt2e.PerChannelMinMaxObserver, _weight_args(ch_axis))
    ours = _convert(QstatsPT2EObserver, QstatsPT2EPerChannelObserver, _weight_args(ch_axis))
    assert torch.equal(ours(x), reference(x))
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, quant_min=-127, quant_max=127,
                                          ch_axis=ch_axis)
    given = _convert(QstatsPT2EObserver, QstatsPT2EPerChannelObserver.with_args(spec=spec), _weight_args(ch_axis))
    assert torch.equal(given(x), reference(x))


@pytest.mark.parametrize(
    "spec, weight_args, named",
    [
        # the quantizer annotates per-channel int8 [-127, 127]; the spec is per-tensor int4: the graph
        # held per-tensor [-8, 7] q/dq nodes where torchao's observer writes per-channel ones
        (qstats.QuantSpec(dtype="int4"), _weight_args(0), "quant_min -127"),
        (qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_symmetric), _weight_args(0), "per_channel True"),
        (qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine), _weight_args(0), "dtype torch.int8"),
        (qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, quant_min=-127, quant_max=127,
                                        ch_axis=0), _weight_args(1), "ch_axis 1"),
        # the quantizer annotates symmetric weights (a backend reads it); the spec's zero points are not 0
        (qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_affine, quant_min=-127, quant_max=127,
                                        ch_axis=0), _weight_args(0), "qscheme torch.per_channel_symmetric"),
    ],
    ids=("range", "qscheme", "dtype", "ch_axis", "symmetric"),
)
def test_spec_that_disagrees_with_the_quantization_spec_is_refused(spec, weight_args, named):
    reference = _convert(pt2e.MinMaxObserver, pt2e.PerChannelMinMaxObserver, weight_args)
    written = {tuple(n.args[3:7]) for n in reference.graph.nodes  # (axis, quant_min, quant_max, dtype)
               if n.op == "call_function" and "dequantize_per_channel" in str(n.target)}
    assert written == {(weight_args["ch_axis"], weight_args["quant_min"], weight_args["quant_max"], torch.int8)}
    with pytest.raises(ValueError, match=named):
        _convert(QstatsPT2EObserver, QstatsPT2EPerChannelObserver.with_args(spec=spec), weight_args)


def test_half_precision_arithmetic_under_torch_compile_with_emulated_precision_casts():
    """Int4 weight-only (tinygemm: uint4, ZeroPointDomain.FLOAT, groups of 32) on a bf16 weight:
    compiled qstats equals torchao's eager fake quantization where inductor emulates the bf16
    roundings (docs/formats.md; without it inductor keeps the intermediates in float32)."""
    qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
    mapping, domain = qp_lib.MappingType.ASYMMETRIC, qp_lib.ZeroPointDomain.FLOAT
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    scale, zero_point = qp_lib._choose_qparams_affine_tinygemm(w, mapping, (1, 32), torch.uint4)
    codes = qp_lib._quantize_affine_tinygemm_no_dtype_cast(w, (1, 32), scale, zero_point, 0, 15)
    reference = qp_lib._dequantize_affine_tinygemm_no_dtype_check(codes, (1, 32), scale, zero_point, 0, 15,
                                                                  torch.bfloat16)
    spec = qstats.QuantSpec.from_torchao(torch.uint4, mapping_type=mapping, zero_point_domain=domain,
                                         granularity=qstats.PerGroup(32), input_dtype=torch.bfloat16)

    def fake_quantize(x):
        observer = qstats.minmax(spec)
        return qstats.fake_quantize(x, qstats.compute_qparams(observer.update(observer.init(x), x), spec), spec)

    assert torch.equal(fake_quantize(w), reference)
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = torch.compile(fake_quantize, fullgraph=True)(w)
    torch._dynamo.reset()
    assert torch.equal(compiled, reference)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("float8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
def test_float8_kwargs_object_matches_float8_tensor(float8_dtype, input_dtype):
    """from_torchao(QuantizeTensorToFloat8Kwargs(...)) (Float8Tensor's weight and activation
    arguments; it used to be refused as 'not a target of choose_qparams_affine') against
    Float8Tensor.from_hp: scales and dequantized values, per row and per tensor."""
    float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
    from torchao.quantization.granularity import PerRow, PerTensor

    w = (torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, 64)).to(input_dtype)
    for granularity in (PerRow(), PerTensor()):
        config = float8.QuantizeTensorToFloat8Kwargs(float8_dtype=float8_dtype, granularity=granularity)
        reference = float8.Float8Tensor.from_hp(w, float8_dtype=float8_dtype, granularity=granularity)
        spec = qstats.QuantSpec.from_torchao(config, input_dtype=input_dtype)
        observer = qstats.minmax(spec)
        qp = qstats.compute_qparams(observer.update(observer.init(w), w), spec)
        assert torch.equal(qp.scale.reshape(reference.scale.shape), reference.scale)
        assert torch.equal(qstats.quantize(w, qp, spec).view(torch.uint8), reference.qdata.view(torch.uint8))
        assert torch.equal(qstats.fake_quantize(w, qp, spec), reference.dequantize())
    with pytest.raises(ValueError, match="hp_value_lb/hp_value_ub"):
        qstats.QuantSpec.from_torchao(float8.QuantizeTensorToFloat8Kwargs(hp_value_ub=1200.0))
