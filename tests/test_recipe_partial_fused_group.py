"""An NVFP4 recipe that ignores some members of a fused group (``q_proj`` of q/k/v): llm-compressor
0.14 refuses it when calibration starts (its ``fuse_weight_observers`` asserts); a Recipe calibrates
it and ``compute_qparams_tree`` warns, naming the group, each quantized member keeping the global
scale of its own weight (docs/differences.md)."""

import copy
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402

IGNORE = ["lm_head", "re:.*q_proj"]
ATTENTION = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_llm_compressor_refuses_a_partly_ignored_fused_group(llama):
    model = copy.deepcopy(llama)
    modifier = QuantizationModifier(scheme="NVFP4A16", ignore=IGNORE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modifier.initialize_quantization(model)
        with pytest.raises(AssertionError, match=r"Some layers in fused group: \('q_proj', 'k_proj', 'v_proj'\)"):
            modifier.start_calibration(model)


def test_a_recipe_warns_and_keeps_each_members_own_global_scale(llama):
    plan = qstats.Recipe.from_scheme("NVFP4A16", ignore=IGNORE).resolve(llama)
    assert f"{ATTENTION}.q_proj" not in plan.sites
    states = qstats.calibrate(llama, [{"input_ids": torch.arange(8)[None]}], plan, progress=False)
    with pytest.warns(UserWarning, match=rf"{ATTENTION}.q_proj, {ATTENTION}.k_proj, {ATTENTION}.v_proj run as one matmul"):
        qparams = qstats.compute_qparams_tree(states, plan)
    for name in ("k_proj", "v_proj"):
        found = plan.sites[f"{ATTENTION}.{name}"]["weight"]
        alone = qstats.compute_qparams(states[f"{ATTENTION}.{name}"]["weight"], found.spec)
        assert torch.equal(qparams[f"{ATTENTION}.{name}"]["weight"].global_scale, alone.global_scale)
