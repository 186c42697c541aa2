"""`QuantSpec.from_coreai_opt` refuses the ``qformulation`` and ``"dynamic"`` calculator settings
coreai_opt refuses, naming them, and takes those it accepts.

Reference: Apple coreai_opt 0.4.0's ``QuantizationSpec`` validators (``qformulation`` values,
``"minval"`` only for integer targets without e8m0 scales, ``symmetric_with_clipping`` not with a
dynamic calculator) and ``QuantizationComponentFactory.create_qparams_calculator`` (a dynamic
calculator for activations only, without ``float_range``).
"""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec
TARGETS = {"weight": CompressionTargetTensor.WEIGHT, "activation": CompressionTargetTensor.ACTIVATION}


def _coreai_refuses(fields, target):
    try:
        QuantizationComponentFactory.create_qparams_calculator(QuantizationSpec(**fields), TARGETS[target])
    except ValueError:
        return True
    return False


REFUSED = [
    ({"qformulation": "min_val"}, "activation", "qformulation"),
    ({"dtype": torch.float8_e4m3fn, "qformulation": "minval"}, "weight", "qformulation"),
    ({"dtype": torch.int8, "scale_dtype": torch.float8_e8m0fnu, "qformulation": "minval"}, "weight", "qformulation"),
    ({"dtype": torch.float4_e2m1fn_x2, "qformulation": "minval"}, "weight", "qformulation"),
    ({"qparam_calculator_cls": "dynamic"}, "weight", "dynamic"),
    ({"qparam_calculator_cls": "dynamic", "qscheme": "symmetric_with_clipping"}, "activation", "dynamic"),
    ({"qparam_calculator_cls": "dynamic", "float_range": [None, 6.0]}, "activation", "dynamic"),
]
ACCEPTED = [
    ({"qformulation": "minval", "dtype": torch.uint4, "qscheme": "asymmetric"}, "weight"),
    ({"qformulation": "zp", "dtype": torch.float8_e5m2}, "activation"),
    ({"qparam_calculator_cls": "dynamic", "qscheme": "asymmetric"}, "activation"),
    ({"qparam_calculator_cls": "static", "qscheme": "symmetric_with_clipping", "float_range": [-1.0, 1.0]}, "weight"),
]


@pytest.mark.parametrize("fields,target,message", REFUSED, ids=str)
def test_what_coreai_opt_refuses_is_refused(fields, target, message):
    assert _coreai_refuses(fields, target)
    with pytest.raises(ValueError, match=message):
        qstats.QuantSpec.from_coreai_opt(fields, target=target)


@pytest.mark.parametrize("fields,target", ACCEPTED, ids=str)
def test_what_coreai_opt_accepts_is_accepted(fields, target):
    assert not _coreai_refuses(fields, target)
    coreai_spec = QuantizationSpec(**fields)
    for given in (fields, coreai_spec, coreai_spec.model_dump()):
        assert qstats.QuantSpec.from_coreai_opt(given, target=target).convention == "coreai_opt"
