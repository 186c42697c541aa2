"""`Recipe.from_scheme` against llm-compressor 0.14's ``oneshot``: a tiny random Llama calibrated
by both with the same compressed-tensors preset scheme and the same samples gives the same
checkpoint, tensor for tensor and bit for bit, and the same ``quantization_config``."""

import json
import os
import warnings

import pytest
import torch
from _shared import bit_equal

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
pytest.importorskip("tokenizers")
from safetensors.torch import load_file  # noqa: E402

TOKENS = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Llama saved to disk (llm-compressor reads its config there), calibration
    samples (token ids) and a stand-in tokenizer."""
    import tokenizers
    from tokenizers.models import WordLevel

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(3)]
    vocabulary = {f"t{i}": i for i in range(64)} | {"[UNK]": 0}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(WordLevel(vocabulary, unk_token="[UNK]"))
    )
    return path, samples, tokenizer


def _batches(samples):
    return [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]


def _load(path):
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def _llm_compressor(saved, scheme, out, ignore):
    """llm-compressor's oneshot (basic pipeline: the model's own forward) and compressed save."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from torch.utils.data import DataLoader

    path, samples, tokenizer = saved
    model = _load(path)
    loader = DataLoader([{"input_ids": s, "attention_mask": torch.ones(TOKENS, dtype=torch.long)} for s in samples])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oneshot(model=model, dataset=loader, processor=tokenizer, pipeline="basic",
                recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore)),
                num_calibration_samples=len(samples), shuffle_calibration_samples=False)
        model.save_pretrained(out, save_compressed=True)


def _qstats(saved, scheme, out, ignore):
    path, samples, _ = saved
    model = _load(path)
    model.set_attn_implementation("eager")  # llm-compressor calibrates under eager attention
    recipe = qstats.Recipe.from_scheme(scheme, targets="Linear", ignore=ignore)
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, _batches(samples), plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, out, plan)


def _quantization_config(out):
    with open(os.path.join(out, "config.json")) as file:
        return json.load(file)["quantization_config"]


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC", "NVFP4"])
def test_export_equals_llm_compressor_oneshot(saved, tmp_path, scheme):
    ignore = ["lm_head"]
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved, scheme, theirs, ignore)
    _qstats(saved, scheme, ours, ignore)
    their_tensors, our_tensors = load_file(os.path.join(theirs, "model.safetensors")), load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    different = [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    assert not different, different
    their_config, our_config = _quantization_config(theirs), _quantization_config(ours)
    assert our_config["config_groups"] == their_config["config_groups"]
    assert our_config == their_config
