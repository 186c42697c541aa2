"""llm-compressor 0.14 weight observers with no qstats drop-in (``imatrix_mse``) beside qstats
input observers: ``oneshot`` writes the checkpoint llm-compressor's own input observer gives."""

import os

import pytest
import torch
from _oneshot import saved_random_model, token_samples
from _shared import bit_equal, llm_compressor_oneshot, word_tokenizer

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("qstats.llmcompressor")  # registers the qstats_* observers
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = saved_random_model(tmp_path_factory, "tiny_llama", transformers.LlamaForCausalLM, config)
    return path, token_samples(4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["W8A8", "NVFP4"])
def test_imatrix_mse_weights_beside_qstats_inputs_write_llm_compressors_checkpoint(saved, tmp_path, preset, dtype):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    path, samples = saved
    written = {}
    for name in ("static_minmax", "qstats_static_minmax"):
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
        model.set_attn_implementation("eager")
        recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"],
                                      weight_observer="imatrix_mse", input_observer=name)
        llm_compressor_oneshot(model, samples, recipe, tmp_path / name, tokenizer=word_tokenizer())
        written[name] = load_file(os.path.join(tmp_path / name, "model.safetensors"))
    theirs, ours = written["static_minmax"], written["qstats_static_minmax"]
    assert sorted(theirs) == sorted(ours)
    for key in theirs:
        assert bit_equal(ours[key], theirs[key]), key
