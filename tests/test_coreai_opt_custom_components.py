"""coreai_opt specs naming calculators or fake quantizers of the user's own (registered with
coreai_opt's ``register`` decorators): `QuantSpec.from_coreai_opt` reproduces coreai_opt's own
components only, so it refuses the others by name instead of giving coreai_opt's min/max numbers.

Reference: Apple coreai_opt 0.4.0's ``RangeCalculatorBase``, ``QParamsCalculatorBase`` and
``FakeQuantizeImplBase`` registries and ``QuantizationComponentFactory``.
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402
from coreai_opt.quantization.spec.fake_quantize import FakeQuantizeImplBase, _DefaultFakeQuantizeImpl  # noqa: E402
from coreai_opt.quantization.spec.qparams_calculator import QParamsCalculatorBase, StaticQParamsCalculator  # noqa: E402
from coreai_opt.quantization.spec.range_calculator import MinMaxRangeCalculator, RangeCalculatorBase  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec


@RangeCalculatorBase.register("qstats_test_half_range")
class HalfRangeCalculator(MinMaxRangeCalculator):
    """A user's range: half the min/max one."""

    def _generate_min_max(self, tensor):
        lo, hi = super()._generate_min_max(tensor)
        return lo / 2, hi / 2


@QParamsCalculatorBase.register("qstats_test_doubled_scale")
class DoubledScaleCalculator(StaticQParamsCalculator):
    def _compute_scale_zero_point_minval(self, tensor, min_val, max_val):
        scale, zero_point, minval = super()._compute_scale_zero_point_minval(tensor, min_val, max_val)
        return scale * 2, zero_point, minval


@FakeQuantizeImplBase.register("qstats_test_identity")
class IdentityFakeQuantize(_DefaultFakeQuantizeImpl):
    def forward(self, tensor):
        return tensor


CUSTOM = [("range_calculator_cls", HalfRangeCalculator, "qstats_test_half_range"),
          ("qparam_calculator_cls", DoubledScaleCalculator, "qstats_test_doubled_scale"),
          ("fake_quantize_cls", IdentityFakeQuantize, "qstats_test_identity")]


@pytest.mark.parametrize("field,cls,key", CUSTOM, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_custom_component_is_refused_naming_it(field, cls, key):
    coreai_spec = QuantizationSpec(dtype=torch.int8, granularity={"type": "per_channel", "axis": 0}, **{field: cls})
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    ours = qstats.QuantSpec.from_coreai_opt(QuantizationSpec(dtype=torch.int8, granularity={"type": "per_channel", "axis": 0}),
                                            shape=w.shape)
    obs = qstats.memoryless_minmax(ours)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), ours)
    # what coreai_opt computes with the custom component differs from its own components' numbers
    fake_quantizer = QuantizationComponentFactory.create_fake_quantizer(coreai_spec, CompressionTargetTensor.WEIGHT)
    scale = fake_quantizer.qparams_calculator(w)[0]
    assert not torch.equal(fake_quantizer(w), qstats.fake_quantize(w, qp, ours)) or not torch.equal(
        scale.reshape(-1), qp.scale)
    for given, named in ((coreai_spec, cls.__name__), (coreai_spec.model_dump(), cls.__name__), ({field: cls}, cls.__name__),
                         ({field: key}, key), ({field: "minmax_typo"}, "minmax_typo")):
        with pytest.raises(ValueError, match=f"{field} .*{named}.*not coreai_opt's own"):
            qstats.QuantSpec.from_coreai_opt(given, shape=w.shape)


@pytest.mark.parametrize("field,names", [
    ("qparam_calculator_cls", ["default", "static", "moving_average", "global_minmax", "dynamic"]),
    ("range_calculator_cls", ["minmax"]), ("fake_quantize_cls", ["default"]),
])
def test_coreai_opts_own_components_are_accepted_by_name_and_class(field, names):
    for name in names:
        coreai_spec = QuantizationSpec(**{field: name})
        target = "activation" if name == "dynamic" else "weight"  # coreai_opt's dynamic calculator: activations only
        expected = qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, target=target)
        for given in (coreai_spec, coreai_spec.model_dump(), {field: name}, {field: getattr(coreai_spec, field)}):
            assert qstats.QuantSpec.from_coreai_opt(given, target=target) == expected
