"""transformers 5.17's MoE families against llm-compressor 0.14 (tiny random models, hidden
32-64, 4-8 experts): the per-expert Linear names qstats takes llm-compressor's ``linearize_moe`` to
make (``qstats.experts.linearized_experts``, which recipes match and ``ignore`` lists name) are the
modules it really makes, for Llama 4 (its registered ``Llama4LinearExperts``, on the multimodal model
whose config it reads), GPT-OSS, LongCat-Flash and DBRX (neither linearized); and where the two
write experts llm-compressor does not quantize differently, which checkpoint transformers loads."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

from safetensors.torch import load_file  # noqa: E402
from test_moe_families import _model  # noqa: E402


def _llama4():
    """A tiny Llama 4 (4 experts, hidden 32, a one-layer vision tower): llm-compressor 0.14's
    ``Llama4LinearExperts`` reads ``config.text_config``, which only the multimodal config has."""
    text = dict(hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128, num_local_experts=4,
                num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 1])
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.Llama4Config(text_config=text, vision_config=vision)
        return transformers.Llama4ForConditionalGeneration(config).eval()


def _linearized_names(model) -> dict:
    """``{experts path: [Linear paths]}`` of llm-compressor's ``linearize_moe`` of ``model``."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import linearize_moe

    linearize_moe(model)
    return {
        path: [f"{path}.{name}" for name, child in module.named_modules() if isinstance(child, torch.nn.Linear)]
        for path, module in model.named_modules()
        if isinstance(module, LinearExperts2D)
    }


@pytest.mark.parametrize("family", ["llama4", "gpt_oss", "longcat_flash", "dbrx"])
def test_linearized_expert_names_are_llm_compressors_modules(family, single_thread_quiet):
    model = _llama4() if family == "llama4" else _model(family)
    ours = {}
    for path, module in model.named_modules():
        names = qstats.experts.linearized_experts(path, module)
        if names:
            ours[path] = names
    theirs = _linearized_names(model)
    assert ours == theirs
    assert bool(theirs) == (family in ("llama4", "gpt_oss"))  # LongCat's and DBRX's experts are left as they are


def _w8a8_with_experts_ignored(model_folder: str, load, out: str, ignore: list) -> None:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    sample = torch.randint(1, 128, (12,), generator=torch.Generator().manual_seed(1))
    modifier = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head", "re:.*experts.*"] + ignore)
    if out.endswith("theirs"):
        llm_compressor_oneshot(load(model_folder), [sample], modifier, out)
        return
    model = load(model_folder)
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": sample[None]}], plan, progress=False)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), out, plan)


def _loaded_experts(cls, folder: str, path: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(folder).get_submodule(path)


@pytest.mark.parametrize("family,path", [("gpt_oss", "model.layers.0.mlp.experts"),
                                         ("granitemoe", "model.layers.0.block_sparse_moe.experts")])
def test_unquantized_stacked_checkpoint_experts_load_into_transformers(family, path, tmp_path, single_thread_quiet):
    """Families whose checkpoints hold stacked experts (GPT-OSS; GraniteMoE's ``input_linear``) with
    their experts ignored: qstats writes them as ``save_pretrained`` does, and transformers loads them;
    llm-compressor writes its linearized per-expert Linears, which transformers does not load into
    the stacked experts (they come back freshly initialised)."""
    folder, ours, theirs = (str(tmp_path / name) for name in ("float", "ours", "theirs"))
    _model(family).save_pretrained(folder)
    cls = transformers.AutoModelForCausalLM
    load = lambda f: cls.from_pretrained(f).eval()  # noqa: E731
    _w8a8_with_experts_ignored(folder, load, ours, [])
    _w8a8_with_experts_ignored(folder, load, theirs, [])
    assert f"{path}.0.gate_proj.weight" in load_file(os.path.join(theirs, "model.safetensors"))
    original = _loaded_experts(cls, folder, path)
    assert torch.equal(_loaded_experts(cls, ours, path).gate_up_proj, original.gate_up_proj)
    assert not torch.equal(_loaded_experts(cls, theirs, path).gate_up_proj, original.gate_up_proj)


def test_llama4_unquantized_experts_load_into_transformers(tmp_path, single_thread_quiet):
    """Llama 4 with its experts ignored: transformers loads a compressed-tensors checkpoint of it with
    ``SequentialLlama4TextExperts`` (per-expert ``gate_proj``/``up_proj``/``down_proj`` Linears), as
    llm-compressor writes them; stacked experts are left freshly initialised."""
    folder, ours, theirs = (str(tmp_path / name) for name in ("float", "ours", "theirs"))
    _llama4().save_pretrained(folder)
    cls = transformers.Llama4ForConditionalGeneration
    load = lambda f: cls.from_pretrained(f).eval()  # noqa: E731
    ignore = ["re:.*vision.*", "re:.*multi_modal.*"]
    _w8a8_with_experts_ignored(folder, load, theirs, ignore)
    _w8a8_with_experts_ignored(folder, load, ours, ignore)
    path = next(name for name, _ in load(folder).named_modules() if name.endswith("layers.0.feed_forward.experts"))
    stacked = _loaded_experts(cls, folder, path)
    loaded = {name: _loaded_experts(cls, folder_, path) for name, folder_ in (("ours", ours), ("theirs", theirs))}
    for expert in range(stacked.num_experts):
        want = {"gate_proj": stacked.gate_up_proj[expert, :, : stacked.expert_dim].T,
                "up_proj": stacked.gate_up_proj[expert, :, stacked.expert_dim :].T,
                "down_proj": stacked.down_proj[expert].T}
        for name, weight in want.items():  # llm-compressor's loads; qstats' left them random before
            assert all(torch.equal(getattr(experts[expert], name).weight, weight) for experts in loaded.values())


def test_llama4_exported_with_nothing_quantized_keeps_its_stacked_experts(tmp_path, single_thread_quiet):
    """A recipe that quantizes nothing writes no quantization_config (the float model): transformers
    then loads Llama 4's experts stacked, so they are written as save_pretrained writes them."""
    folder, ours = str(tmp_path / "float"), str(tmp_path / "ours")
    _llama4().save_pretrained(folder)
    cls = transformers.Llama4ForConditionalGeneration
    model = cls.from_pretrained(folder).eval()
    with pytest.warns(UserWarning, match="no module is quantized"):
        qstats.export.compressed_tensors(model, {}, ours, qstats.Recipe([]))
    path = next(name for name, _ in model.named_modules() if name.endswith("layers.0.feed_forward.experts"))
    original, loaded = _loaded_experts(cls, folder, path), _loaded_experts(cls, ours, path)
    assert torch.equal(loaded.gate_up_proj, original.gate_up_proj)
    assert torch.equal(loaded.down_proj, original.down_proj)
