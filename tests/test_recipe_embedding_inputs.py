"""Embeddings under a scheme with input activations (``targets=["Linear", "Embedding"]``):
compressed-tensors gives the Embedding the scheme's input args too, which would quantize its integer
token ids; a Recipe gives it the weight alone, and every other site as compressed-tensors does."""

import copy
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402

_SITES = (("weights", "weight"), ("input_activations", "input"))


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _compressed_tensors_sites(model, scheme: str) -> dict:
    """``{path: {site: QuantSpec}}`` of the modules ``apply_quantization_config`` quantizes."""
    model = copy.deepcopy(model)
    config = {"config_groups": {"group_0": {"targets": ["Linear", "Embedding"], **PRESET_SCHEMES[scheme]}},
              "ignore": ["lm_head"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, QuantizationConfig.model_validate(config), show_progress=False)
    out = {}
    for path, module in model.named_modules():
        scheme_of = getattr(module, "quantization_scheme", None)
        if scheme_of is not None:
            out[path] = {site: qstats.QuantSpec.from_compressed_tensors(getattr(scheme_of, key))
                         for key, site in _SITES if getattr(scheme_of, key) is not None}
    return out


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4", "W8A8"])
def test_embeddings_take_their_weight_args_and_no_input_site(llama, scheme):
    theirs = _compressed_tensors_sites(llama, scheme)
    assert sorted(theirs["model.embed_tokens"]) == ["input", "weight"]  # the token ids, in compressed-tensors
    del theirs["model.embed_tokens"]["input"]
    plan = qstats.Recipe.from_scheme(scheme, targets=["Linear", "Embedding"], ignore=["lm_head"]).resolve(llama)
    assert {path: {site: found.spec for site, found in entry.items()} for path, entry in plan.sites.items()} == theirs


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_calibrating_embeddings_under_static_inputs_warns_of_no_unobserved_site(llama, scheme):
    """Before: an UncalibratedWarning that ``model.embed_tokens.input`` saw no data, for a site that
    integer token ids never fill."""
    plan = qstats.Recipe.from_scheme(scheme, targets=["Linear", "Embedding"], ignore=["lm_head"]).resolve(llama)
    batches = [{"input_ids": torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", qstats.UncalibratedWarning)
        states = qstats.calibrate(llama, batches, plan, progress=False)
    assert sorted(states["model.embed_tokens"]) == ["weight"]
    assert sorted(states["model.layers.0.mlp.down_proj"]) == ["input", "weight"]
