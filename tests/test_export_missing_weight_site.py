"""A states tree saved by `qstats.save` for one recipe, loaded and turned into qparams with another that also
quantizes the weights: `compute_qparams_tree` has no weight qparams to give (the file holds no weight state),
and `qstats.export.compressed_tensors` refuses the module, saying that the tree lacks the parameter site (a
weight is observed before the first batch: no calibration data is missing), not that the calibration forward
never reached it."""

from __future__ import annotations

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

WEIGHT = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                   strategy="channel"))
INPUT = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, type="int", symmetric=False,
                                                                  strategy="tensor"))


def test_a_weight_site_missing_from_a_loaded_states_tree_is_named_as_such(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    inputs_only = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=INPUT)])
    states = qstats.calibrate(model, [torch.randn(4, 16) for _ in range(2)], inputs_only, progress=False)
    qstats.save(str(tmp_path / "states.safetensors"), states)

    both = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=WEIGHT),
                          qstats.Rule("Linear", sites=("input",), spec=INPUT)])
    qparams = qstats.compute_qparams_tree(qstats.load(str(tmp_path / "states.safetensors")), both, model)
    assert sorted(qparams["0"]) == ["input"]
    with pytest.raises(ValueError) as raised:
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "out"), both)
    message = str(raised.value)
    assert message.startswith("export.compressed_tensors: 0: the recipe calibrates its site(s) ['weight']")
    assert "'weight' is a parameter, observed before the first batch, so the states or qparams tree lacks" in message
    assert "never reached" not in message
