"""The documentation's code runs: every ```python block of README.md and docs/*.md, in order.

Each file's blocks run one after the other in one namespace (a later block may use names an earlier
one defined), in a temporary working directory, so that the files they write land there. A block
preceded by the line ``<!-- skip-test -->`` is not run (kept for blocks that need the MiniLM
weights or the network); one preceded by ``<!-- file: NAME -->`` is a script that the page's later
blocks run (``torchrun NAME``): it is written to ``NAME`` in that directory instead of being run.
Snippets assert what they show (parity with torch.ao, compressed-tensors, ...), so a test here
fails when the code stops doing what the docs say.

Also checked: the README's test command is the one .ci/run runs, every relative link of the docs
points to a file of the repository (and to a heading of it, for ``page.md#anchor``), every file of
the repository the prose names (``tests/...``, ``bench/...``) exists, the MiniLM recipe
docs/calibrate.md shows is the example's, and the docs name nothing that the code no longer has.
"""

from __future__ import annotations

import re
import runpy
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
SKIP_MARK = "<!-- skip-test -->"
FILE_MARK = re.compile(r"<!-- file: ([\w.-]+) -->")
# Names of code that was removed: no page may document them.
REMOVED = ("_native", "QSTATS_NATIVE", "register_stacked_update", "register_stacked_init", "set_num_threads")

_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line, code, mode)`` for every ```python block of a markdown text; ``mode`` is ``"run"``,
    ``"skip"`` or ``"file:NAME"``, from the marker on the line before the block."""
    blocks = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        marker = before[-1].strip() if before else ""
        file_mark = FILE_MARK.fullmatch(marker)
        mode = "skip" if marker == SKIP_MARK else f"file:{file_mark.group(1)}" if file_mark else "run"
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1), mode))
    return blocks


def test_block_parser_finds_blocks_and_markers():
    text = (
        "x\n```python\na = 1\n```\n\n<!-- skip-test -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
        "<!-- file: job.py -->\n```python\nc = 3\n```\n"
    )
    assert python_blocks(text) == [(3, "a = 1\n", "run"), (8, "b = 2\n", "skip"), (15, "c = 3\n", "file:job.py")]


RUNNABLE = [p for p in DOCS if p.exists() and p.name.endswith(".md")]


@pytest.mark.parametrize("page", RUNNABLE, ids=_relative)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(page.read_text())
    namespace = {"__name__": f"docs_{page.stem}"}
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for line, code, mode in blocks:
                if mode.startswith("file:"):
                    (tmp_path / mode[len("file:"):]).write_text(code)
                    continue
                if mode == "skip":
                    continue
                try:
                    exec(compile(code, f"{_relative(page)}:{line}", "exec"), namespace)
                except Exception as error:  # name the block, keep the traceback
                    raise AssertionError(f"{_relative(page)}, block at line {line} failed: {error!r}") from error
    finally:
        torch.set_num_threads(threads)


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = [line for line in ci if line.startswith("pip install torch==")]
    assert len(command) == 1, "expected one install-and-test line in .ci/run"
    assert command[0] in (ROOT / "README.md").read_text().splitlines()


@pytest.mark.parametrize("page", [p for p in DOCS if p.exists()], ids=_relative)
def test_relative_links_exist(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        resolved = (page.parent / target).resolve()
        assert resolved.exists(), f"{_relative(page)} links to {target}, which does not exist"


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_slug(heading) for heading in re.findall(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_slug_is_githubs():
    assert _slug("Mixture-of-experts layers: stacked experts") == "mixture-of-experts-layers-stacked-experts"
    assert _slug("Testing observers: `qstats.testing`") == "testing-observers-qstatstesting"


@pytest.mark.parametrize("page", [p for p in DOCS if p.exists()], ids=_relative)
def test_link_anchors_exist(page):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        linked = (page.parent / target).resolve() if target else page
        assert linked.suffix != ".md" or anchor in _anchors(linked), (
            f"{_relative(page)} links to {target}#{anchor}, a heading {target or 'it'} does not have"
        )


@pytest.mark.parametrize("page", [p for p in DOCS if p.exists()], ids=_relative)
def test_named_repository_files_exist(page):
    """Files of the repository the prose names (``tests/test_gptq.py``, ``bench/bench_layerwise.py``)."""
    for path in re.findall(r"(?<![\w/.])((?:tests|bench|examples|qstats)/[\w/.-]*\w\.(?:py|md))", page.read_text()):
        assert (ROOT / path).exists(), f"{_relative(page)} names {path}, which does not exist"


def test_minilm_recipe_in_docs_is_the_examples(monkeypatch):
    """docs/calibrate.md shows the recipe examples/quantize_minilm.py builds; keep the two in step."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # the example sets them; undone at teardown
        monkeypatch.setenv(name, "1")
    (code,) = [code for _, code, _ in python_blocks((ROOT / "docs" / "calibrate.md").read_text())
               if "minilm_recipe =" in code]
    namespace = {}
    exec(compile("import qstats\n" + code, "docs/calibrate.md", "exec"), namespace)
    example = runpy.run_path(str(ROOT / "examples" / "quantize_minilm.py"), run_name="quantize_minilm")
    shown, built = namespace["minilm_recipe"], example["VARIANTS"][namespace["MINILM_VARIANT"]]
    assert (shown.rules, shown.ignore) == (built.rules, built.ignore)


@pytest.mark.parametrize("page", [p for p in DOCS if p.exists()], ids=_relative)
def test_docs_name_no_removed_code(page):
    text = page.read_text()
    for name in REMOVED:
        assert name not in text, f"{_relative(page)} documents {name}, which was removed"
