"""Modules the calibration forward never reached (a head it does not run, a vision tower under text
data): their weight states saw data, their activation states none, so `compute_qparams_tree` gives
them weight qparams only. The export refuses a static (calibrated) activation site it has no qparams
for (written without it, an FP8 recipe's module would be weights-only), and writes a dynamic
(per-token) one as a reached module's."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402


class TwoHeads(torch.nn.Module):
    """Two Linear heads; the forward runs ``head`` only, or both with ``both``."""

    def __init__(self, both: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(32, 32)
        self.draft = torch.nn.Linear(32, 32)
        self.both = both

    def forward(self, x):
        return self.head(x) + (self.draft(x) if self.both else 0)


def _export(model, scheme, path):
    plan = qstats.Recipe.from_scheme(scheme).resolve(model)
    batches = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, plan, progress=False), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qparams, qstats.export.compressed_tensors(model, qparams, str(path), plan)


STATIC_INT8 = {"weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
               "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)}


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4", "static-int8"])
def test_a_static_activation_site_that_saw_no_data_is_refused(tmp_path, scheme):
    scheme = STATIC_INT8 if scheme == "static-int8" else scheme
    assert "input" in qstats.Recipe.from_scheme(scheme).resolve(TwoHeads()).sites["draft"]
    with pytest.raises(ValueError, match=r"draft: the recipe calibrates its site\(s\) \['input'\]"):
        _export(TwoHeads(), scheme, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme", ["W8A8", "FP8_DYNAMIC", "MXFP4"])
def test_a_dynamic_activation_site_is_written_whether_or_not_the_forward_reached_it(tmp_path, scheme):
    qparams, written = _export(TwoHeads(), scheme, tmp_path / "one")
    assert sorted(qparams["draft"]) == ["weight"]  # no state, no qparams for its input
    _, reference = _export(TwoHeads(both=True), scheme, tmp_path / "both")
    assert written == reference
    (group,) = written["config_groups"].values()
    assert group["input_activations"]["dynamic"] is True
    QuantizationConfig.model_validate(written)
