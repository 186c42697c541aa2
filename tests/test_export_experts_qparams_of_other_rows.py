"""qstats.export.compressed_tensors of stacked experts given the qparams of experts of another intermediate
size (a Qwen3-MoE of ``moe_intermediate_size`` 16 calibrated, one of 8 exported): ``gate_up_proj``'s
scales hold 32 rows per expert where the weights hold 16. Cut into gate and up rows they fit each
projection's own shape checks, so the export wrote gate scales as ``gate_proj``'s and gate scales again
as ``up_proj``'s; it must refuse them naming the site, as it refuses a Linear's scales of other rows."""

from __future__ import annotations

import os

import pytest
import torch
from _shared import qwen3_moe_config

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402

PATH = "model.layers.0.mlp.experts"
WEIGHTS = {
    "int8-channel": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "int4-group": QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
    "nvfp4": NVFP4["weights"],
}


def _model(intermediate):
    torch.manual_seed(0)
    config = qwen3_moe_config(hidden_size=32, moe_intermediate_size=intermediate, num_hidden_layers=1, head_dim=16,
                              num_experts=4, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _weight_qparams(model, args):
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"),
                                        spec=qstats.QuantSpec.from_compressed_tensors(args))])
    states = qstats.calibrate(model, [], recipe, progress=False)
    return recipe, qstats.compute_qparams_tree(states, recipe, model)


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_gate_up_qparams_of_another_intermediate_size_are_refused(tmp_path, case, single_thread_quiet):
    recipe, qparams = _weight_qparams(_model(16), WEIGHTS[case])
    assert qparams[PATH]["gate_up_proj"].scale.shape[1] == 32
    with pytest.raises(ValueError, match=rf"{PATH}/gate_up_proj: qparams of scale shape \(4, 32.*16 rows per expert"):
        qstats.export.compressed_tensors(_model(8), qparams, str(tmp_path), recipe)
    assert not os.path.exists(tmp_path / "model.safetensors")
    # the same refusal for a Linear given the scales of other rows (the unpacked experts' reference)
    spec = qstats.QuantSpec.from_compressed_tensors(WEIGHTS[case])
    plain = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    wider = torch.nn.Sequential(torch.nn.Linear(32, 32))
    other = qstats.compute_qparams_tree(qstats.calibrate(wider, [], plain, progress=False), plain, wider)
    with pytest.raises(ValueError):
        qstats.export.compressed_tensors(torch.nn.Sequential(torch.nn.Linear(32, 16)), other, str(tmp_path / "linear"),
                                         plain)
