"""The warnings of `qstats.gptq_layerwise` on a tiny Qwen3-MoE whose experts do not all get a token:
one per fact, about what exists (the Hessian sites it adds have no quantization parameters)."""

import warnings

import pytest
import torch

import qstats
from _shared import qwen3_moe_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    torch.manual_seed(0)
    config = qwen3_moe_config(num_experts=8, num_experts_per_tok=1)
    folder = str(tmp_path_factory.mktemp("gptq_warnings_qwen3_moe"))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder, config


def _w4a16():
    spec = qstats.QuantSpec.from_compressed_tensors({"num_bits": 4, "type": "int", "symmetric": True,
                                                     "strategy": "group", "group_size": 8})
    return qstats.Recipe([qstats.Rule(("Linear", "Qwen3MoeExperts"), sites=("weight", "gate_up_proj", "down_proj"),
                                      spec=spec)])


def _gptq_warnings(moe, batches):
    folder, config = moe
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = qstats.gptq_layerwise(meta, folder, batches, _w4a16(), progress=False)
    return result, [str(w.message) for w in caught if issubclass(w.category, qstats.UncalibratedWarning)]


def _first_layer_uncovered(moe, batches):
    """The experts the loaded model's first router sends no token of ``batches`` (its top-k indices)."""
    folder, _ = moe
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    routed = set()
    hook = model.model.layers[0].mlp.gate.register_forward_hook(
        lambda module, args, output: routed.update(output[2].flatten().tolist()))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    hook.remove()
    return [expert for expert in range(8) if expert not in routed]


def test_experts_without_tokens_are_warned_of_once_by_gptq_not_as_quantization_parameters(moe):
    """Before: `calibrate`'s warning that the experts' "quantization parameters follow on_uncalibrated"
    fired for GPTQ's Hessian sites (which have none) beside GPTQ's own warning of the same experts."""
    batches = [torch.randint(1, 64, (1, 3), generator=torch.Generator().manual_seed(3))]
    uncovered = _first_layer_uncovered(moe, batches)
    assert uncovered  # 3 tokens, top-1 of 8 experts
    _, messages = _gptq_warnings(moe, batches)
    assert not [m for m in messages if "quantization parameters follow" in m]
    first = [m for m in messages if "model.layers.0.mlp.experts" in m]
    assert len(first) == 2  # gate_up_proj and down_proj, each once
    for site in ("gate_up_proj", "down_proj"):
        (message,) = [m for m in first if f"experts.{site} " in m]
        assert f"experts {uncovered} ({len(uncovered)} of 8)" in message and "round-to-nearest" in message


def test_lm_head_is_not_warned_of_as_unobserved_when_it_is_gptqd(moe):
    """Before: the pass before the first layer (which GPTQs the modules the forward calls there) warned
    that ``lm_head.input`` "saw no data"; it is observed after the layers, and lm_head is GPTQ'd."""
    batches = [torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(4))]
    result, messages = _gptq_warnings(moe, batches)
    assert "lm_head.weight" in result.weights
    assert not [m for m in messages if "lm_head" in m]
