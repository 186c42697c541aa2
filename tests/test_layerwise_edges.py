"""Edge cases of qstats.calibrate_layerwise and compressed_tensors_layerwise against the full model.

The reference is what a user migrating from the loaded model gets: `qstats.calibrate` and
`qstats.export.compressed_tensors` on transformers' ``from_pretrained`` model. Tiny random-weight
models are saved in several safetensors shards: a mixture of experts whose config asks for router
logits, a checkpoint mixing float32 and bfloat16 tensors, and models whose layers mix
sliding-window and full attention (Gemma2/3, Qwen2, ModernBERT; a multimodal Gemma3, whose
``layer_types`` are on ``text_config``).
"""

from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from _shared import assert_site_states_equal  # noqa: E402

SPEC_W = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
SPEC_A = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=SPEC_A),
                        qstats.Rule("Linear", sites=("weight",), spec=SPEC_W)])  # fmt: skip


def _batches(labels: bool = False) -> list:
    generator = torch.Generator().manual_seed(0)
    out = []
    for index in range(3):
        ids = torch.randint(0, 96, (2, 5 + 2 * index), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, : 1 + index] = 0  # left padding
        out.append({"input_ids": ids, "attention_mask": mask, **({"labels": ids} if labels else {})})
    return out


def _weight(batch):
    return batch["attention_mask"]


def _meta(directory: str, **options) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, **options).eval()


def _saved(tmp_path, config, dtype=torch.float32) -> str:
    directory = str(tmp_path / "checkpoint")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(directory, max_shard_size="20KB")
    assert len(glob.glob(os.path.join(directory, "*.safetensors"))) >= 3
    return directory


@pytest.mark.parametrize("labels", [False, True])
def test_a_moe_whose_config_outputs_router_logits_equals_the_full_model(tmp_path, labels):
    """``config.output_router_logits=True``: the model's forward computes its load-balancing loss
    from the router logits gathered in the layers. The modules after the layers were observed
    with the layers stood in for, which gather none: an IndexError inside transformers."""
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True)  # fmt: skip
    directory = _saved(tmp_path, config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    batches = _batches(labels)
    want = qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=_weight)
    got = qstats.calibrate_layerwise(_meta(directory), directory, batches, RECIPE, progress=False,
                                     observation_weight=_weight)  # fmt: skip
    assert_site_states_equal(got, want)
    assert "lm_head" in got


def _mixed_dtype_checkpoint(tmp_path) -> str:
    """A bfloat16 Llama checkpoint whose norms are stored in float32 (as some checkpoints keep them)."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    directory = _saved(tmp_path, config, torch.bfloat16)
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        tensors = {key: value.float() if "norm" in key else value for key, value in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return directory


def test_a_checkpoint_mixing_dtypes_reads_as_from_pretrained_casts_it(tmp_path):
    """Read in their stored dtypes, the float32 norms made the next Linear's input float32 beside
    its bfloat16 weight (torch's "expected m1 and m2 to have the same dtype"). from_pretrained
    casts every tensor to the model's dtype: "auto" (the config's bfloat16), or the one asked for."""
    directory = _mixed_dtype_checkpoint(tmp_path)
    batches = _batches()
    for dtype, options in (("auto", {}), (torch.float32, {"dtype": torch.float32})):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        want = qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=_weight)
        got = qstats.calibrate_layerwise(_meta(directory, **options), directory, batches, RECIPE, progress=False,
                                         observation_weight=_weight)  # fmt: skip
        assert_site_states_equal(got, want)
    assert got["model.layers.0.mlp.down_proj"]["input"].min_val.dtype == torch.float32


def test_a_checkpoint_mixing_dtypes_exports_as_the_loaded_model(tmp_path):
    """compressed_tensors_layerwise writes the tensors the in-memory export of from_pretrained's
    model writes: the float32 norms in the model's bfloat16, as that model holds them."""
    directory = _mixed_dtype_checkpoint(tmp_path)
    model = _meta(directory)
    plan = RECIPE.resolve(model)
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate_layerwise(model, directory, _batches(), plan, progress=False), plan)
    ours = str(tmp_path / "ours")
    qstats.export.compressed_tensors_layerwise(model, directory, qparams, ours, plan, progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    whole = str(tmp_path / "whole")
    qstats.export.compressed_tensors(loaded, qparams, whole, RECIPE.resolve(loaded))
    tensors = [{key: value for path in glob.glob(os.path.join(folder, "*.safetensors"))
                for key, value in load_file(path).items()} for folder in (ours, whole)]  # fmt: skip
    assert sorted(tensors[0]) == sorted(tensors[1])
    for key, value in tensors[1].items():
        assert tensors[0][key].dtype == value.dtype and torch.equal(tensors[0][key], value), key
    assert tensors[0]["model.norm.weight"].dtype == torch.bfloat16


def _quantized_reference(loaded, batches, prefix: str, count: int) -> dict:
    """Each layer calibrated on the loaded model under `fake_quantized` of the layers before it
    (qparams from their own states), the modules after the layers under all of them."""
    plan = RECIPE.resolve(loaded)
    out: dict = {}
    for index in range(count + 1):
        before = {path: entry for path, entry in out.items() if path.startswith(prefix)}
        with qstats.fake_quantized(loaded, qstats.compute_qparams_tree(before, plan), plan):
            states = qstats.calibrate(loaded, batches, plan, progress=False, observation_weight=_weight)
        keep = (lambda p: p.startswith(f"{prefix}{index}.")) if index < count else (lambda p: not p.startswith(prefix))
        out.update({path: entry for path, entry in states.items() if keep(path)})
    return out


KINDS = ["sliding_attention", "full_attention", "sliding_attention"]


def _sliding_configs() -> dict:
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return {
        "gemma2": transformers.Gemma2Config(**common, head_dim=8, sliding_window=3, layer_types=KINDS),
        "gemma3": transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=3, layer_types=KINDS),
        "qwen2": transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=3, max_window_layers=1),
    }


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen2"])
def test_layers_of_several_kinds_get_their_own_masks(tmp_path, name):
    """Sliding-window and full-attention layers (``config.layer_types``) get different masks (and,
    in Gemma3, different rotary embeddings): each layer is called with its own, float and
    quantized propagation equal the loaded model's (were refused with a ValueError)."""
    config = _sliding_configs()[name]
    assert len(set(config.layer_types)) == 2
    directory = _saved(tmp_path, config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    batches = _batches()
    want = qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=_weight)
    got = qstats.calibrate_layerwise(_meta(directory), directory, batches, RECIPE, progress=False,
                                     observation_weight=_weight)  # fmt: skip
    assert_site_states_equal(got, want)
    spill = tmp_path / "spill"
    spill.mkdir()
    got = qstats.calibrate_layerwise(_meta(directory), directory, batches, RECIPE, progress=False, device="cpu",
                                     observation_weight=_weight, propagate="quantized", offload_dir=spill)  # fmt: skip
    assert_site_states_equal(got, _quantized_reference(loaded, batches, "model.layers.", 3))


def test_a_multimodal_model_whose_text_layers_mix_attention_kinds(tmp_path):
    """Gemma3 with a vision tower: its ``layer_types`` are on ``text_config``, the config of its
    language model, not on the model's config. Every layer was called with the first one's
    sliding-window mask and local rotary embeddings, and the states of the full-attention
    layers differed from the full model's, silently."""
    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, image_size=16, patch_size=8)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)  # fmt: skip
    assert getattr(config, "layer_types", None) is None
    directory = str(tmp_path / "gemma3")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(directory, max_shard_size="20KB")
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    batches = _batches()
    want = qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=_weight)
    for layers in (None, "model.language_model.layers"):
        with torch.device("meta"):
            meta = transformers.AutoModelForImageTextToText.from_config(config).eval()
        got = qstats.calibrate_layerwise(meta, directory, batches, RECIPE, progress=False, layers=layers,
                                         observation_weight=_weight)  # fmt: skip
        assert_site_states_equal(got, want)


def test_modernbert_reads_its_layers_attention_type_through_the_stand_ins(tmp_path):
    """ModernBERT's forward picks each layer's mask by ``encoder_layer.attention_type``: the layers
    standing in (capture, and the modules after the layers) answer with the real layer's."""
    config = transformers.ModernBertConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, global_attn_every_n_layers=3, local_attention=4, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1)  # fmt: skip
    directory = str(tmp_path / "modernbert")
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(directory, max_shard_size="20KB")
    loaded = transformers.AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    batches = [{key: value for key, value in batch.items()} for batch in _batches()]
    for batch in batches:  # right padding, as an encoder's tokenizer pads
        batch["attention_mask"] = batch["attention_mask"].flip(-1)
    want = qstats.calibrate(loaded, batches, RECIPE, progress=False, observation_weight=_weight)
    with torch.device("meta"):
        meta = transformers.AutoModel.from_config(config).eval()
    got = qstats.calibrate_layerwise(meta, directory, batches, RECIPE, progress=False, observation_weight=_weight)
    assert_site_states_equal(got, want)


def test_a_float8_tensor_in_the_checkpoint_is_named_not_upcast(tmp_path):
    """A checkpoint storing a weight in float8 (a quantized checkpoint, its scales elsewhere) is not
    cast to the model's dtype as a bfloat16 or float32 tensor is (that would drop its scales): a
    ValueError names it when its layer is read (it failed inside torch's matmul), the model left on meta."""
    directory = _mixed_dtype_checkpoint(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        tensors = load_file(path)
        if name in tensors:
            tensors[name] = tensors[name].to(torch.float8_e4m3fn)
            save_file(tensors, path, metadata={"format": "pt"})
    model = _meta(directory)
    with pytest.raises(ValueError, match=f"{name!r} is stored as torch.float8_e4m3fn, the model's is torch.bfloat16"):
        qstats.calibrate_layerwise(model, directory, _batches(), RECIPE, progress=False)
    assert all(param.device.type == "meta" for param in model.parameters())
