"""``qstats.save`` onto files of modes an unprivileged user meets, against ``open(path, "wb")``
(whose errors the docs promise) and ``torch.save``:

- a read-only file (0o444): open raises PermissionError and torch.save refuses it too, leaving the
  file alone; qstats.save raises PermissionError before writing anything and the earlier
  checkpoint still loads, bit for bit. It used to write the whole file beside it and fail
  reopening that copy (given the read-only mode) for its fsync: a plain OSError, which
  ``except PermissionError`` does not catch.
- a write-only file (0o200): open and torch.save write it; qstats.save writes it too and keeps its
  mode. It used to give its copy that mode before reopening it for reading to fsync it, and failed.

The writes run in a forked process of an unprivileged user (root may write any file)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import traceback

import torch

import qstats

NOBODY = 65534
OBS = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))


def _tree(scale: float) -> dict:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * scale
    return {"layer": OBS.update(OBS.init(x), x)}


def _attempts(path: str, mode: int) -> dict:
    """Each writer on the checkpoint at ``path`` given ``mode``: None where it wrote, else its error's type."""
    writers = {
        "open": lambda: open(path, "wb").close(),
        "torch.save": lambda: torch.save({"x": torch.zeros(2)}, path),
        "qstats.save": lambda: qstats.save(path, _tree(10.0)),
    }
    results = {}
    for name, write in writers.items():
        qstats.save(path, _tree(1.0))
        os.chmod(path, mode)
        try:
            write()
            results[name] = None
        except Exception as error:  # recorded for the test
            results[name] = type(error).__name__
        results[f"{name} mode"] = oct(os.stat(path).st_mode & 0o777)
        os.chmod(path, 0o600)
        if name == "qstats.save":
            kept = qstats.load(path)["layer"]
            results["holds"] = [scale for scale in (1.0, 10.0)
                                if all(torch.equal(a, b) for a, b in zip(kept, _tree(scale)["layer"], strict=True))]
    return results


def _writes(folder: str) -> None:
    results: dict = {}
    try:
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        for mode in (0o444, 0o200):
            results[oct(mode)] = _attempts(os.path.join(folder, f"calibration{mode:o}.safetensors"), mode)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, "results.pt"))
    os._exit(0)


def _results() -> dict:
    folder = tempfile.mkdtemp()  # under /tmp: an unprivileged user can reach it
    try:
        os.chmod(folder, 0o777)
        child = multiprocessing.get_context("fork").Process(target=_writes, args=(folder,))
        child.start()
        child.join(120)
        assert child.exitcode == 0, child.exitcode
        results = torch.load(os.path.join(folder, "results.pt"))
        assert "crash" not in results, results["crash"]
        return results
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_saving_onto_read_only_and_write_only_files_does_what_open_does():
    results = _results()
    read_only, write_only = results["0o444"], results["0o200"]
    assert read_only["open"] == "PermissionError" and read_only["torch.save"] is not None, read_only
    assert read_only["qstats.save"] == "PermissionError" and read_only["holds"] == [1.0], read_only
    assert read_only["qstats.save mode"] == "0o444", read_only
    assert write_only["open"] is None and write_only["torch.save"] is None, write_only
    assert write_only["qstats.save"] is None and write_only["holds"] == [10.0], write_only
    assert write_only["qstats.save mode"] == "0o200", write_only
