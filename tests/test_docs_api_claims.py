"""Signatures and options the docs name, checked against the code (and llm-compressor's registry)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import qstats

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_site_fields_are_the_ones_calibrate_api_lists():
    """docs/calibrate_api.md: ``Site(rule, observer, spec, num_experts, runtime, kind, layout)``."""
    (listed,) = re.findall(r"`Site\(([^)]*)\)`", (DOCS / "calibrate_api.md").read_text())
    fields = list(qstats.recipe.Site._fields)
    assert [name.strip() for name in listed.split(",")] == fields


def test_from_dict_scheme_keys_are_from_schemes_arguments():
    """docs/recipes.md: ``{"scheme": ...}`` takes ``targets``, ``ignore``, ``kv_cache_scheme``,
    ``observed_dtype``, ``experts`` and ``shared``, as `Recipe.from_scheme` does; another key raises."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    shared = {"1:input": "0:input"}
    data = {"scheme": "W8A8", "ignore": ["re:nothing"], "observed_dtype": torch.bfloat16, "experts": "re:none",
            "shared": shared}
    built = qstats.Recipe.from_dict(data)
    direct = qstats.Recipe.from_scheme("W8A8", ignore=["re:nothing"], observed_dtype=torch.bfloat16,
                                       experts="re:none", shared=shared)
    assert built.rules == direct.rules and built.shared == direct.shared and built.ignore == direct.ignore
    assert built.shared  # the sharing was kept, not dropped
    assert sorted(built.resolve(model).sites) == ["0", "1"]
    with pytest.raises(ValueError, match="bogus"):
        qstats.Recipe.from_dict({"scheme": "W8A8", "bogus": 1})


@pytest.mark.parametrize("kwargs", [{"method": "entropy", "stride": 0}, {"method": "entropy", "num_bits": 0},
                                    {"method": "entropy", "num_bits": 33}, {"method": "entropy", "start_bin": 0},
                                    {"method": "mse", "candidates": 0}])
def test_histogram_drop_in_refuses_search_values_when_made(kwargs):
    """docs/migrating_llmcompressor.md: values a histogram's search refuses raise a ValueError naming
    the option when the ``qstats_histogram`` observer is made, not at ``get_qparams``."""
    pytest.importorskip("llmcompressor")
    importlib.import_module("qstats.llmcompressor")  # registers the qstats_* observers
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.observers import Observer

    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor", observer="qstats_histogram",
                            observer_kwargs=kwargs)
    option = next(name for name in kwargs if name != "method")
    with pytest.raises(ValueError, match=option):
        Observer.load_from_registry("qstats_histogram", base_name="input", args=args)


@pytest.mark.parametrize("module", ["qstats", "qstats.export", "qstats.observers.kit", "qstats.testing",
                                    "qstats.coreai_opt", "qstats.llmcompressor"])
def test_every_public_name_is_named_by_a_page(module):
    """Every name a public module exports (its ``__all__``) is named by README.md or a page of docs/,
    so that nothing a user can call is left for them to find in the source."""
    text = "\n".join(page.read_text() for page in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))])
    if module == "qstats.llmcompressor":
        pytest.importorskip("llmcompressor")
    exported = importlib.import_module(module).__all__
    unnamed = [name for name in exported if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text)]
    assert not unnamed, f"{module} exports {unnamed}, which no page of the docs names"


def test_compute_qparams_tree_options_override_every_sites_qparams_kwargs():
    """docs/calibrate_api.md: keyword options of `compute_qparams_tree` override the sites'
    ``qparams_kwargs``: each site's QParams are then `compute_qparams` of its state under them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).eval()
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.histogram, spec=spec,
                                        qparams_kwargs={"method": "l2"})])
    states = qstats.calibrate(model, [torch.randn(32, 16) * 3 for _ in range(3)], recipe, progress=False)
    default = qstats.compute_qparams_tree(states, recipe, model)
    overridden = qstats.compute_qparams_tree(states, recipe, model, method="minmax")
    for path in ("0", "2"):
        state = states[path]["input"]
        assert torch.equal(default[path]["input"].scale, qstats.compute_qparams(state, spec, method="l2").scale)
        assert torch.equal(overridden[path]["input"].scale, qstats.compute_qparams(state, spec, method="minmax").scale)
    assert not torch.equal(overridden["0"]["input"].scale, default["0"]["input"].scale)  # the option took effect


@pytest.mark.parametrize("kwargs", [{"progress": "no"}, {"all_experts": "yes"}])
def test_calibrate_takes_bool_flags_only(kwargs):
    """docs/calibrate_api.md: ``progress`` and ``all_experts`` take a bool only (a string from a
    config file, truthy whatever it says, is a TypeError naming the argument)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",))])
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        qstats.calibrate(model, [torch.randn(2, 8)], recipe, **{"progress": False, **kwargs})


def test_calibrate_refuses_one_tensor_for_its_batches():
    """docs/calibrate_api.md: a single tensor given for ``batches`` (which would be iterated row by
    row) is a TypeError saying to wrap it in a list."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    with pytest.raises(TypeError, match="wrap one batch in a list"):
        qstats.calibrate(model, torch.randn(2, 8), recipe, progress=False)
