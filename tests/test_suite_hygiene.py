"""The suite's own hygiene: pytest imports every test module before it runs any test, so a module
that changes process-wide torch settings at import changes them for the whole suite (a module-level
``torch.set_num_threads(1)`` ran every later test on one thread: a suite of 1,258 s instead of
~890 s, and a test comparing llm-compressor's GPTQ codes bit for bit failed on the changed sums)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SETTINGS = {"set_num_threads", "set_num_interop_threads", "set_default_dtype", "set_default_device",
            "use_deterministic_algorithms", "set_flush_denormal", "set_grad_enabled"}
MODULES = sorted(Path(__file__).parent.glob("*.py"))


def _module_level_calls(tree: ast.Module):
    """Calls in statements run at import: not inside a function, nor under ``if __name__ == "__main__"``."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _main_only(node):
            continue
        if isinstance(node, ast.Call):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def _main_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_test_module_changes_torch_settings_at_import(path):
    calls = _module_level_calls(ast.parse(path.read_text()))
    found = [f"line {call.lineno}: {call.func.attr}" for call in calls
             if isinstance(call.func, ast.Attribute) and call.func.attr in SETTINGS]
    assert not found, f"{path.name} changes torch's settings at import ({found}): do it in a fixture that restores them"
