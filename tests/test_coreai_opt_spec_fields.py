"""`QuantSpec.from_coreai_opt` reads every field of a coreai_opt spec given as a dict or keywords,
or refuses it by name, as coreai_opt's own ``QuantizationSpec`` validates it.

Reference: Apple coreai_opt 0.4.0's ``QuantizationSpec`` (its ``float_range`` validator).
"""

import re
import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
QuantizationSpec = spec_lib.QuantizationSpec

BAD_FLOAT_RANGES = [[], [-1.0, 0.0, 1.0], [0.5, None], [None, -0.5], [-1.0, -2.0], [-1.0, -1.0], [True, None],
                    "[-1, 1]", [-1.0, "1"]]


@pytest.mark.parametrize("float_range", BAD_FLOAT_RANGES, ids=str)
def test_a_float_range_coreai_opt_refuses_is_refused_in_a_dict_or_keywords(float_range):
    with pytest.raises(ValueError, match="float_range"):
        QuantizationSpec(dtype=torch.int8, float_range=float_range)
    with pytest.raises(ValueError, match="float_range"):
        qstats.QuantSpec.from_coreai_opt({"dtype": torch.int8, "float_range": float_range})
    with pytest.raises(ValueError, match="float_range"):
        qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, float_range=float_range)


@pytest.mark.parametrize("float_range", [(-1, 2), [-1.5, None], (None, 0), [None, None]], ids=str)
def test_a_float_range_coreai_opt_accepts_gives_the_specs_own(float_range):
    fields = {"dtype": torch.int4, "qscheme": "asymmetric", "float_range": float_range}
    coreai_spec = QuantizationSpec(**fields)
    for input_dtype in (torch.float32, torch.bfloat16):
        ours = qstats.QuantSpec.from_coreai_opt(fields, input_dtype=input_dtype)
        assert ours == qstats.QuantSpec.from_coreai_opt(coreai_spec, input_dtype=input_dtype)


class _EpsSpec(QuantizationSpec):
    eps: float = 0.1


class _AveragingSpec(QuantizationSpec):
    averaging_constant: float = 0.5


def test_a_spec_subclass_field_is_refused_by_name():
    # coreai_opt's factory passes a subclass's fields to the components it builds (get_extra_args)
    coreai_spec = _EpsSpec(dtype=torch.int8)
    assert coreai_spec.get_extra_args() == {"eps": 0.1}
    with pytest.raises(ValueError, match=r"\['eps'\].*_EpsSpec"):
        qstats.QuantSpec.from_coreai_opt(coreai_spec)


def test_a_spec_subclass_averaging_constant_is_the_moving_averages():
    from coreai_opt.config.spec import CompressionTargetTensor
    from coreai_opt.quantization.spec.factory import QuantizationComponentFactory

    coreai_spec = _AveragingSpec(dtype=torch.int8, qparam_calculator_cls="moving_average")
    calculator = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.ACTIVATION)
    assert calculator.averaging_constant == 0.5
    spec = qstats.QuantSpec.from_coreai_opt(coreai_spec, target="activation")
    assert spec == qstats.QuantSpec.from_coreai_opt(dtype=torch.int8, target="activation")


DUMPED = [(torch.int4, "symmetric_with_clipping"), (torch.uint2, "asymmetric"), (torch.int8, "symmetric"),
          (torch.uint8, "symmetric_with_clipping"), (torch.float8_e5m2, "symmetric"), (torch.float4_e2m1fn_x2, "symmetric")]


@pytest.mark.parametrize("dtype,qscheme", DUMPED, ids=str)
def test_a_model_dump_round_trips_and_a_derived_field_it_contradicts_is_refused(dtype, qscheme):
    coreai_spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, granularity={"type": "per_channel", "axis": 0})
    dumped = coreai_spec.model_dump()  # holds the fields coreai_opt derives: n_bits, target_dtype, quant_min, ...
    assert qstats.QuantSpec.from_coreai_opt(dumped) == qstats.QuantSpec.from_coreai_opt(coreai_spec)
    qmin, qmax = coreai_spec.quant_min, coreai_spec.quant_max
    for field, wrong in [("quant_min", qmin + 1), ("quant_max", qmax - 1), ("_quant_range", (qmin, qmax - 1)),
                         ("n_bits", coreai_spec.n_bits + 1), ("target_dtype", torch.int16)]:
        # coreai_opt drops these keys and derives them again: a dict asking for another range is a mistake
        assert getattr(QuantizationSpec(**{**dumped, field: wrong}), field) == dumped[field]
        with pytest.raises(ValueError, match=f"{field}.*{re.escape(repr(dumped[field]))}"):
            qstats.QuantSpec.from_coreai_opt({**dumped, field: wrong})


@pytest.mark.parametrize("field", ["dtype", "qscheme", "qformulation", "granularity", "fake_quantize_cls",
                                   "qparam_calculator_cls", "range_calculator_cls", "float_range"])
def test_a_field_given_as_none_that_coreai_opt_refuses_is_refused_not_defaulted(field):
    with pytest.raises(ValueError, match=field):
        QuantizationSpec(**{field: None})
    for given in ({field: None}, {"dtype": torch.uint4, field: None}):
        with pytest.raises(ValueError, match=f"{field} None"):
            qstats.QuantSpec.from_coreai_opt(given)
    with pytest.raises(ValueError, match=f"{field} None"):
        qstats.QuantSpec.from_coreai_opt(**{field: None})


def test_scale_dtype_none_is_coreai_opts_default():
    coreai_spec = QuantizationSpec(dtype=torch.float4_e2m1fn_x2, scale_dtype=None)  # fp4: None means e8m0
    assert coreai_spec.scale_dtype == torch.float8_e8m0fnu
    ours = qstats.QuantSpec.from_coreai_opt(dtype=torch.float4_e2m1fn_x2, scale_dtype=None)
    assert ours == qstats.QuantSpec.from_coreai_opt(coreai_spec) and ours.scale_dtype == "e8m0"
