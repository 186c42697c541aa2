"""The ``observer`` and ``observer_kwargs`` fields of the exported ``quantization_config``: equal to what
llm-compressor 0.14's ``oneshot`` writes for the same scheme, and read back by
`qstats.Recipe.from_compressed_tensors` into the observers that calibrated the checkpoint."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402

VOCAB = 64


def _int8(strategy, symmetric=True, **observer):
    return dict(num_bits=8, type="int", symmetric=symmetric, strategy=strategy, **observer)


# schemes whose observers take options (llm-compressor's names and observer_kwargs)
SCHEMES = {
    "mse-weights-memoryless-mse-inputs": {
        "weights": _int8("channel", observer="memoryless_mse", observer_kwargs={"maxshrink": 0.3, "grid": 50}),
        "input_activations": _int8("tensor", False, observer="memoryless_mse", observer_kwargs={"maxshrink": 0.3}),
    },
    "moving-average-minmax-inputs": {
        "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
        "input_activations": _int8("tensor", observer="minmax", observer_kwargs={"averaging_constant": 0.5}),
    },
    "mse-inputs-with-patience": {
        "weights": _int8("channel", observer="memoryless_mse", observer_kwargs={"patience": 7}),
        "input_activations": _int8("tensor", observer="mse",
                                   observer_kwargs={"averaging_constant": 0.2, "patience": 3, "norm": 2.0}),
    },
}


def _llama(path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (12,), generator=generator) for _ in range(2)]


def _export(model, recipe, folder) -> dict:
    plan = recipe.resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in _samples()], plan, progress=False)
    return qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), folder, plan)


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_observer_fields_equal_llm_compressor_oneshot(tmp_path, case):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    scheme = SCHEMES[case]
    base, theirs = str(tmp_path / "base"), str(tmp_path / "theirs")
    _llama(base)
    modifier = QuantizationModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
                                    ignore=["lm_head"])
    llm_compressor_oneshot(load_causal_lm(base), _samples(), modifier, theirs)
    with open(os.path.join(theirs, "config.json")) as file:
        (their_group,) = json.load(file)["quantization_config"]["config_groups"].values()

    model = load_causal_lm(base)
    model.set_attn_implementation("eager")
    recipe = qstats.Recipe.from_scheme(scheme, targets=["Linear"], ignore=["lm_head"])
    (our_group,) = _export(model, recipe, str(tmp_path / "ours"))["config_groups"].values()
    for site in ("weights", "input_activations"):
        assert (our_group[site]["observer"], our_group[site]["observer_kwargs"]) == (
            their_group[site]["observer"], their_group[site]["observer_kwargs"]), site
    assert json.loads(json.dumps(our_group)) == their_group


def _observers(recipe) -> dict:
    return {rule.sites: (rule.observer, rule.observer_kwargs, rule.qparams_kwargs) for rule in recipe.rules}


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_the_exported_config_reads_back_into_the_observers_that_calibrated_it(tmp_path, case):
    base = str(tmp_path / "base")
    _llama(base)
    recipe = qstats.Recipe.from_scheme(SCHEMES[case], targets=["Linear"], ignore=["lm_head"])
    written = _export(load_causal_lm(base), recipe, str(tmp_path / "ours"))
    assert _observers(qstats.Recipe.from_compressed_tensors(written)) == _observers(recipe)


def test_qstats_observers_without_an_llm_compressor_equivalent_write_none(tmp_path):
    # qstats.mse accumulates every batch's losses (its default mode): llm-compressor's mse is a moving
    # average of per-batch searches, which a reader of the config would run instead
    base = str(tmp_path / "base")
    _llama(base)
    spec = qstats.QuantSpec.from_compressed_tensors(_int8("tensor"))
    recipe = qstats.Recipe([
        qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec.from_compressed_tensors(_int8("channel")),
                    observer="mse", qparams_kwargs={"patience": 2}),
        qstats.Rule("Linear", sites=("input",), spec=spec, observer="mse"),
    ], ignore=["lm_head"])
    (group,) = _export(load_causal_lm(base), recipe, str(tmp_path / "ours"))["config_groups"].values()
    assert (group["input_activations"]["observer"], group["input_activations"]["observer_kwargs"]) == (None, {})
    assert (group["weights"]["observer"], group["weights"]["observer_kwargs"]) == ("memoryless_mse", {"patience": 2})


KV_CACHE_SCHEMES = {
    "static-minmax": dict(num_bits=8, type="float", symmetric=True, strategy="tensor", observer="static_minmax"),
    "moving-average-minmax-constant": dict(num_bits=8, type="float", symmetric=True, strategy="tensor",
                                           observer="minmax", observer_kwargs={"averaging_constant": 0.5}),
    "default": dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
}


@pytest.mark.parametrize("case", sorted(KV_CACHE_SCHEMES))
def test_kv_cache_scheme_observer_equals_oneshot_and_reads_back(tmp_path, case):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    kv_cache_scheme = KV_CACHE_SCHEMES[case]
    base, theirs = str(tmp_path / "base"), str(tmp_path / "theirs")
    _llama(base)
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"],
                                    kv_cache_scheme=kv_cache_scheme)
    llm_compressor_oneshot(load_causal_lm(base), _samples(), modifier, theirs)
    with open(os.path.join(theirs, "config.json")) as file:
        their_scheme = json.load(file)["quantization_config"]["kv_cache_scheme"]

    model = load_causal_lm(base)
    model.set_attn_implementation("eager")
    recipe = qstats.Recipe.from_scheme("FP8_DYNAMIC", targets=["Linear"], ignore=["lm_head"],
                                       kv_cache_scheme=kv_cache_scheme)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*before the rotary embedding", UserWarning)
        written = _export(model, recipe, str(tmp_path / "ours"))
    assert written["kv_cache_scheme"] == their_scheme
    assert _observers(qstats.Recipe.from_compressed_tensors(written)) == _observers(recipe)



def test_attention_group_kv_cache_scheme_names_the_observer_oneshot_names(tmp_path):
    """A config group on the attention modules (static fp8 q/k/v inputs, observer left to llm-compressor's
    default): oneshot fills ``"minmax"`` into the group's args, and compressed-tensors' kv_cache_scheme
    is those args; the export wrote ``observer: null`` there (as for a bare kv-cache scheme)."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    fp8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor")
    groups = {"attention": {"targets": ["re:.*self_attn$"], "input_activations": fp8},
              "linear": {"targets": ["Linear"], "weights": {**fp8, "strategy": "channel"},
                         "input_activations": {**fp8, "strategy": "token", "dynamic": True}}}
    base, theirs = str(tmp_path / "base"), str(tmp_path / "theirs")
    _llama(base)
    llm_compressor_oneshot(load_causal_lm(base), _samples(), QuantizationModifier(config_groups=groups, ignore=["lm_head"]),
                           theirs)
    with open(os.path.join(theirs, "config.json")) as file:
        their_config = json.load(file)["quantization_config"]
    model = load_causal_lm(base)
    model.set_attn_implementation("eager")
    recipe = qstats.Recipe.from_compressed_tensors({"config_groups": groups, "ignore": ["lm_head"]})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*rotary embedding", UserWarning)
        written = _export(model, recipe, str(tmp_path / "ours"))
    their_attention = next(g for g in their_config["config_groups"].values() if g["weights"] is None)
    our_attention = next(g for g in written["config_groups"].values() if g["weights"] is None)
    assert their_config["kv_cache_scheme"]["observer"] == "minmax"
    assert written["kv_cache_scheme"] == their_config["kv_cache_scheme"] == their_attention["input_activations"]
    assert our_attention["input_activations"] == their_attention["input_activations"]

def test_weights_searched_over_every_candidate_write_a_patience_llm_compressor_runs_to_the_same_scales(tmp_path):
    # qstats.mse on weights without a patience searches every candidate; the config said
    # {"patience": None}, on which llm-compressor's memoryless_mse raised a TypeError
    from llmcompressor import observers as llmc_observers
    from compressed_tensors.quantization import QuantizationArgs

    base = str(tmp_path / "base")
    _llama(base)
    spec = qstats.QuantSpec.from_compressed_tensors(_int8("channel"))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec, observer="mse")], ignore=["lm_head"])
    (group,) = _export(load_causal_lm(base), recipe, str(tmp_path / "ours"))["config_groups"].values()
    args = QuantizationArgs(**group["weights"])
    assert (args.observer, args.observer_kwargs) == ("memoryless_mse", {"patience": 20})
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3.0, 64)
    observer = llmc_observers.Observer.load_from_registry(args.observer, base_name="weight", args=args)
    observer(weight)
    obs = qstats.mse(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    assert torch.equal(observer.get_qparams()["scale"].reshape(-1), ours.scale.reshape(-1))
