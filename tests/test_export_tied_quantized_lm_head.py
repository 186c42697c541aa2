"""A tied lm_head quantized with the embeddings' weight spec but its own input scales (unpacked int8
codes, ``format="int-quantized"``, the format the export's packed-Embedding warning names): its codes
equal the embeddings', and the export dropped them as a float copy of a tied weight, so the untied
checkpoint had no ``lm_head.weight`` and transformers failed to load it (initialising the int8 weight).
Loaded back by transformers' compressed-tensors quantizer, it computes qstats.fake_quantized's logits."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import checkpoint_tensors, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

INT8_CHANNELS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
INT8_TENSOR = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")


def _tied_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("run_compressed", [False, True])
def test_a_quantized_lm_head_whose_codes_equal_the_embeddings_is_written(tmp_path, run_compressed):
    model = _tied_llama()
    weights, inputs = (qstats.QuantSpec.from_compressed_tensors(args) for args in (INT8_CHANNELS, INT8_TENSOR))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights),
                            qstats.Rule("Embedding", sites=("weight",), spec=weights),
                            qstats.Rule("Linear", sites=("input",), spec=inputs)])
    plan = recipe.resolve(model)
    batch = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": batch}], plan, progress=False), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan, format="int-quantized")
    tensors = checkpoint_tensors(str(tmp_path))
    assert {"lm_head.weight", "lm_head.weight_scale", "lm_head.input_scale"} <= tensors.keys()
    with open(os.path.join(tmp_path, "config.json")) as file:
        assert json.load(file)["tie_word_embeddings"] is False
    loaded = load_causal_lm(str(tmp_path), quantization_config=CompressedTensorsConfig(run_compressed=run_compressed))
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        expected = model(batch).logits
    with torch.no_grad():
        assert torch.equal(loaded(batch).logits, expected)


FP8_CHANNELS = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")


@pytest.mark.parametrize("weights,format", [(INT8_CHANNELS, "int-quantized"), (FP8_CHANNELS, None)],
                         ids=["int8-int-quantized", "fp8-naive-quantized"])
def test_embeddings_quantized_alike_and_stored_unpacked_load_as_calibrated(tmp_path, weights, format):
    """lm_head and the embeddings quantized alike, their codes stored unpacked: re-tied as llm-compressor's
    save re-ties them (the embeddings' tensors alone, tie_word_embeddings true), transformers tied the weight
    alone and left lm_head.weight_scale uninitialised (NaN or wrong logits, whatever that memory held;
    oneshot's checkpoint of the fp8 scheme, the same tensors, loads with NaN logits too); written untied,
    the loaded model computes qstats.fake_quantized's logits."""
    model = _tied_llama()
    spec = qstats.QuantSpec.from_compressed_tensors(weights)
    plan = qstats.Recipe([qstats.Rule(("Linear", "Embedding"), sites=("weight",), spec=spec)]).resolve(model)
    batch = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": batch}], plan, progress=False), plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan, format=format)
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        expected = model(batch).logits
    for run_compressed in (False, True):
        loaded = load_causal_lm(str(tmp_path), quantization_config=CompressedTensorsConfig(run_compressed=run_compressed))
        with torch.no_grad():
            assert torch.equal(loaded(batch).logits, expected), run_compressed
