"""``observer_kwargs`` that llm-compressor 0.14's own observers do not read (a misspelt
``averging_constant``, ``maxshrnk``): llm-compressor ignores them silently, taking its defaults; a Recipe
read from such a config takes the same defaults (its qparams equal llm-compressor's observer's on data)
and warns, naming the key and the one meant (before: silently)."""

import warnings

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
A8 = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor", "dynamic": False}
_KEYS = {"weight": "weights", "input": "input_activations"}


def _config(site: str, args: dict) -> dict:
    return {"config_groups": {"g": {"targets": ["Linear"], _KEYS[site]: args}}}


def _data(site: str) -> list:
    generator = torch.Generator().manual_seed(0)
    if site == "weight":
        return [torch.randn(16, 64, generator=generator)]
    return [torch.randn(2, 5, 64, generator=generator) * (1 + 2 * i) for i in range(4)]


def _theirs(site: str, registered: str, args: dict) -> tuple:
    """llm-compressor's observer ``registered`` of ``args``: its qparams on `_data` and the observer."""
    observer = Observer.load_from_registry(registered, base_name=site, args=QuantizationArgs(**args))
    for x in _data(site):
        observer(x)
    return observer.get_qparams(), observer


def _ours(rule) -> qstats.QParams:
    observer, state = rule.make_observer(), None
    for x in _data(rule.sites[0]):
        state = observer.update(observer.init(x) if state is None else state, x)
    return qstats.compute_qparams(state, rule.spec, **dict(rule.qparams_kwargs))


# (site, observer as written, the observer llm-compressor attaches, the misspelt key, the key meant, a value)
CASES = [
    ("input", None, "minmax", "averging_constant", "averaging_constant", 0.5),
    ("input", "minmax", "minmax", "averaging_const", "averaging_constant", 0.5),
    ("input", "mse", "mse", "maxshrnk", "maxshrink", 0.6),
    ("input", "memoryless_mse", "memoryless_mse", "gird", "grid", 20),
    ("weight", "mse", "memoryless_mse", "maxshrinks", "maxshrink", 0.6),
    ("weight", "memoryless_mse", "memoryless_mse", "patiense", "patience", 1),
]


@pytest.mark.parametrize("site, written, registered, typo, meant, value", CASES)
def test_a_misspelt_option_warns_naming_it_and_the_qparams_are_llm_compressors(site, written, registered, typo,
                                                                                 meant, value):
    args = {**(W8 if site == "weight" else A8), "observer": written, "observer_kwargs": {typo: value}}
    theirs, observer = _theirs(site, registered, args)
    # llm-compressor ignores the key: its option keeps the default the key meant would have changed
    attribute = "avg_constant" if meant == "averaging_constant" else meant
    default = getattr(_theirs(site, registered, {**args, "observer_kwargs": {}})[1], attribute)
    assert getattr(observer, attribute) == default != getattr(
        _theirs(site, registered, {**args, "observer_kwargs": {meant: value}})[1], attribute)
    with pytest.warns(UserWarning, match=rf"\['{typo}'\] are none that llm-compressor's .* did you mean '{meant}'"):
        (rule,) = qstats.Recipe.from_compressed_tensors(_config(site, args)).rules
    ours = _ours(rule)
    assert torch.equal(ours.scale.reshape(theirs["scale"].shape), theirs["scale"])
    assert torch.equal(ours.zero_point.reshape(theirs["zero_point"].shape).to(theirs["zero_point"].dtype),
                       theirs["zero_point"])


@pytest.mark.parametrize("site, written, options", [
    ("input", "minmax", {"averaging_constant": 0.3}),
    ("input", "mse", {"averaging_constant": 0.3, "maxshrink": 0.5, "grid": 50, "norm": 2.0, "patience": 3,
                      "triton_error_buffer": 0.5, "expand": 1.2}),
    ("input", "nvfp4_expanded_mse", {"expand": 1.5, "patience": 10}),
    ("weight", "memoryless_mse", {"maxshrink": 0.5, "grid": 50, "patience": 3, "triton_error_buffer": 0.5}),
    ("weight", "minmax", {"averaging_constant": 0.3}),  # minmax reads it; on a weight, observed once, unused
])
def test_options_llm_compressor_reads_do_not_warn(site, written, options):
    args = {**(W8 if site == "weight" else A8), "observer": written, "observer_kwargs": options}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        qstats.Recipe.from_compressed_tensors(_config(site, args))


@pytest.mark.parametrize("name", [name for name in PRESET_SCHEMES if name != "UNQUANTIZED"])
def test_presets_do_not_warn(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        qstats.Recipe.from_scheme(name)
