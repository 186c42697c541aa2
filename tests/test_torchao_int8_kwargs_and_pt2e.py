"""torchao users' flows the other torchao tests do not reach, against torchao itself.

``from_torchao(QuantizeTensorToInt8Kwargs)`` against ``Int8Tensor.from_hp`` (the arguments of
Int8WeightOnlyConfig / Int8DynamicActivationInt8WeightConfig), torchao's ZeroPointDomain.FLOAT
spec in ``QstatsPT2EObserver`` (its zero point is in the input's units, the graph's in code units)
and torchao's ``AffineQuantizedMinMaxObserver`` over several batches.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

qp_lib = pytest.importorskip("torchao.quantization.quant_primitives")
int8_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.int8.int8_tensor")
quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
quantizer_module = pytest.importorskip("torchao.quantization.pt2e.quantizer")
from torchao.quantization import granularity as G  # noqa: E402
from torchao.quantization.observer import AffineQuantizedMinMaxObserver  # noqa: E402
from torchao.quantization.pt2e import PerChannelMinMaxObserver  # noqa: E402
from torchao.quantization.utils import get_block_size  # noqa: E402

from qstats.torchao_pt2e import QstatsPT2EObserver, QstatsPT2EPerChannelObserver  # noqa: E402
from qstats.torch_ao import QstatsObserver  # noqa: E402

MappingType, ZeroPointDomain = qp_lib.MappingType, qp_lib.ZeroPointDomain


def _observe(spec, *batches):
    obs = qstats.minmax(spec)
    state = obs.init(batches[0])
    for batch in batches:
        state = obs.update(state, batch)
    return qstats.compute_qparams(state, spec)


def _weight(dtype):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    w[3] *= 1e-5  # a row whose scale is below float32's eps: Int8Tensor's eps floors it
    w[4] = 0.0
    w[5] += 0.05  # an all-positive row (asymmetric zero points away from 0)
    return w.to(dtype)


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC), ids=lambda m: m.name)
@pytest.mark.parametrize("granularity", (G.PerRow(), G.PerTensor()), ids=str)
@pytest.mark.parametrize("reduce_range", (False, True))
def test_int8_kwargs_object_matches_int8_tensor(input_dtype, mapping, granularity, reduce_range):
    """from_torchao(QuantizeTensorToInt8Kwargs) raised ValueError ('not a target of
    choose_qparams_affine'); the natural from_torchao(torch.int8, granularity=PerRow(),
    input_dtype=torch.bfloat16) differs from Int8Tensor (11,695 of 131,072 codes of a 256x512 bf16
    weight: its scales are bf16, Int8Tensor's float32, and eps the input's). Now the kwargs object
    gives Int8Tensor.from_hp's scales, zero points, codes and dequantized values."""
    config = int8_tensor.QuantizeTensorToInt8Kwargs(granularity=granularity, mapping_type=mapping,
                                                    reduce_range=reduce_range)
    w = _weight(input_dtype)
    reference = int8_tensor.Int8Tensor.from_hp(w, granularity, mapping_type=mapping, reduce_range=reduce_range)
    spec = qstats.QuantSpec.from_torchao(config, input_dtype=input_dtype)
    qp = _observe(spec, w)
    assert torch.equal(qp.scale.reshape(reference.scale.shape), reference.scale)
    assert torch.equal(qp.zero_point.reshape(reference.zero_point.shape).to(torch.int8), reference.zero_point)
    assert torch.equal(qstats.quantize(w, qp, spec).to(torch.int8), reference.qdata)
    out = qstats.fake_quantize(w, qp, spec)
    assert out.dtype == input_dtype and torch.equal(out, reference.dequantize())


def test_int8_kwargs_object_takes_only_input_dtype():
    config = int8_tensor.QuantizeTensorToInt8Kwargs(granularity=G.PerRow())
    with pytest.raises(ValueError, match="unexpected arguments.*eps"):
        qstats.QuantSpec.from_torchao(config, eps=1e-5)


# --------------------------------------------------------------------------------------------
# PT2E: torchao's float zero points


class _WeightQuantizer(quantizer_module.Quantizer):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def annotate(self, model):
        for node in model.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
                node.meta["quantization_annotation"] = quantizer_module.QuantizationAnnotation(
                    input_qspec_map={node.args[1]: self.weight}, _annotated=True)
        return model

    def validate(self, model):
        pass


FLOAT_QPARAMS = dict(dtype=torch.uint8, quant_min=0, quant_max=15, qscheme=torch.per_channel_affine_float_qparams,
                     ch_axis=0)


def _convert(weight_ctr):
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 8)
    with torch.no_grad():
        plain.weight.add_(0.3)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    weight = quantizer_module.QuantizationSpec(observer_or_fake_quant_ctr=weight_ctr, **FLOAT_QPARAMS)
    prepared = quantize_pt2e.prepare_pt2e(torch.export.export(plain, (x,)).module(), _WeightQuantizer(weight))
    prepared(x)
    return quantize_pt2e.convert_pt2e(prepared)(x)


def test_torchao_float_zero_point_spec_is_refused_in_pt2e():
    """A torchao ZeroPointDomain.FLOAT spec went into the graph's per_channel_affine_float_qparams
    nodes with its zero point in the input's units (torch.ao's are in code units): the linear's
    outputs moved by 0.6 from torchao's own tinygemm weights. Now refused; the torch.ao spec of the
    same qscheme equals torchao's PerChannelMinMaxObserver in the graph."""
    spec = qstats.QuantSpec.from_torchao(torch.uint4, mapping_type=MappingType.ASYMMETRIC,
                                         zero_point_domain=ZeroPointDomain.FLOAT, granularity=G.PerAxis(0))
    with pytest.raises(ValueError, match="float zero point"):
        _convert(QstatsPT2EPerChannelObserver.with_args(spec=spec))
    with pytest.raises(ValueError, match="code units"):
        QstatsPT2EObserver(spec=spec)
    with pytest.raises(ValueError, match="code units"):  # the eager drop-in's calculate_qparams too
        QstatsObserver(spec=spec)
    torch_ao_spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_channel_affine_float_qparams,
                                                   quant_min=0, quant_max=15)
    ours = _convert(QstatsPT2EPerChannelObserver.with_args(spec=torch_ao_spec))
    assert torch.equal(ours, _convert(PerChannelMinMaxObserver))


# --------------------------------------------------------------------------------------------
# torchao's own observer


@pytest.mark.parametrize("input_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("mapping", (MappingType.SYMMETRIC, MappingType.ASYMMETRIC,
                                     MappingType.SYMMETRIC_NO_CLIPPING_ERR), ids=lambda m: m.name)
@pytest.mark.parametrize("granularity", (G.PerTensor(), G.PerAxis(1), G.PerRow(), G.PerGroup(16)), ids=str)
def test_affine_quantized_min_max_observer_over_batches(input_dtype, mapping, granularity):
    """torchao's AffineQuantizedMinMaxObserver (choose_qparams_affine_with_min_max) over three
    batches of different ranges: qparams and codes equal qstats' minmax under from_torchao."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 32, generator=g) * s + o).to(input_dtype) for s, o in ((1, 0), (3, 2), (0.01, -1))]
    observer = AffineQuantizedMinMaxObserver(mapping, torch.int8, granularity)
    for batch in batches:
        observer(batch)
    scale, zero_point = observer.calculate_qparams()
    spec = qstats.QuantSpec.from_torchao(torch.int8, mapping_type=mapping, granularity=granularity,
                                         input_dtype=input_dtype)
    qp = _observe(spec, *batches)
    assert torch.equal(qp.scale.reshape(scale.shape), scale.float())
    assert torch.equal(qp.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    block_size = get_block_size(batches[1].shape, granularity)
    codes = qp_lib.quantize_affine(batches[1], block_size, scale, zero_point, torch.int8)
    assert torch.equal(qstats.quantize(batches[1], qp, spec).to(torch.int8), codes)
