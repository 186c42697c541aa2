"""Exporting stacked experts inside `qstats.fake_quantized` (their stacks parametrized with the fake
quantization) writes the checkpoint an export outside it writes: the float stacks, read as their originals."""
import warnings
import torch
import qstats
import transformers
from safetensors.torch import load_file
from _shared import qwen3_moe_config


def test_export_inside_fake_quantized_equals_export_outside(tmp_path):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(num_hidden_layers=1)).eval()
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"), spec=spec)])
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qstats.export.compressed_tensors(model, qparams, str(tmp_path / "outside"), recipe)
        with qstats.fake_quantized(model, qparams, recipe):
            qstats.export.compressed_tensors(model, qparams, str(tmp_path / "inside"), recipe)
    outside, inside = (load_file(str(tmp_path / f / "model.safetensors")) for f in ("outside", "inside"))
    assert sorted(inside) == sorted(outside)
    assert all(torch.equal(inside[name], outside[name]) for name in outside)
