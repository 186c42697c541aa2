"""Every public name has a page: each name a public module exports is named, as code, by README.md or
a page of docs/, so that nothing a user can import is left for them to find in the source.

A public module's names are its ``__all__`` (for a package without one, ``qstats.observers``, the
names it binds that do not start with an underscore and are not modules). A name counts as named
when it appears, as a whole word, in an inline code span or a code block of a page. Helpers that a
public module exports for qstats' own modules (its export, its drop-ins) are listed in ``HELPERS``
with the reason they are not documented; a new one has to be added there on purpose.

Every module of the package whose name has no leading underscore is either public (``PUBLIC``,
checked) or one whose names reach users through a public one (``INTERNAL``: the observer families
behind ``qstats.observers``, the writer behind ``qstats.export``, ...), so a new module is
classified on purpose too.

Run as a script (``python tests/test_docs_public_names.py``) it prints the names no page names.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import types
from pathlib import Path

import pytest

import qstats

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Modules a user imports or names (the docs name each), with the package that provides the
# third-party library it wraps, where it needs one.
PUBLIC = {
    "qstats": None,
    "qstats.conventions": None,
    "qstats.coreai_opt": None,
    "qstats.distributed": None,
    "qstats.experts": None,
    "qstats.export": None,
    "qstats.fused": None,
    "qstats.io": None,
    "qstats.llmcompressor": "llmcompressor",
    "qstats.observers": None,
    "qstats.observers.kit": None,
    "qstats.observers.search": None,
    "qstats.plot": None,
    "qstats.qat": None,
    "qstats.recipe": None,
    "qstats.reporting": None,
    "qstats.testing": None,
    "qstats.testing.strategies": "hypothesis",
    "qstats.torch_ao": None,
    "qstats.torchao_pt2e": "torchao",
    "qstats.tree": None,
}

# Modules whose user-facing names a public module re-exports (qstats, qstats.observers,
# qstats.export, qstats.conventions); their other names are the implementation.
INTERNAL = {
    "qstats.calibration", "qstats.gptq_quantize", "qstats.layerwise", "qstats.layerwise_gptq", "qstats.lsq",
    "qstats.observation", "qstats.schedule", "qstats.stacked",
    "qstats.conventions.compressed_tensors", "qstats.conventions.coreai_opt", "qstats.conventions.default",
    "qstats.conventions.torch_ao", "qstats.conventions.torchao",
    "qstats.export.attention", "qstats.export.checkpoint", "qstats.export.config", "qstats.export.experts",
    "qstats.export.layerwise", "qstats.export.linear", "qstats.export.mtp", "qstats.export.packing",
    "qstats.export.scales",
    "qstats.observers.fixed", "qstats.observers.hessian", "qstats.observers.histogram", "qstats.observers.imatrix",
    "qstats.observers.minmax", "qstats.observers.moments", "qstats.observers.mse", "qstats.observers.registry",
    "qstats.observers.search.entropy", "qstats.observers.search.l2", "qstats.observers.search.mse",
    "qstats.observers.search.percentile",
}

_EXPERTS_HELPER = "routing internals shared by calibration, fake_quantized, report and the export"
HELPERS = {
    "qstats.experts": {name: _EXPERTS_HELPER for name in (
        "EXPERT_COUNT_NAMES", "declared_experts", "dense_ids", "dense_rows_weight", "expert_count", "ids_mask",
        "rows_by_expert", "parameter_input_site", "is_stacked_parameter", "linearized_experts",
        "linearized_layout_problem", "stack_layout", "takes_routing", "unstacked_parameter_problem",
        "uncovered_experts", "warn_uncovered")},
    "qstats.recipe": {
        "as_plan": "how calibrate, compute_qparams_tree, report and the export resolve a recipe argument; "
                   "users call recipe.resolve(model)",
    },
}


def _exported(module: types.ModuleType) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)]


def _code_of(text: str) -> str:
    """The code blocks and inline code spans of a markdown text, one string."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    spans = re.findall(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`", prose)  # a span may wrap, not cross a paragraph
    return "\n".join(blocks + spans)


def _code_text() -> str:
    return "\n".join(_code_of(page.read_text()) for page in PAGES)


def _unnamed(module_name: str, code: str) -> list[str]:
    module = importlib.import_module(module_name)
    helpers = HELPERS.get(module_name, {})
    return [name for name in _exported(module)
            if name not in helpers and not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", code)]


def _public_modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(qstats.__path__, "qstats.")]
    return [name for name in names if not any(part.startswith("_") for part in name.split("."))]


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_every_public_name_is_named_by_a_page(module_name):
    if PUBLIC[module_name]:
        pytest.importorskip(PUBLIC[module_name])
    unnamed = _unnamed(module_name, _code_text())
    assert not unnamed, (
        f"{module_name} exports {unnamed}, which no page of the docs names as code: say on the page of "
        f"their topic what each is for, or list a helper in HELPERS of {Path(__file__).name} with why"
    )


def test_every_module_is_public_or_internal():
    unclassified = sorted(set(_public_modules()) - set(PUBLIC) - INTERNAL)
    assert not unclassified, f"add {unclassified} to PUBLIC (its names documented) or INTERNAL in {Path(__file__).name}"


@pytest.mark.parametrize("module_name", sorted(HELPERS))
def test_helpers_are_still_exported_and_undocumented(module_name):
    """The allow-list stays exact: a helper that left the module, or that a page now documents, leaves it."""
    exported = _exported(importlib.import_module(module_name))
    code = _code_text()
    for name in HELPERS[module_name]:
        assert name in exported, f"{module_name}.{name} is no longer exported: drop it from HELPERS"
        assert not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", code), (
            f"{module_name}.{name} is documented now: drop it from HELPERS")


def test_code_of_reads_code_not_prose():
    """``lookup`` in a sentence does not name ``qstats.conventions.lookup``; a code span or block does."""
    text = "a lookup table, `qstats.tree.stack(states)`:\n\n```python\nx = NAMES  # `inside`\n```\nthen `REDUCE_OPS(\nwrapped)`, `a\n\nb`"
    code = _code_of(text)
    assert "lookup" not in code and "table" not in code and "b" not in code.split()
    assert all(name in code for name in ("qstats.tree.stack(states)", "NAMES", "REDUCE_OPS"))


if __name__ == "__main__":
    text = _code_text()
    for module_name in sorted(PUBLIC):
        try:
            missing = _unnamed(module_name, text)
        except ImportError as error:
            print(f"{module_name}: not importable here ({error})")
            continue
        if missing:
            print(f"{module_name}: {', '.join(missing)}")
    for module_name in sorted(set(_public_modules()) - set(PUBLIC) - INTERNAL):
        print(f"{module_name}: neither PUBLIC nor INTERNAL")
