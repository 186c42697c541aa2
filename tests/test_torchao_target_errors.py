"""from_torchao given an MX/NVFP4 element type as target_dtype (as to_mx names it): the error says
which arguments build those formats, and the spec they build equals torchao's ``to_mx``."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402


@pytest.mark.parametrize("elem", (torch.float4_e2m1fn_x2, "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"), ids=str)
def test_mx_element_as_target_names_the_mx_and_nvfp4_arguments(elem):
    with pytest.raises(ValueError, match="choose_qparams_affine.*elem_dtype= and scaling_mode=.*nvfp4=True"):
        qstats.QuantSpec.from_torchao(elem)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7)) * 3
    spec = qstats.QuantSpec.from_torchao(elem_dtype=elem, scaling_mode=ScaleCalculationMode.FLOOR)
    obs = qstats.minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    torchao_elem = torch.float4_e2m1fn_x2 if elem == "fp4_e2m1" else elem
    scale, data = mx.to_mx(x, torchao_elem, 32, ScaleCalculationMode.FLOOR)
    reference = mx.to_dtype(data, scale, torchao_elem, 32, torch.float32)
    assert torch.equal(qstats.fake_quantize(x, qp, spec), reference)
