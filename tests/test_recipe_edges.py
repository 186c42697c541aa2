"""Edge cases of recipes read from compressed-tensors configs and llm-compressor recipes, against
compressed-tensors' own ``apply_quantization_config`` (and llm-compressor's
``resolve_quantization_config``) on a tiny random Llama: attention groups compressed-tensors
refuses, attention-only groups, empty targets, preset-named config groups, kv-cache-only
checkpoints, and recipes given as a list of modifiers or a path."""

import copy
import pathlib
import warnings

import pytest
import torch

import qstats

pytest.importorskip("compressed_tensors.quantization")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module  # noqa: E402
from compressed_tensors.quantization.utils import KV_CACHE_TARGETS  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
_SITES = (("weights", "weight"), ("input_activations", "input"), ("output_activations", "output"))


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _apply(model, config):
    model = copy.deepcopy(model)
    apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    return model


def _theirs(model, config) -> dict:
    """``{path: {site: (QuantSpec, dynamic)}}`` of the modules compressed-tensors quantizes."""
    out = {}
    for path, module in _apply(model, config).named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if is_cached_attention_module(module):
            sites = ("k", "v") if scheme.targets == KV_CACHE_TARGETS else ("q", "k", "v")
            args = {site: scheme.input_activations for site in sites}
        else:
            args = {site: getattr(scheme, key) for key, site in _SITES if getattr(scheme, key) is not None}
        if args:
            out[path] = {site: (qstats.QuantSpec.from_compressed_tensors(a), a.dynamic is True)
                         for site, a in args.items()}
    return out


def _ours(model, recipe) -> dict:
    plan = recipe.resolve(model)
    return {path: {site: (found.spec, found.rule.dynamic) for site, found in entry.items()}
            for path, entry in plan.sites.items()}


def _config(*groups, ignore=(), kv=None) -> dict:
    return {"config_groups": {f"group_{i}": group for i, group in enumerate(groups)}, "ignore": list(ignore),
            "kv_cache_scheme": kv}


@pytest.mark.parametrize("group, theirs", [
    ({"targets": ["re:.*self_attn$"], "weights": W8, "input_activations": FP8}, "weight quantization to attention"),
    ({"targets": ["LlamaAttention"], "weights": W8}, "weight quantization to attention"),
    ({"targets": ["Linear", "re:.*self_attn$"], "input_activations": FP8, "output_activations": FP8},
     "output quantization to attention"),
    ({"targets": ["re:.*self_attn$"], "output_activations": FP8}, "attention quantization without specifying input activations"),
])
def test_a_group_compressed_tensors_refuses_on_attention_is_refused_naming_it(llama, group, theirs):
    """Before: resolved without error, the attention module quantizing nothing (or q/k/v where the
    group also had output args), with 'selects no site' warnings that did not say why."""
    config = _config(group)
    with pytest.raises(ValueError, match=f"(?i)cannot apply {theirs}"):
        _apply(llama, config)
    recipe = qstats.Recipe.from_compressed_tensors(config)
    with pytest.raises(ValueError, match=f"narrowly matches the attention module 'model.layers.0.self_attn', "
                                         f"which compressed-tensors refuses: cannot apply {theirs}"):
        recipe.resolve(llama)


@pytest.mark.parametrize("targets", [["LlamaAttention"], ["re:.*self_attn$"]])
def test_an_attention_only_group_takes_q_k_v_without_warning(llama, targets):
    """llm-compressor's attention quantization (a group of input args naming attention modules):
    q, k and v as compressed-tensors gives them. Before: its input rule warned 'selects no site'."""
    config = _config({"targets": targets, "input_activations": FP8}, kv=FP8)
    recipe = qstats.Recipe.from_compressed_tensors(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ours = _ours(llama, recipe)
    assert ours == _theirs(llama, config) and sorted(ours["model.layers.1.self_attn"]) == ["k", "q", "v"]


def test_empty_targets_quantize_nothing_as_llm_compressor_and_warn(llama):
    """``targets=[]`` targets nothing in compressed-tensors and llm-compressor. Before: read as
    ``"Linear"``, quantizing every Linear."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    config = QuantizationModifier(scheme="W8A16", targets=[]).resolve_quantization_config().model_dump()
    assert _theirs(llama, config) == {}
    for recipe in (qstats.Recipe.from_scheme("W8A16", targets=[]),
                   qstats.Recipe.from_compressed_tensors(_config({"targets": [], "weights": W8}))):
        with pytest.warns(UserWarning, match=r"targets \[\] selects no site \['weight'\]"):
            assert _ours(llama, recipe) == {}


def test_a_config_group_named_by_a_preset_reads_as_compressed_tensors(llama):
    """compressed-tensors' ``QuantizationConfig`` takes ``{"W4A16": ["Linear"]}`` groups (a preset
    name mapped to its targets). Before: TypeError, 'must be a mapping'."""
    config = {"config_groups": {"W8A16": ["Linear"], "FP8": ["re:.*down_proj"]}, "ignore": ["lm_head"]}
    ours = _ours(llama, qstats.Recipe.from_compressed_tensors(config))
    assert ours == _theirs(llama, config) and sorted(ours["model.layers.0.mlp.down_proj"]) == ["input", "weight"]
    with pytest.raises(TypeError, match=r"config_groups\['g'\] must be a mapping of scheme fields"):
        qstats.Recipe.from_compressed_tensors({"config_groups": {"g": ["Linear"]}})


def test_a_kv_cache_only_checkpoint_config_reads_back(llama):
    """A kv-cache-only model's config (compressed-tensors' ``from_pretrained``: no config group)
    reads as its kv-cache rule. Before: ValueError, 'config_groups' must be non-empty."""
    config = _config({"targets": ["Linear"]}, kv=FP8)
    written = QuantizationConfig.from_pretrained(_apply(llama, config)).model_dump()
    assert written["config_groups"] == {} and written["kv_cache_scheme"] is not None
    recipe = qstats.Recipe.from_compressed_tensors(written)
    assert _ours(llama, recipe) == _theirs(llama, config) == _theirs(llama, written)
    with pytest.raises(ValueError, match="non-empty unless a 'kv_cache_scheme' is given"):
        qstats.Recipe.from_compressed_tensors({"config_groups": {}})


def test_a_kv_cache_scheme_on_a_model_without_cached_attention_warns_naming_it():
    """GPT-2's attention is no cached attention module of compressed-tensors' (no k_proj/v_proj):
    the kv-cache rule selects nothing and the warning names it (it named 're:.*')."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2,
                                                                 n_positions=16, bos_token_id=0, eos_token_id=0))
    assert not any(is_cached_attention_module(module) for module in model.modules())
    recipe = qstats.Recipe.from_scheme("FP8", targets=["Embedding"], kv_cache_scheme=FP8)
    with pytest.warns(UserWarning, match=r"targets \['kv_cache_scheme'\] selects no site \['k', 'v'\]"):
        recipe.resolve(model)


LLMC_YAML = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      config_groups:
        group_0: {targets: [Linear], weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}}
      ignore: [lm_head]
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: tensor, dynamic: false}
"""


def test_an_llm_compressor_recipe_as_a_list_of_modifiers_or_a_path(llama, tmp_path):
    """``oneshot(recipe=[modifier])`` and a recipe file's ``pathlib.Path`` read as the modifier.
    Before: TypeError, 'got list' / 'got PosixPath'."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.recipe import Recipe as LLMCompressorRecipe

    path = tmp_path / "recipe.yaml"
    path.write_text(LLMC_YAML)
    (modifier,) = LLMCompressorRecipe.create_instance(str(path)).modifiers
    theirs = _theirs(llama, modifier.resolve_quantization_config().model_dump())
    assert "model.layers.0.self_attn" in theirs and "lm_head" not in theirs
    assert _ours(llama, qstats.Recipe.from_compressed_tensors(pathlib.Path(path))) == theirs
    assert _ours(llama, qstats.Recipe.from_compressed_tensors([modifier])) == theirs
    with pytest.raises(ValueError, match="several quantization modifiers"):
        qstats.Recipe.from_compressed_tensors([modifier, copy.deepcopy(modifier)])


@pytest.mark.parametrize("config", [
    _config({"targets": ["Linear"]}, kv={**FP8, "strategy": "attn_head"}),
    _config({"targets": ["re:.*self_attn$"], "input_activations": {**FP8, "strategy": "attn_head"}}),
])
def test_attn_head_q_k_v_args_resolve_as_compressed_tensors_applies_them_one_scale_per_head(llama, config):
    """compressed-tensors gives ``attn_head`` k/v one scale per kv head, ``(heads, 1, 1)``, q one per
    attention head: qstats' sites are per head (`PerHead(1)` of the attention function's ``[batch,
    heads, tokens, head_dim]``). Before: refused ('strategy attn_head ... not supported')."""
    theirs = _theirs(llama, config)
    attention = _apply(llama, config).model.layers[0].self_attn
    assert tuple(attention.k_scale.shape) == (llama.config.num_key_value_heads, 1, 1)
    assert {spec.granularity for entry in theirs.values() for spec, _ in entry.values()} == {qstats.PerHead(1)}
    assert _ours(llama, qstats.Recipe.from_compressed_tensors(config)) == theirs
    if config["kv_cache_scheme"]:
        scheme = qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": W8}, kv_cache_scheme=config["kv_cache_scheme"])
        ours = _ours(llama, scheme)
        assert {path: ours[path] for path in theirs} == theirs


def test_attn_head_input_args_of_a_group_matching_linear_modules_too_are_refused_as_compressed_tensors_refuses_them(
        llama):
    """A group quantizing attention modules per head whose targets also match a Linear: compressed-tensors
    refuses its input args there; so does `Recipe.resolve`, naming the Linear."""
    config = _config({"targets": ["re:.*self_attn$", "re:.*mlp.down_proj$"],
                      "input_activations": {**FP8, "strategy": "attn_head"}})
    with pytest.raises(ValueError, match="at least 3 observed dimensions"):
        _apply(llama, config)
    recipe = qstats.Recipe.from_compressed_tensors(config)
    with pytest.raises(ValueError, match=r"matches the Linear 'model.layers.0.mlp.down_proj': strategy 'attn_head' .* "
                                         "not supported on Linear"):
        recipe.resolve(llama)


@pytest.mark.parametrize("group", [
    {"targets": ["Linear"], "weights": W8, "input_activations": {**FP8, "strategy": "attn_head"}},
    {"targets": ["Linear"], "weights": {**W8, "strategy": "attn_head"}},
])
def test_attn_head_args_of_linear_modules_are_refused_as_compressed_tensors_refuses_them(llama, group):
    """Before: accepted as PerHead(1) of a Linear's weight or input (its second axis)."""
    with pytest.raises(ValueError, match="at least 3 observed dimensions"):
        _apply(llama, _config(group))
    with pytest.raises(ValueError, match="strategy 'attn_head' .* not supported"):
        qstats.Recipe.from_compressed_tensors(_config(group))


def test_a_channel_kv_cache_scheme_is_refused_as_compressed_tensors_refuses_it(llama):
    """Before: accepted, calibration failing on its per-row state between batches of other lengths."""
    kv = {**FP8, "strategy": "channel"}
    with pytest.raises(NotImplementedError, match="channel strategy is not supported for activation quantization"):
        _apply(llama, _config({"targets": ["Linear"]}, kv=kv))
    with pytest.raises(ValueError, match="kv_cache_scheme: .*channel strategy is not supported for activation"):
        qstats.Recipe.from_scheme("W8A16", kv_cache_scheme=kv)


def test_kv_cache_of_an_attention_module_without_k_v_projections_is_compressed_tensors():
    """Phi-3's attention (a fused qkv_proj) is a cached attention module: compressed-tensors gives it
    k/v scales, and qstats its attention function's key and value. Before: its kv quantization was
    dropped with a 'selects no site' warning, then refused at resolve."""
    config = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=0,
                                     bos_token_id=0)
    model = transformers.Phi3ForCausalLM(config).eval()
    theirs = _theirs(model, _config({"targets": ["Linear"]}, kv=FP8))
    assert theirs == {"model.layers.0.self_attn": {site: (qstats.QuantSpec.from_compressed_tensors(FP8), False)
                                                   for site in "kv"}}
    ours = _ours(model, qstats.Recipe.from_compressed_tensors(_config({"targets": ["Linear"]}, kv=FP8)))
    assert ours == theirs
    recipe = qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": W8}, kv_cache_scheme=FP8, ignore=["lm_head"])
    assert sorted(recipe.resolve(model).sites["model.layers.0.self_attn"]) == ["k", "v"]
    ignored = qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": W8}, kv_cache_scheme=FP8,
                                        ignore=["lm_head", "re:.*self_attn$"])
    with pytest.raises(ValueError, match=r"kv_cache_scheme .* ignore skips every one \('model\.layers\.0\.self_attn'\)"):
        ignored.resolve(model)  # its only attention module ignored: no checkpoint kv-cache scheme to write


def test_kv_cache_of_a_non_transformers_attention_module_without_k_v_projections_is_refused_naming_it():
    """An attention module compressed-tensors caches (a qkv_proj child, a forward taking
    past_key_values) that holds no transformers config: qstats finds its q/k/v by their child
    projections, which it has not, and refuses rather than drop that quantization."""

    class FusedAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(8, 24)

        def forward(self, x, past_key_values=None):
            return self.qkv_proj(x)[..., :8]

    model = torch.nn.ModuleDict({"layer": torch.nn.ModuleDict({"self_attn": FusedAttention()})})
    assert is_cached_attention_module(model.layer.self_attn)
    recipe = qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": W8}, kv_cache_scheme=FP8)
    with pytest.raises(ValueError, match=r"kv_cache_scheme applies to the attention module 'layer.self_attn' \(FusedAttention\).*"
                                         r"no transformers attention module.*k_proj/v_proj children"):
        recipe.resolve(model)
    group = qstats.Recipe.from_compressed_tensors(_config({"targets": ["re:.*self_attn$"], "input_activations": FP8}))
    with pytest.raises(ValueError, match=r"config group 0 applies to the attention module .*q_proj/k_proj/v_proj"):
        group.resolve(model)


def test_verbose_and_stacked_flag_ignore_regexes_read_as_compressed_tensors(llama):
    """compressed-tensors ``re.match``-es ``(?x)`` regexes with a trailing comment and several leading
    flag groups. Before: ValueError, 'invalid regular expression' of the rewritten form."""
    config = _config({"targets": ["Linear"], "weights": W8},
                     ignore=["re:(?x) .*self_attn  # the attention", "re:(?i)(?s).*MLP.DOWN", "lm_head"])
    theirs = _theirs(llama, config)
    assert sorted(theirs) == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                              "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert _ours(llama, qstats.Recipe.from_compressed_tensors(config)) == theirs
    scheme = qstats.Recipe.from_scheme({"targets": ["Linear"], "weights": W8}, ignore=config["ignore"])
    assert _ours(llama, scheme) == theirs


def test_a_rule_given_an_observer_instead_of_its_factory_names_the_mistake():
    spec = qstats.QuantSpec(dtype="int8")
    with pytest.raises(TypeError, match=r"Rule.observer got an Observer \(minmax\); give the factory"):
        qstats.Rule("Linear", sites=("weight",), observer=qstats.minmax(spec), spec=spec)
