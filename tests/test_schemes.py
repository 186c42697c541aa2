"""`Recipe.from_scheme` against llm-compressor 0.14's ``oneshot``: a tiny random Llama calibrated
by both with the same compressed-tensors preset scheme and the same samples gives the same
checkpoint, tensor for tensor and bit for bit, and the same ``quantization_config``."""

import json
import os

import pytest
import torch
from _oneshot import saved_random_model, token_samples
from _shared import bit_equal, llm_compressor_oneshot, qwen3_moe_config, word_tokenizer

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
pytest.importorskip("tokenizers")
from safetensors.torch import load_file  # noqa: E402

TOKENS = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Llama saved to disk (llm-compressor reads its config there), calibration
    samples (token ids) and a stand-in tokenizer."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False,
    )
    path = saved_random_model(tmp_path_factory, "tiny_llama", transformers.LlamaForCausalLM, config)
    return path, token_samples(3, TOKENS), word_tokenizer()


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory, saved):
    """A tiny random Qwen3-MoE (stacked experts, TopK routers) saved to disk, with the samples."""
    config = qwen3_moe_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    path = saved_random_model(tmp_path_factory, "tiny_qwen3_moe", transformers.Qwen3MoeForCausalLM, config)
    return path, saved[1], saved[2]


@pytest.fixture(scope="module")
def saved_half(tmp_path_factory, saved):
    """The tiny Llama in float16 and in bfloat16, a few weights of each Linear -0.0 (as a float16
    copy of a float32 model holds them where tiny negative weights underflow), with the samples."""
    config = transformers.LlamaConfig.from_pretrained(saved[0])
    paths = {}
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(dtype)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight[::7, ::5] = -0.0
        paths[dtype] = str(tmp_path_factory.mktemp(f"tiny_llama_{str(dtype)[6:]}"))
        model.save_pretrained(paths[dtype])
    return paths, saved[1], saved[2]


def _batches(samples):
    return [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]


def _load(path, dtype=None):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _llm_compressor(saved, scheme, out, ignore, dtype=None):
    """llm-compressor's oneshot (basic pipeline: the model's own forward) and compressed save;
    ``scheme`` a preset name or ``config_groups``."""
    path, samples, tokenizer = saved
    llm_compressor_oneshot(_load(path, dtype), samples, _modifier(scheme, ignore), out, "basic", tokenizer)


def _modifier(scheme, ignore):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if isinstance(scheme, str):
        return QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    return QuantizationModifier(config_groups=scheme, ignore=list(ignore))


def _qstats(saved, scheme, out, ignore, recipe=None, attention="eager", dtype=None):
    path, samples, _ = saved
    model = _load(path, dtype)
    # llm-compressor calibrates under eager attention (its calibration_forward_context)
    model.set_attn_implementation(attention)
    recipe = recipe or qstats.Recipe.from_scheme(scheme, targets="Linear", ignore=ignore)
    plan = recipe.resolve(model)
    # all_experts: llm-compressor's default moe_calibrate_all_experts
    states = qstats.calibrate(model, _batches(samples), plan, progress=False, all_experts=True)
    qparams = qstats.compute_qparams_tree(states, plan)
    qstats.export.compressed_tensors(model, qparams, out, plan)


def _quantization_config(out):
    with open(os.path.join(out, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _assert_same_checkpoint(ours, theirs):
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    different = [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    assert not different, different
    assert _quantization_config(ours) == _quantization_config(theirs)


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC", "NVFP4", "NVFP4A16", "MXFP4", "FP8_BLOCK", "W4AFP8", "W8A16", "MXFP8"])
def test_export_equals_llm_compressor_oneshot(saved, tmp_path, scheme):
    """Every tensor bit for bit, and the whole ``quantization_config`` (groups targeting
    ``["Linear"]``, ``ignore``, observers, formats, version)."""
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved, scheme, theirs, ["lm_head"])
    _qstats(saved, scheme, ours, ["lm_head"])
    _assert_same_checkpoint(ours, theirs)


HALF_SCHEMES = [(torch.bfloat16, "W8A8"), (torch.bfloat16, "W4A16"), (torch.bfloat16, "FP8"), (torch.bfloat16, "NVFP4"),
                (torch.float16, "FP8_DYNAMIC"), (torch.float16, "NVFP4A16"), (torch.float16, "MXFP4A16"),
                (torch.float16, "MXFP8A16")]


@pytest.mark.parametrize("dtype, scheme", HALF_SCHEMES, ids=[f"{str(d)[6:]}-{s}" for d, s in HALF_SCHEMES])
def test_half_precision_export_equals_llm_compressor_oneshot(saved_half, tmp_path, dtype, scheme):
    """A bfloat16 / float16 model, ``observed_dtype`` its dtype: the same checkpoint bit for bit.
    Its -0.0 weights are stored as +0 codes, as llm-compressor compresses them (it adds the zero
    point compressed-tensors registers, zeros, before rounding; qstats' fp4 codes kept the sign)."""
    paths, samples, tokenizer = saved_half
    saved = (paths[dtype], samples, tokenizer)
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved, scheme, theirs, ["lm_head"], dtype)
    recipe = qstats.Recipe.from_scheme(scheme, targets="Linear", ignore=["lm_head"], observed_dtype=dtype)
    _qstats(saved, None, ours, None, recipe=recipe, dtype=dtype)
    _assert_same_checkpoint(ours, theirs)
    # the whole config.json: the model's config as transformers' save_pretrained writes it (its diff
    # from the defaults, no local _name_or_path)
    with open(os.path.join(ours, "config.json")) as file, open(os.path.join(theirs, "config.json")) as other:
        assert json.load(file) == json.load(other)


STATIC_INT8 = {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    # observer None: llm-compressor's "minmax", the moving average of per-batch extremes
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor"},
}}


def test_from_compressed_tensors_of_llm_compressors_config_reproduces_its_checkpoint(saved, tmp_path):
    """A static asymmetric int8 input (moving-average min-max, llm-compressor's default for static
    activations): the recipe read back from llm-compressor's own ``config.json`` calibrates and
    exports the same checkpoint."""
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved, STATIC_INT8, theirs, ["lm_head", "re:.*down_proj"])
    recipe = qstats.Recipe.from_compressed_tensors(_quantization_config(theirs))
    assert sorted(recipe.ignore) == ["lm_head", "model.layers.0.mlp.down_proj"]  # the module names it wrote
    assert [rule.observer for rule in recipe.rules] == [qstats.minmax, qstats.moving_average_minmax]
    _qstats(saved, None, ours, None, recipe=recipe)
    _assert_same_checkpoint(ours, theirs)


def test_sdpa_attention_changes_mlp_input_scales_in_the_last_bits(saved, tmp_path):
    """The one expected difference, named: llm-compressor calibrates under eager attention. The
    model's default (SDPA) attention gives attention outputs differing in the last bits, so the
    static input scales after the attention (the MLP's) differ by at most a few ulps; the
    attention's own inputs are equal."""
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved, "FP8", theirs, ["lm_head"])
    _qstats(saved, "FP8", ours, ["lm_head"], attention="sdpa")
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    scales = [name for name in their_tensors if name.endswith("input_scale")]
    different = {name for name in scales if not bit_equal(our_tensors[name], their_tensors[name])}
    assert different and all(".mlp." in name for name in different)
    for name in different:
        torch.testing.assert_close(our_tensors[name], their_tensors[name], rtol=2e-6, atol=0)


def test_moe_with_ignored_routers_equals_llm_compressor_but_for_expert_targets(saved_moe, tmp_path):
    """Qwen3-MoE, routers ignored: llm-compressor linearizes the stacked experts, qstats observes
    them stacked (``experts=``) and unpacks them at export; every tensor is equal bit for bit and
    ``ignore`` lists the routers. The one named difference: the config group targets the unpacked
    experts by regex (and the other Linears by path) where llm-compressor writes ``["Linear"]``."""
    ignore = ["lm_head", "re:.*mlp.gate$"]
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved_moe, "W8A8", theirs, ignore)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=ignore, experts="Qwen3MoeExperts")
    _qstats(saved_moe, None, ours, None, recipe=recipe)
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert not [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])]
    their_config, our_config = _quantization_config(theirs), _quantization_config(ours)
    assert our_config["ignore"] == their_config["ignore"] == [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]
    (their_group,), (our_group,) = their_config["config_groups"].values(), our_config["config_groups"].values()
    assert their_group.pop("targets") == ["Linear"]
    assert r"re:^model\.layers\.0\.mlp\.experts\.\d+\.down_proj$" in our_group.pop("targets")
    assert our_group == their_group
    assert {k: v for k, v in our_config.items() if k != "config_groups"} == \
        {k: v for k, v in their_config.items() if k != "config_groups"}


@pytest.mark.parametrize("name", ["memoryless_mse", "mse", "minmax", "static_minmax", "memoryless_minmax"])
def test_activation_rule_observer_equals_llm_compressors_observer_of_that_name(name):
    """The rule `Recipe.from_scheme` makes for an activation ``observer=name`` gives the scale
    llm-compressor's observer of that name gives after three batches of different ranges
    (``memoryless_mse``: the latest batch's search, not one over all batches)."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor", observer=name)
    reference = Observer.load_from_registry(name, base_name="input", args=args)
    (rule,) = qstats.Recipe.from_scheme({"input_activations": args}).rules
    obs = rule.observer(rule.spec, **dict(rule.observer_kwargs))
    g = torch.Generator().manual_seed(0)
    state = None
    for i in range(3):
        x = torch.randn(4, 16, 32, generator=g) * (1 + 5 * i)
        x[0, 0, 0] = 40.0 * (i + 1)  # an outlier the search clips, larger in every batch
        reference(x)
        state = obs.update(obs.init(x) if state is None else state, x)
    want = reference.get_qparams()["scale"].reshape(())
    got = qstats.compute_qparams(state, rule.spec, **dict(rule.qparams_kwargs)).scale.reshape(())
    assert torch.allclose(got, want.float(), rtol=1e-6), (got, want)


@pytest.mark.parametrize("name", ["memoryless_mse", "nvfp4_expanded_mse"])
def test_nvfp4_weight_rule_observer_equals_llm_compressors_observer_of_that_name(name):
    """NVFP4 weights under llm-compressor's mse observers (``nvfp4_expanded_mse``: memoryless_mse
    searching 1.8x down to 0.8x the range): `Recipe.from_scheme` refused the name, and qstats.mse
    refused two-level specs. Block scales and global scale equal llm-compressor's bit for bit."""
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from llmcompressor.observers import Observer

    args = NVFP4["weights"].model_copy(update={"observer": name})
    reference = Observer.load_from_registry(name, base_name="weight", args=args)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    w[2, 3] = 30.0
    reference(w)
    want = reference.get_qparams()
    (rule,) = qstats.Recipe.from_scheme({"weights": args}).rules
    obs = rule.observer(rule.spec, **dict(rule.observer_kwargs))
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), rule.spec, **dict(rule.qparams_kwargs))
    assert torch.equal(qp.scale.float(), want["scale"].float().reshape(qp.scale.shape))
    assert torch.equal(qp.global_scale.reshape(1), want["global_scale"].float().reshape(1))


@pytest.fixture(scope="module")
def saved_gqa(tmp_path_factory, saved):
    """The tiny Llama with 2 KV heads of 32: k_proj and v_proj are 64x128, half a 128x128 block."""
    config = transformers.LlamaConfig.from_pretrained(saved[0])
    config.num_key_value_heads = 2
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny_llama_gqa"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path, saved[1], saved[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fp8_block_with_a_partial_block_equals_llm_compressor_oneshot(saved_gqa, tmp_path, dtype):
    """FP8_BLOCK on a k_proj/v_proj of 64x128 rows (2 KV heads of 32): llm-compressor pads the edge
    block (a scale grid of ceil(64 / 128) x 1); qstats refused it. Now every tensor, the (1, 1)
    weight_scale included, is equal bit for bit."""
    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    _llm_compressor(saved_gqa, "FP8_BLOCK", theirs, ["lm_head"], dtype)
    recipe = qstats.Recipe.from_scheme("FP8_BLOCK", targets="Linear", ignore=["lm_head"], observed_dtype=dtype)
    _qstats(saved_gqa, None, ours, None, recipe=recipe, dtype=dtype)
    _assert_same_checkpoint(ours, theirs)
    their_scale = load_file(os.path.join(theirs, "model.safetensors"))["model.layers.0.self_attn.k_proj.weight_scale"]
    assert their_scale.shape == (1, 1)


def test_from_compressed_tensors_block_strategy_takes_partial_edge_blocks():
    spec = qstats.QuantSpec.from_compressed_tensors(
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]})
    assert spec.granularity.partial


@pytest.mark.parametrize("build", [
    lambda: qstats.Recipe.from_scheme("W8A8"),
    lambda: qstats.Recipe.from_compressed_tensors({"config_groups": {}}),
])
def test_a_missing_compressed_tensors_names_the_install(build, monkeypatch):
    """compressed-tensors is an optional dependency (the ``calibrate`` extra): without it, the
    recipes read from its schemes say what to install (was: a bare ModuleNotFoundError)."""
    import sys

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    with pytest.raises(ImportError, match=r"needs compressed-tensors: pip install 'qstats\[calibrate\]'"):
        build()
