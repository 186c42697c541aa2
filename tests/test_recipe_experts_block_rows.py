"""Block-quantized weights of fused experts (FP8_BLOCK's 128x128 blocks): llm-compressor blocks the
linearized ``gate_proj`` and ``up_proj`` of each expert apart. Where the block height divides the
intermediate size, the stacked ``gate_up_proj``'s blocks are those; where it does not, a block of
the stack would hold rows of both, so the recipe refuses it at ``resolve`` (the calibration ran, and
the export refused it after)."""

import warnings

import pytest
import torch
from _shared import qwen3_moe_config

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

WEIGHTS = PRESET_SCHEMES["FP8_BLOCK"]["weights"]
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def _moe(intermediate: int):
    torch.manual_seed(0)
    config = qwen3_moe_config(hidden_size=256, moe_intermediate_size=intermediate, head_dim=64, num_hidden_layers=1,
                              num_experts=2)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _linearized_scales(gate_up: torch.Tensor) -> list:
    """llm-compressor's block scales of one expert's ``gate_proj`` and ``up_proj`` (rows of ``gate_up``)."""
    half = gate_up.shape[0] // 2
    scales = []
    for rows in (gate_up[:half], gate_up[half:]):
        observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=WEIGHTS.model_copy(deep=True))
        scales.append(observer(rows).get_qparams()["scale"])
    return scales


def test_blocks_dividing_the_intermediate_size_are_llm_compressors_blocks():
    model = _moe(256)
    recipe = qstats.Recipe.from_scheme({"weights": WEIGHTS.model_dump()}, ignore=IGNORE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        site = recipe.resolve(model).sites["model.layers.0.mlp.experts"]["gate_up_proj"]
    weight = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    scale = qstats.compute_qparams(site.observer.update(site.observer.init(weight), weight), site.spec).scale
    for expert in range(weight.shape[0]):
        assert torch.equal(scale[expert].reshape(-1), torch.cat(_linearized_scales(weight[expert])).reshape(-1))


@pytest.mark.parametrize("build", [
    lambda: qstats.Recipe.from_scheme({"weights": WEIGHTS.model_dump()}, ignore=IGNORE),
    lambda: qstats.Recipe.from_compressed_tensors({"config_groups": {"g": {"targets": ["Linear"],
                                                                           "weights": WEIGHTS.model_dump()}},
                                                   "ignore": IGNORE}),
    lambda: qstats.Recipe.from_scheme({"weights": WEIGHTS.model_dump()}, experts="Qwen3MoeExperts", ignore=IGNORE),
])
def test_blocks_straddling_gate_and_up_are_refused_at_resolve(build):
    model = _moe(192)
    gate, up = _linearized_scales(model.model.layers[0].mlp.experts.gate_up_proj[0].detach())
    assert gate.shape[0] == up.shape[0] == 2  # llm-compressor: two partial-block rows each, four in all
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts:gate_up_proj .*straddle the gate and up halves "
                                         r"of 192 rows"):
        build().resolve(model)
