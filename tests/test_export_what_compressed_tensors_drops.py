"""What compressed-tensors would load differently from what qstats calibrated is refused by the export
instead of being written: q/k/v scales of attention modules compressed-tensors does not quantize as
attention (transformers dropped them as UNEXPECTED keys, the model ran unquantized), and activation
ranges narrower than the whole ``num_bits`` range (compressed-tensors quantizes activations at run time
on the whole range: the loaded model clamped out-of-range activations elsewhere than qstats)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

FP8 = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor")


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16)
    return transformers.BertModel(config).eval()


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 50, (2, 8), generator=generator)} for _ in range(2)]


def _qparams(model, recipe):
    return qstats.compute_qparams_tree(qstats.calibrate(model, _batches(), recipe, progress=False), recipe, model)


@pytest.mark.parametrize("sites", [("k", "v"), ("q", "k", "v")])
def test_qkv_sites_of_an_attention_compressed_tensors_does_not_quantize_are_refused(tmp_path, sites):
    # BertSelfAttention has query/key/value children (qstats observes them) but no k_proj: compressed-tensors
    # registers no k_scale there, and transformers loaded the written scales as UNEXPECTED (dropped)
    model = _bert()
    path = "encoder.layer.0.attention.self"
    assert not is_cached_attention_module(model.get_submodule(path))
    spec = qstats.QuantSpec.from_compressed_tensors(FP8)
    recipe = qstats.Recipe([qstats.Rule("BertSelfAttention", sites=sites, spec=spec)])
    qparams = _qparams(model, recipe)
    assert sorted(qparams[path]) == sorted(sites)
    with pytest.raises(ValueError, match=rf"{path}: q/k/v sites of a BertSelfAttention, which compressed-tensors"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "bert"), recipe)
    assert not os.path.exists(tmp_path / "bert" / "model.safetensors")


NARROW = {
    "narrow-int8": qstats.QuantSpec(dtype="int8", mapping="narrow"),  # [-127, 127]
    "reduce_range-quint8": qstats.QuantSpec(dtype="uint8", mapping="asymmetric", reduce_range=True),  # [0, 127]
    "quant_min-max": qstats.QuantSpec(dtype="int8", quant_min=-100, quant_max=100),
}


@pytest.mark.parametrize("case", sorted(NARROW))
def test_activation_ranges_narrower_than_compressed_tensors_are_refused(tmp_path, case):
    spec = NARROW[case]
    weights = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights),
                            qstats.Rule("Linear", sites=("input",), spec=spec)], ignore=["re:.*pooler.*"])
    model = _bert()
    qparams = _qparams(model, recipe)
    # why: compressed-tensors' own run-time quantization of the args the export would write (the same
    # scale and zero point, moved onto its signed range) clamps a value past the calibrated range on
    # its whole 8-bit range, qstats on the spec's
    qp = qparams["encoder.layer.0.attention.self.query"]["input"]
    offset = 0 if spec.is_signed else -128
    args = QuantizationArgs(num_bits=8, type="int", symmetric=spec.mapping != "asymmetric", strategy="tensor")
    beyond = torch.tensor([-1e3, 1e3])
    theirs = fake_quantize(beyond, qp.scale.reshape(1), (qp.zero_point + offset).to(torch.int8).reshape(1), args)
    ours = qstats.fake_quantize(beyond, qp, spec)
    assert not torch.equal(theirs, ours)
    with pytest.raises(ValueError, match=r"/input: the input range \[-?\d+, \d+\] of dtype .* is narrower than"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "refused"), recipe)


def test_a_narrow_weight_range_is_still_written_and_decompressed_exactly(tmp_path):
    # weights keep a narrow range: their codes are stored, compressed-tensors decompresses them to qstats' values
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16)).eval()
    spec = qstats.QuantSpec(dtype="int8", mapping="narrow", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    with open(tmp_path / "config.json") as file:
        config = QuantizationConfig.model_validate(json.load(file)["quantization_config"])
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 16)).eval()
    apply_quantization_config(fresh, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    fresh.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compressor.decompress_model(fresh)
    weight, qp = model[0].weight.detach(), qparams["0"]["weight"]
    assert bit_equal(fresh[0].weight.data, qstats.dequantize(qstats.quantize(weight, qp, spec), qp, spec))


def test_groups_of_activations_only_leave_the_top_level_format_as_compressed_tensors_infers_it(tmp_path):
    # an int8 W8A8 group and a group of inputs only (dense): oneshot writes "int-quantized" (compressed-tensors'
    # infer_model_format leaves dense modules out); the export wrote "mixed-precision"
    from compressed_tensors.compressors.format import infer_model_format

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = Tiny().eval()
    weights = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, strategy="channel"))
    inputs = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, strategy="tensor"))
    recipe = qstats.Recipe([qstats.Rule("fc1", sites=("weight",), spec=weights),
                            qstats.Rule("Linear", sites=("input",), spec=inputs)])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [torch.randn(5, 32)], recipe, progress=False),
                                         recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    assert sorted(group["format"] for group in written["config_groups"].values()) == ["dense", "int-quantized"]
    config = QuantizationConfig.model_validate(written)
    for group in config.config_groups.values():
        group.format = None  # compressed-tensors infers each module's format itself
    fresh = Tiny().eval()
    apply_quantization_config(fresh, config)
    assert written["format"] == str(getattr(infer_model_format(fresh), "value", infer_model_format(fresh)))
    assert written["format"] == "int-quantized"


class _Head(torch.nn.Linear):
    """A Linear subclass: compressed-tensors' "Linear" target matches it (a class of its MRO is Linear)."""


class _WithHead(torch.nn.Module):
    def __init__(self, head=_Head, body=torch.nn.Linear):
        super().__init__()
        self.fc1, self.fc2, self.head = body(32, 64), body(64, 32), head(32, 4)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("classes", [(_Head, torch.nn.Linear), (torch.nn.Linear, _Head)],
                         ids=["unquantized-subclass", "quantized-subclasses"])
def test_compressed_tensors_quantizes_at_load_exactly_the_modules_written_quantized(tmp_path, classes):
    # the group was written targets ["Linear"] with an ignore list of unquantized modules of the quantized
    # classes only: an unquantized Linear of another class was quantized at load, its scales missing
    torch.manual_seed(0)
    model = _WithHead(*classes).eval()
    spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(num_bits=8, strategy="channel"))
    recipe = qstats.Recipe([qstats.Rule(("fc1", "fc2"), sites=("weight",), spec=spec)])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    config = QuantizationConfig.model_validate(written)
    torch.manual_seed(1)
    fresh = _WithHead(*classes).eval()
    apply_quantization_config(fresh, config)
    quantized = sorted(name for name, module in fresh.named_modules() if hasattr(module, "quantization_scheme"))
    assert quantized == ["fc1", "fc2"]
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(fresh)
    fresh.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")), strict=True)
    compressor.decompress_model(fresh)
    assert bit_equal(fresh.head.weight.data, model.head.weight.data)
    for name in ("fc1", "fc2"):
        weight, qp = getattr(model, name).weight.detach(), qparams[name]["weight"]
        expected = qstats.dequantize(qstats.quantize(weight, qp, spec), qp, spec)
        assert bit_equal(getattr(fresh, name).weight.data, expected)
