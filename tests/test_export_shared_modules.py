"""A module the model holds under two paths (one object: ``self.b = self.a``), exported: its
``state_dict`` lists it under both, and compressed-tensors quantizes the object at load, so the
checkpoint holds its quantized tensors under both paths, as compressed-tensors' own
``compress_model`` writes them (a float ``b.weight`` beside the quantized ``a`` failed a strict load)."""

from __future__ import annotations

import os

import pytest
import torch
from _shared import bit_equal

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = self.a  # one module, two paths
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 32))
        self.again = self.block  # a shared parent: its child Linear has two paths too
        self.c = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.c(self.again(self.block(self.b(self.a(x)))))


ARGS = {
    "int4-group-asym": QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    "int8-channel": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "fp8-tensor": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
    "nvfp4": NVFP4["weights"],
}


def _export(tmp_path, args):
    torch.manual_seed(0)
    model = Shared().eval()
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(6, 32) for _ in range(2)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert sorted(qparams) == ["a", "block.0", "c"]  # named_modules meets each object once
    written = qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    return model, qparams, QuantizationConfig.model_validate(written), load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("case", sorted(ARGS))
def test_a_shared_module_is_written_under_every_path_as_compressed_tensors_compresses_it(tmp_path, case):
    model, qparams, config, ours = _export(tmp_path, ARGS[case])
    # compressed-tensors' compressor on the float model holding our scales
    reference = Shared().eval()
    reference.load_state_dict(model.state_dict())
    apply_quantization_config(reference, config)
    with torch.no_grad():
        for path, sites in qparams.items():
            module = reference.get_submodule(path)
            for field in ("scale", "zero_point", "global_scale"):
                if hasattr(module, f"weight_{field}"):
                    parameter = getattr(module, f"weight_{field}")
                    parameter.copy_(getattr(sites["weight"], field).to(parameter.dtype).reshape(parameter.shape))
    ModelCompressor(quantization_config=config).compress_model(reference)
    theirs = reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert [name for name in ours if not bit_equal(ours[name], theirs[name])] == []
    for alias, first in (("b.", "a."), ("again.0.", "block.0.")):
        assert ours[f"{alias}weight_scale"].shape == ours[f"{first}weight_scale"].shape
        assert all(bit_equal(tensor, ours[first + name[len(alias):]]) for name, tensor in ours.items()
                   if name.startswith(alias))

    # a fresh model initialised from the config loads the checkpoint strictly
    torch.manual_seed(1)
    fresh = Shared().eval()
    apply_quantization_config(fresh, config)
    ModelCompressor(quantization_config=config).compress_model(fresh)
    fresh.load_state_dict(ours, strict=True)


def test_an_unquantized_shared_module_keeps_its_float_tensors_under_every_path(tmp_path):
    torch.manual_seed(0)
    model = Shared().eval()
    spec = qstats.QuantSpec.from_compressed_tensors(ARGS["int8-channel"])
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)], ignore=["a"])
    states = qstats.calibrate(model, [torch.randn(6, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe)
    ours = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    for path in ("a", "b"):
        assert bit_equal(ours[f"{path}.weight"], model.a.weight.detach())
        assert bit_equal(ours[f"{path}.bias"], model.a.bias.detach())
