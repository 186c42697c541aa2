"""`qstats.gptq_layerwise` on a model with dead input columns (ReLU units that never fire) against
llm-compressor 0.14's sequential ``oneshot`` with a ``GPTQModifier``: its Hessians are divided by
llm-compressor's sample count (one per sequence), so the dampening of a Hessian with dead columns
(their diagonal set to 1 before the mean is taken) is llm-compressor's and so are the codes."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats
from _packed import packed_codes
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

TOKENS, DEAD = 16, 32


@pytest.fixture(scope="module")
def relu_llama(tmp_path_factory):
    """A tiny Llama with a ReLU MLP whose first DEAD units never fire (gate bias -1000): the inputs
    of every down_proj have DEAD columns that are always zero."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      hidden_act="relu", mlp_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.bias[:DEAD] = -1000.0
    path = str(tmp_path_factory.mktemp("relu_llama"))
    model.save_pretrained(path)
    return path


def test_dead_columns_give_llm_compressor_codes(relu_llama, tmp_path):
    """Every scale and code equal llm-compressor's, down_proj's too (its dead columns are zeros);
    divided by the rows instead, 22% of that down_proj's codes differed, and then 9-22% of every
    second-layer weight's."""
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(8)]
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(relu_llama).eval()
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
                           str(tmp_path / "theirs"), "sequential")
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    config = transformers.AutoConfig.from_pretrained(relu_llama)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    meta.set_attn_implementation("eager")  # as llm-compressor calibrates
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"])
    batches = [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qstats.gptq_layerwise(meta, relu_llama, batches, recipe, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(relu_llama).eval()
    model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), str(tmp_path / "ours"),
                                     plan)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    names = sorted(name[: -len(".weight_packed")] for name in theirs if name.endswith(".weight_packed"))
    assert len(names) == 14
    for name in names:
        assert torch.equal(ours[f"{name}.weight_scale"], theirs[f"{name}.weight_scale"]), name
    down = "model.layers.0.mlp.down_proj"
    assert (packed_codes(theirs, down)[:, :DEAD] == 0).all()  # the dead columns
    for name in names:
        if name.startswith("model.layers.0."):
            assert torch.equal(packed_codes(ours, name), packed_codes(theirs, name)), name
    for name in names:  # the Hessians summed as llm-compressor sums them: the second layer too
        assert torch.equal(packed_codes(ours, name), packed_codes(theirs, name)), name
