"""qstats.calibrate_layerwise and compressed_tensors_layerwise given a quantized checkpoint whose
config.json lost its ``quantization_config`` (with it, both refuse the checkpoint up front, naming the
config: tests/test_layerwise_quantized_checkpoint_config.py).

A compressed-tensors W8A8 checkpoint (the ``int-quantized`` format llm-compressor's ``oneshot``
writes; here `qstats.export.compressed_tensors`, its checkpoint bit for bit) stores each Linear
``weight`` as int8 beside its ``weight_scale``. Read as the float model's weight it loses the
scales: both functions refuse it with a ValueError naming the tensor (as they refuse float8
ones), and leave the model on the meta device. A packed checkpoint (int4 ``pack-quantized``,
``nvfp4-pack-quantized``) has ``weight_packed`` in place of ``weight``: the error names it.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

RECIPE = qstats.Recipe([
    qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8", mapping="asymmetric")),
    qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))),
], ignore=("lm_head",))  # fmt: skip
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
BATCHES = [{"input_ids": torch.arange(14).reshape(2, 7) % 96}]


def _without_quantization_config(folder: str) -> None:
    with open(os.path.join(folder, "config.json")) as file:
        config = json.load(file)
    del config["quantization_config"]
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file)


@pytest.fixture
def quantized(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, BATCHES, RECIPE, progress=False), RECIPE, model)
    folder = str(tmp_path / "w8a8")
    qstats.export.compressed_tensors(model, qparams, folder, RECIPE)
    _without_quantization_config(folder)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as file:
        assert file.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "I8"
    return folder, qparams


def _meta(requires_grad: bool) -> torch.nn.Module:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    return model.requires_grad_(requires_grad)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_calibrate_layerwise_names_an_int8_weight_of_a_quantized_checkpoint(quantized, requires_grad):
    folder, _ = quantized
    model = _meta(requires_grad)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"'model\.layers\.0\..*weight' is stored as "
                                                                      r"torch\.int8.*quantized checkpoint"):
        warnings.simplefilter("ignore")  # the scales no tensor of the model reads
        qstats.calibrate_layerwise(model, folder, BATCHES, RECIPE, progress=False)
    assert all(value.device.type == "meta" for value in model.parameters())


@pytest.mark.parametrize("requires_grad", [True, False])
def test_the_export_names_an_int8_weight_of_a_quantized_checkpoint(quantized, tmp_path, requires_grad):
    folder, qparams = quantized
    model = _meta(requires_grad)
    out = str(tmp_path / "again")
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"is stored as torch\.int8"):
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors_layerwise(model, folder, qparams, out, RECIPE, progress=False)
    assert not os.path.exists(out)
    assert all(value.device.type == "meta" for value in model.parameters())


@pytest.mark.parametrize("args", [dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
                                  dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                                       scale_dtype=torch.float8_e4m3fn)])
def test_a_packed_weight_of_a_quantized_checkpoint_is_named_as_such(tmp_path, args):
    """A ``pack-quantized`` (int4) or ``nvfp4-pack-quantized`` checkpoint holds ``weight_packed`` in
    place of each ``weight``: the error names it as a quantized checkpoint's codes, not only the
    missing float weight."""
    from compressed_tensors.quantization import QuantizationArgs

    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**args))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)], ignore=("lm_head",))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, BATCHES, recipe, progress=False), recipe, model)
    folder = str(tmp_path / "packed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, folder, recipe)
    _without_quantization_config(folder)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as file:
        assert "model.layers.0.self_attn.q_proj.weight_packed" in file.keys()
        assert "model.layers.0.self_attn.q_proj.weight" not in file.keys()
    message = r"no tensor 'model\.layers\.0\..*weight': it holds '.*weight_packed', the packed codes of a quantized"
    with pytest.raises(ValueError, match=message):
        qstats.calibrate_layerwise(_meta(True), folder, BATCHES, recipe, progress=False)
    with pytest.raises(ValueError, match=message):
        qstats.export.compressed_tensors_layerwise(_meta(True), folder, qparams, str(tmp_path / "again"), recipe,
                                                   progress=False)  # fmt: skip
    assert not os.path.exists(tmp_path / "again")
