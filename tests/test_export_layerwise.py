"""`qstats.export.compressed_tensors_layerwise`: the export of a model on the meta device, read from
its checkpoint one layer at a time, against llm-compressor's ``oneshot`` checkpoint (W8A8, bit for
bit), the in-memory export, and transformers loading the GPTQ'd Qwen3-MoE back."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import bit_equal, checkpoint_tensors, llm_compressor_oneshot, qwen3_moe_config

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOKENS = 16


@pytest.fixture(scope="module")
def samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(3)]


def _save(tmp_path_factory, name, model):
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path, max_shard_size="200KB")  # several shards: read across files
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    return _save(tmp_path_factory, "export_llama", transformers.LlamaForCausalLM(config))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    config = qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                              head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return _save(tmp_path_factory, "export_moe", transformers.Qwen3MoeForCausalLM(config))


def _batches(samples):
    return [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]


def _meta(path):
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("eager")  # llm-compressor calibrates under eager attention
    return model


def _config(folder):
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _oneshot_w8a8(path, samples, out):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(model, samples, QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]), out)


def test_w8a8_layer_by_layer_equals_llm_compressor_oneshot(llama, samples, tmp_path):
    """calibrate_layerwise + compressed_tensors_layerwise, never holding the model: every tensor and
    the quantization_config equal llm-compressor's oneshot checkpoint; one shard per layer."""
    pytest.importorskip("llmcompressor")
    theirs = str(tmp_path / "theirs")
    _oneshot_w8a8(llama, samples, theirs)
    model = _meta(llama)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    plan = recipe.resolve(model)
    states = qstats.calibrate_layerwise(model, llama, _batches(samples), plan, progress=False)
    ours = str(tmp_path / "ours")
    config = qstats.export.compressed_tensors_layerwise(model, llama, qstats.compute_qparams_tree(states, plan), ours,
                                                        plan, progress=False)
    assert config == _config(ours) == _config(theirs)
    their_tensors, our_tensors = checkpoint_tensors(theirs), checkpoint_tensors(ours)
    assert sorted(our_tensors) == sorted(their_tensors)
    assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    with open(os.path.join(ours, "model.safetensors.index.json")) as file:
        weight_map = json.load(file)["weight_map"]
    assert sorted(weight_map) == sorted(our_tensors) and len(set(weight_map.values())) == 3
    assert all(param.device.type == "meta" for param in model.parameters())


def test_gptq_moe_export_from_disk_equals_the_in_memory_export_and_loads(moe, samples, tmp_path):
    """gptq_layerwise writing its weights to a folder, then the layer-by-layer export over them:
    the same tensors and config as the in-memory export of the loaded model with the GPTQ'd
    weights; transformers loads it, its experts holding the GPTQ'd weights."""
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head", "re:.*mlp.gate$"], experts="Qwen3MoeExperts")
    model = _meta(moe)
    folder = str(tmp_path / "gptq_weights")
    on_disk = qstats.gptq_layerwise(model, moe, _batches(samples), recipe, weights_dir=folder, progress=False)
    assert on_disk.weights == folder
    in_memory = qstats.gptq_layerwise(model, moe, _batches(samples), recipe, progress=False)
    assert sorted(checkpoint_tensors(folder)) == sorted(in_memory.weights)
    plan = recipe.resolve(model)
    streamed = str(tmp_path / "streamed")
    qstats.export.compressed_tensors_layerwise(model, moe, qstats.compute_qparams_tree(on_disk.states, plan), streamed,
                                               plan, weights=folder, progress=False)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(moe).eval()
    loaded.load_state_dict(in_memory.weights, strict=False)
    loaded_plan = recipe.resolve(loaded)
    whole = str(tmp_path / "whole")
    qstats.export.compressed_tensors(loaded, qstats.compute_qparams_tree(in_memory.states, loaded_plan), whole,
                                     loaded_plan)
    assert _config(streamed) == _config(whole)
    streamed_tensors, whole_tensors = checkpoint_tensors(streamed), checkpoint_tensors(whole)
    assert sorted(streamed_tensors) == sorted(whole_tensors)
    assert not [name for name in whole_tensors if not bit_equal(streamed_tensors[name], whole_tensors[name])]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reread = transformers.AutoModelForCausalLM.from_pretrained(streamed).eval()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(reread.get_parameter(name), in_memory.weights[name]), name


def test_a_model_off_the_meta_device_is_refused(llama, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    with pytest.raises(ValueError, match="meta"):
        qstats.export.compressed_tensors_layerwise(model, llama, {}, str(tmp_path), recipe, progress=False)


def test_a_checkpoint_that_is_not_a_directory_is_refused(llama, tmp_path):
    model = _meta(llama)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    missing = str(tmp_path / "no_such_checkpoint")
    with pytest.raises(ValueError, match="checkpoint '.*no_such_checkpoint' is not a directory"):
        qstats.export.compressed_tensors_layerwise(model, missing, {}, str(tmp_path), recipe, progress=False)


def test_a_layer_left_out_of_qparams_warns(llama, samples, tmp_path):
    """Leaving out one layer's qparams writes that layer unquantized: an UncalibratedWarning names
    its modules, which the config ignores."""
    model = _meta(llama)
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate_layerwise(model, llama, _batches(samples), plan, progress=False), plan)
    without = {path: sites for path, sites in qparams.items() if not path.startswith("model.layers.1.")}
    with pytest.warns(qstats.UncalibratedWarning, match=r"7 module\(s\).*unquantized.*model\.layers\.1\.self_attn"):
        config = qstats.export.compressed_tensors_layerwise(model, llama, without, str(tmp_path / "out"), plan,
                                                            progress=False)
    assert "model.layers.1.mlp.down_proj" in config["ignore"]


def test_tied_embeddings_and_weights_given_as_a_dict(tmp_path, samples):
    """A Llama whose lm_head is tied to the embeddings, with one weight replaced through a dict:
    the same tensors as the in-memory export of the loaded model holding that weight; a name the
    model lacks, and writing into the checkpoint, are refused."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    checkpoint = str(tmp_path / "tied")
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)
    model = _meta(checkpoint)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    plan = recipe.resolve(model)
    qparams = qstats.compute_qparams_tree(qstats.calibrate_layerwise(model, checkpoint, _batches(samples), plan,
                                                                     progress=False), plan)  # fmt: skip
    name = "model.layers.1.mlp.down_proj.weight"
    replaced = torch.randn(64, 128) * 0.02
    streamed = str(tmp_path / "streamed")
    qstats.export.compressed_tensors_layerwise(model, checkpoint, qparams, streamed, plan, weights={name: replaced},
                                               progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    loaded.load_state_dict({name: replaced}, strict=False)
    whole = str(tmp_path / "whole")
    qstats.export.compressed_tensors(loaded, qparams, whole, recipe.resolve(loaded))
    ours, reference = checkpoint_tensors(streamed), checkpoint_tensors(whole)
    # the float lm_head tied to the embeddings is written once, as save_pretrained writes it
    assert "lm_head.weight" not in reference and sorted(ours) == sorted(reference)
    assert not [key for key in reference if not bit_equal(ours[key], reference[key])]
    assert _config(streamed) == _config(whole)
    with pytest.raises(ValueError, match="name no tensor"):
        qstats.export.compressed_tensors_layerwise(model, checkpoint, qparams, str(tmp_path / "bad"), plan,
                                                   weights={"model.no_such.weight": replaced}, progress=False)
    with pytest.raises(ValueError, match="checkpoint being read"):
        qstats.export.compressed_tensors_layerwise(model, checkpoint, qparams, checkpoint, plan, progress=False)


def test_a_failed_export_leaves_no_shard_and_bad_arguments_are_named(llama, samples, tmp_path):
    """A weights= name the model lacks is found after every shard is written: those shards stayed,
    and a rerun into the folder was refused ("already holds safetensors files"). A weights= folder
    that does not exist was reported as the checkpoint; a wrong layers= raised torch's AttributeError."""
    model = _meta(llama)
    plan = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"]).resolve(model)
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate_layerwise(model, llama, _batches(samples[:1]), plan, progress=False), plan)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="name no tensor"):
        qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(out), plan,
                                                   weights={"model.no_such.weight": torch.zeros(2)}, progress=False)
    assert not out.exists()  # nor the folder the export created
    qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(out), plan, progress=False)  # a rerun works
    # a refusal of the quantization config (k/v qparams on layer 0's attention only) comes after the
    # shards are written: they are removed too
    from compressed_tensors.quantization import QuantizationArgs

    kv = qstats.Recipe([qstats.Rule("model.layers.0.self_attn", sites=("k", "v"), spec=qstats.QuantSpec.from_compressed_tensors(
        QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)))]).resolve(model)
    kv_qparams = qstats.compute_qparams_tree(
        qstats.calibrate_layerwise(model, llama, _batches(samples[:1]), kv, progress=False), kv)
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        qstats.export.compressed_tensors_layerwise(model, llama, kv_qparams, str(tmp_path / "kv"), kv, progress=False)
    assert not (tmp_path / "kv").exists()
    with pytest.raises(ValueError, match="weights='.*no_such_folder' is neither"):
        qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(tmp_path / "b"), plan,
                                                   weights=str(tmp_path / "no_such_folder"), progress=False)
    with pytest.raises(ValueError, match="export.compressed_tensors_layerwise: layers='model.layer' names no module"):
        qstats.export.compressed_tensors_layerwise(model, llama, qparams, str(tmp_path / "c"), plan,
                                                   layers="model.layer", progress=False)
