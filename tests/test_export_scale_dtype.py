"""Half-precision ``scale_dtype`` of compressed-tensors args in the export: written into the config groups
as llm-compressor 0.14's ``oneshot`` writes it (compressed-tensors rounds the dynamic scales it computes
at run time to it), so the checkpoint loaded by transformers runs like `qstats.fake_quantized`."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

VOCAB = 64


def _dynamic_int8(scale_dtype):
    return {"weights": dict(num_bits=8, type="int", symmetric=True, strategy="channel", scale_dtype=scale_dtype),
            "input_activations": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True,
                                      scale_dtype=scale_dtype)}


SCHEMES = {
    "int8-dynamic-token-inputs-float16-scales": _dynamic_int8(torch.float16),
    "int8-dynamic-token-inputs-bfloat16-scales": _dynamic_int8(torch.bfloat16),
    "fp8-static-inputs-float16-scales": {
        "weights": dict(num_bits=8, type="float", symmetric=True, strategy="channel", scale_dtype=torch.float16),
        "input_activations": dict(num_bits=8, type="float", symmetric=True, strategy="tensor",
                                  scale_dtype=torch.float16)},
    "int4-asym-group-bfloat16-scales": {
        "weights": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32,
                        scale_dtype=torch.bfloat16)},
}


def _load(path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, **options).eval()


def _groups(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]["config_groups"]


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_half_precision_scale_dtype_is_written_as_oneshot_writes_it_and_loads_like_fake_quantized(tmp_path, case):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    scheme = SCHEMES[case]
    base, ours, theirs = (str(tmp_path / name) for name in ("base", "ours", "theirs"))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, VOCAB, (12,), generator=generator) for _ in range(2)]
    modifier = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                    ignore=["lm_head"])
    llm_compressor_oneshot(_load(base), samples, modifier, theirs)

    model = _load(base)
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    plan = qstats.Recipe.from_scheme(scheme, targets=["Linear"], ignore=["lm_head"]).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, ours, plan)

    batch = torch.randint(1, VOCAB, (1, 10), generator=generator)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        expected = model(batch).logits
    loaded = _load(ours, quantization_config=CompressedTensorsConfig(run_compressed=False))
    loaded.set_attn_implementation("eager")  # as the calibrated model runs
    with torch.no_grad():  # dynamic scales rounded to scale_dtype at run time, as qstats rounds them
        assert bit_equal(loaded(batch).logits, expected)

    assert _groups(ours) == _groups(theirs)
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])] == []
