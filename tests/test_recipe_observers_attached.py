"""The observer each site of a Recipe read from an llm-compressor modifier gets, against the observer
llm-compressor 0.14 itself attaches to that module and site (``QuantizationMixin.start_calibration``):
its class and the options its instance holds (averaging constant, mse search options and patience),
with the modifier's observer overrides (``weight_observer``, ``input_observer``, the ``observer`` dict,
names in any case), explicit observers in config groups, kv-cache and attention groups, dynamic args
(no observer), on a tiny Llama and on a Qwen3-MoE whose experts llm-compressor linearizes."""

import copy
import inspect
import re
import warnings

import pytest
import torch

import qstats
from _shared import qwen3_moe_config

pytest.importorskip("llmcompressor")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import is_cached_attention_module  # noqa: E402
from llmcompressor.modifiers.gptq import GPTQModifier  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
A8 = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor", "dynamic": False}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
_KEYS = (("weights", "weight"), ("input_activations", "input"), ("output_activations", "output"))
# a linearized expert's Linear -> the stacked site of qstats holding it
_STACKED = {("gate_proj", "weight"): "gate_up_proj", ("up_proj", "weight"): "gate_up_proj",
            ("down_proj", "weight"): "down_proj", ("gate_proj", "input"): "input", ("up_proj", "input"): "input",
            ("down_proj", "input"): "down_proj.input"}


def _search(observer) -> dict:
    return {"maxshrink": observer.maxshrink, "grid": observer.grid, "norm": observer.norm, "expand": observer.expand,
            "patience": observer.patience}


def _llm_compressors(observer, site: str):
    """``(qstats observer name, options)`` doing what llm-compressor's attached ``observer`` does, from
    the values its instance holds; None for none (dynamic args)."""
    if observer is None:
        return None
    name = type(observer).__name__
    if site == "weight":  # observed once: every min-max observer is the static one
        if name in ("MemorylessMinMaxObserver", "StaticMinMaxObserver", "MinMaxObserver"):
            return "minmax", {}
        return "mse", _search(observer)  # a single search, averaging unused
    if name == "MemorylessMinMaxObserver":
        return "memoryless_minmax", {}
    if name == "StaticMinMaxObserver":
        return "minmax", {}
    if name == "MinMaxObserver":
        return "moving_average_minmax", {"averaging_constant": observer.avg_constant}
    constant = observer.avg_constant if name == "MovingAverageMSEObserver" else 1.0
    return "mse", {"mode": "moving_average", "averaging_constant": constant, **_search(observer)}


def _ours(found):
    """``(qstats observer name, options)`` of a Site: its factory's defaults, its observer_kwargs and
    qparams_kwargs; None for a dynamic one."""
    if found.rule.dynamic:
        return None
    factory = found.rule.observer
    defaults = {name: p.default for name, p in inspect.signature(factory).parameters.items()
                if name != "spec" and p.default is not inspect.Parameter.empty}
    options = {**defaults, **dict(found.rule.observer_kwargs), **dict(found.rule.qparams_kwargs)}
    name = qstats.observers.registry.name_of(factory)
    if name == "mse":
        keys = ["maxshrink", "grid", "norm", "expand", "patience"]
        if options["mode"] == "moving_average":  # else a weight's single search
            keys = ["mode", "averaging_constant", *keys]
            if not isinstance(options["patience"], int):  # mse's documented default there: 5
                options["patience"] = 5
        return name, {key: options[key] for key in keys}
    return name, {key: options[key] for key in ("averaging_constant",) if key in options}


def started_copy(model, modifier):
    """A copy of ``model`` as llm-compressor's ``modifier`` (copied too) leaves it at the start of
    calibration: experts linearized where it linearizes them, schemes and observers attached."""
    model = copy.deepcopy(model)
    modifier = copy.deepcopy(modifier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if any(qstats.experts.linearized_experts(path, m) for path, m in model.named_modules()):
            from llmcompressor.modeling.moe.linearize import linearize_moe

            linearize_moe(model)
        modifier.initialize_quantization(model)
        modifier.start_calibration(model)
    return model


def _theirs_attached(model, modifier) -> dict:
    """``{path: {site: (qstats name, options) or None}}`` of llm-compressor's own observers."""
    model = started_copy(model, modifier)
    out: dict = {}
    for path, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if is_cached_attention_module(module):
            sites = ("k", "v") if getattr(module, "q_observer", None) is None else ("q", "k", "v")
        else:
            sites = tuple(site for key, site in _KEYS if getattr(scheme, key) is not None)
        entry = {site: _llm_compressors(getattr(module, f"{site}_observer", None), site) for site in sites}
        expert = re.fullmatch(r"(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)", path)
        if expert:
            path, entry = expert.group(1), {_STACKED[expert.group(2), site]: v for site, v in entry.items()}
        assert all(out.get(path, {}).get(site, value) == value for site, value in entry.items()), path
        out.setdefault(path, {}).update(entry)
    return out


def _recipes_attached(model, modifier) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    return {path: {site: _ours(found) for site, found in entry.items()} for path, entry in plan.sites.items()}


def _cases() -> dict:
    return {
        "w8a8": QuantizationModifier(scheme="W8A8", ignore=["lm_head"]),
        "fp8_kv": QuantizationModifier(scheme="FP8", ignore=["lm_head"], kv_cache_scheme=FP8),
        "nvfp4": QuantizationModifier(scheme="NVFP4", ignore=["lm_head", "re:.*mlp.gate$"]),
        "fp8_dynamic": QuantizationModifier(scheme="FP8_DYNAMIC", ignore=["lm_head"]),
        "overrides": QuantizationModifier(config_groups={"g": {"targets": ["Linear"], "weights": W8, "input_activations": A8}},
                                          ignore=["lm_head"], weight_observer="mse", input_observer="memoryless_mse"),
        "observer_dict_any_case": QuantizationModifier(scheme="W8A8", ignore=["lm_head"],
                                                       observer={"weights": "MSE", "input": "Static_MinMax"}),
        "explicit_kwargs": QuantizationModifier(config_groups={"g": {
            "targets": ["Linear"], "weights": {**W8, "observer": "mse", "observer_kwargs": {"maxshrink": 0.5, "grid": 40}},
            "input_activations": {**A8, "observer": "mse", "observer_kwargs": {"averaging_constant": 0.2, "norm": 2.0}}}},
            ignore=["lm_head"]),
        "override_beats_explicit": QuantizationModifier(config_groups={"g": {
            "targets": ["Linear"], "weights": W8, "input_activations": {**A8, "observer": "mse"}}},
            ignore=["lm_head"], input_observer="minmax"),
        "moving_average_constant": QuantizationModifier(config_groups={"g": {
            "targets": ["Linear"], "input_activations": {**A8, "observer_kwargs": {"averaging_constant": 0.25}}}}),
        "kv_observer_and_attention_group": QuantizationModifier(
            config_groups={"w": {"targets": ["Linear"], "weights": W8},
                           "a": {"targets": ["re:.*layers.0.self_attn$"], "input_activations": {**FP8, "observer": "mse"}}},
            ignore=["lm_head"], kv_cache_scheme={**FP8, "observer": "memoryless_minmax"}),
        "gptq": GPTQModifier(scheme="W4A16", ignore=["lm_head"], weight_observer="mse"),
    }


@pytest.fixture(scope="module")
def models():
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return {"llama": transformers.LlamaForCausalLM(llama).eval(),
            "qwen3_moe": transformers.AutoModelForCausalLM.from_config(
                qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, intermediate_size=256)).eval()}


@pytest.mark.parametrize("model_name", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("case", sorted(_cases()))
def test_each_site_gets_the_observer_llm_compressor_attaches(models, model_name, case):
    model = models[model_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GPTQModifier's options
        modifier = _cases()[case]
    theirs = _theirs_attached(model, modifier)
    assert theirs  # the case quantizes something
    assert _recipes_attached(model, modifier) == theirs
