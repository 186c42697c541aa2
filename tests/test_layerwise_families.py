"""`calibrate_layerwise` on transformers families as users bring them: built from small random configs,
saved by ``save_pretrained`` in shards of 20KB, calibrated over padded batches with their
``attention_mask`` (and an ``observation_weight`` leaving the padding out), batches of other lengths,
explicit ``position_ids`` and a batch of one token. The reference is `qstats.calibrate` of the model
``from_pretrained`` loads: the states are equal bit for bit.

The per-expert states of stacked experts are checked against a loop over the experts (the tokens the
router sends to each, padding left out), computed here from the experts' own inputs."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

W8 = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
A8 = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
NO_HEAD_DIM = {k: v for k, v in SMALL.items() if k != "head_dim"}

CONFIGS = {
    "deepseek_v3_shared_experts": lambda: transformers.DeepseekV3Config(
        **{**NO_HEAD_DIM, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                     num_experts=4, num_experts_per_tok=2),
    "phi3": lambda: transformers.Phi3Config(**NO_HEAD_DIM, pad_token_id=0),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **SMALL, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        no_rope_layers=[1, 0, 1], attention_chunk_size=4),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**SMALL, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "olmoe": lambda: transformers.OlmoeConfig(**NO_HEAD_DIM, num_experts=4, num_experts_per_tok=2),
    "phimoe": lambda: transformers.PhimoeConfig(**NO_HEAD_DIM, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(  # gated delta-net (linear attention) then full attention
        **SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "gemma3n_text": lambda: transformers.Gemma3nTextConfig(
        vocab_size=96, vocab_size_per_layer_input=96, hidden_size=32, hidden_size_per_layer_input=8, intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], altup_num_inputs=2, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}  # fmt: skip


def _recipe(model) -> qstats.Recipe:
    experts = tuple(sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")}))
    rules = [qstats.Rule("Linear", sites=("input",), spec=A8), qstats.Rule("Linear", sites=("weight",), spec=W8)]
    if experts:
        rules += [qstats.Rule(experts, sites=("input", "down_proj.input"), spec=A8),
                  qstats.Rule(experts, sites=("gate_up_proj", "down_proj"), spec=W8)]
    return qstats.Recipe(rules)


def _batches() -> list:
    generator = torch.Generator().manual_seed(1)
    ids = lambda *shape: torch.randint(0, 96, shape, generator=generator)  # noqa: E731
    left, right = torch.ones(2, 8, dtype=torch.long), torch.ones(3, 5, dtype=torch.long)
    left[1, :3], right[0, 3:] = 0, 0  # left padding in one batch, right padding in the other
    return [{"input_ids": ids(2, 8), "attention_mask": left}, {"input_ids": ids(3, 5), "attention_mask": right},
            {"input_ids": ids(2, 6), "position_ids": torch.arange(3, 9).expand(2, 6)},
            {"input_ids": ids(1, 4), "position_ids": torch.tensor([[0, 1, 0, 1]])},  # two packed sequences
            {"input_ids": ids(1, 1)}]


def _weight(batch):
    return batch.get("attention_mask")


def _saved(config) -> str:
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="20KB")
    return folder


def _both(config, folder, batches, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = _recipe(meta)
    states = qstats.calibrate_layerwise(meta, folder, batches, recipe, progress=False, **options)
    return qstats.calibrate(loaded, batches, recipe, progress=False, **options), states, loaded


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_states_equal_a_full_calibrate_of_the_loaded_model(family):
    config = CONFIGS[family]()
    full, states, _ = _both(config, _saved(config), _batches(), observation_weight=_weight, all_experts=True)
    assert set(states) == set(full)
    for path in full:
        for site in full[path]:
            assert all(torch.equal(a, b) for a, b in zip(full[path][site], states[path][site])), (family, path, site)


def _loop_over_experts(experts: torch.nn.Module, calls: list, batches: list):
    """Per expert: min and max of its inputs and of its down_proj's inputs over the tokens routed to
    it, the padding left out, and how many values each saw; from the stacked experts' own inputs."""
    count = experts.gate_up_proj.shape[0]
    low, high = torch.full((2, count), float("inf")), torch.full((2, count), -float("inf"))
    seen = torch.zeros(count, dtype=torch.long)
    for (hidden, index, _), batch in zip(calls, batches):
        keep = batch["attention_mask"].reshape(-1).bool()
        hidden, index = hidden.reshape(-1, hidden.shape[-1]), index.reshape(-1, index.shape[-1])
        for expert in range(count):
            routed = (index == expert).any(-1)
            if not (routed & keep).any():
                continue
            # the same rows through the expert as transformers sends them (padding too): one matmul
            gate, up = torch.nn.functional.linear(hidden[routed], experts.gate_up_proj[expert]).chunk(2, -1)
            for row, values in enumerate((hidden[routed & keep], (experts.act_fn(gate) * up)[keep[routed]])):
                low[row, expert] = torch.minimum(low[row, expert], values.min())
                high[row, expert] = torch.maximum(high[row, expert], values.max())
            seen[expert] += int((routed & keep).sum()) * hidden.shape[-1]
    return low, high, seen


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stacked_experts_states_equal_a_loop_over_the_experts(family):
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=16, num_experts=16, num_experts_per_tok=1)
    else:
        config = transformers.MixtralConfig(**SMALL, num_local_experts=16, num_experts_per_tok=1)
    batches = _batches()[:2]  # the padded ones: top-1 of 16 experts leaves some experts without a token
    _, states, loaded = _both(config, _saved(config), batches, observation_weight=_weight)
    for number, layer in enumerate(loaded.model.layers):
        calls = []
        hook = layer.mlp.experts.register_forward_hook(lambda module, args, output: calls.append(args))
        with torch.no_grad():
            for batch in batches:
                loaded(**batch)
        hook.remove()
        low, high, seen = _loop_over_experts(layer.mlp.experts, calls, batches)
        state = states[f"model.layers.{number}.mlp.experts"]
        routed = torch.isfinite(low[0])
        assert 0 < int(routed.sum()) < 16  # some experts routed, some not
        for row, site in enumerate(("input", "down_proj.input")):
            assert torch.equal(state[site].min_val.reshape(-1)[routed], low[row, routed]), (number, site)
            assert torch.equal(state[site].max_val.reshape(-1)[routed], high[row, routed]), (number, site)
        assert torch.equal(state["input"].count.reshape(-1), seen)


def _vision_language(family):
    """(model class, config, image batches) of a tiny Llava (CLIP and Llama) or Gemma3 (SigLIP, whose
    image tokens attend to each other both ways: ``token_type_ids``): 4 image tokens a picture."""
    if family == "llava":
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                               num_attention_heads=4, image_size=16, patch_size=8, projection_dim=32)
        config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**SMALL),
                                          image_token_index=95, vision_feature_layer=-2)
        model_class = transformers.LlavaForConditionalGeneration
    else:
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                                 num_attention_heads=4, image_size=16, patch_size=4)
        text = transformers.Gemma3TextConfig(**SMALL, sliding_window=4, sliding_window_pattern=2)
        config = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                           image_token_index=95, boi_token_index=93, eoi_token_index=94)
        model_class = transformers.Gemma3ForConditionalGeneration
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 90, (2, 12), generator=generator)
        ids[:, 2:6] = 95
        batch = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=generator),
                 "attention_mask": torch.ones(2, 12, dtype=torch.long)}
        if family == "gemma3":
            batch["token_type_ids"] = (ids == 95).long()
        batches.append(batch)
    return model_class, config, batches


@pytest.mark.parametrize("skip_vision", [True, False], ids=["vision tower skipped", "vision tower calibrated"])
@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_a_vision_language_model_calibrated_on_images_equals_a_full_calibrate(family, skip_vision):
    model_class, config, batches = _vision_language(family)
    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    model_class(config).save_pretrained(folder, max_shard_size="20KB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.device("meta"):
        meta = model_class(config).eval()
    ignore = ["re:.*vision_tower.*", "re:.*multi_modal_projector.*", "lm_head"] if skip_vision else []
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=ignore)
    states = qstats.calibrate_layerwise(meta, folder, batches, recipe, progress=False)
    full = qstats.calibrate(loaded, batches, recipe, progress=False)
    assert set(states) == set(full)
    assert any("vision_tower" in path for path in full) != skip_vision
    for path in full:
        for site in full[path]:
            assert all(torch.equal(a, b) for a, b in zip(full[path][site], states[path][site])), (path, site)
