"""``qstats.save`` onto a file its process may not write (mode 0o444, owned by an unprivileged
user): ``open(path, "wb")`` raises PermissionError and ``torch.save`` refuses it too, leaving the
file alone; qstats.save, whose docs promise what ``open`` raises, raises PermissionError before
writing anything, and the earlier checkpoint still loads, bit for bit. It used to write the whole
file beside it and fail reopening that copy (given the read-only mode) for its fsync: a plain
OSError, which ``except PermissionError`` does not catch. The writes run in a forked process of an
unprivileged user (root may write any file)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import traceback

import torch

import qstats

NOBODY = 65534


def _writes(folder: str) -> None:
    """In the child: the earlier checkpoint made read-only, then each writer tried on it."""
    results: dict = {}
    try:
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        path = os.path.join(folder, "calibration.safetensors")
        obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
        first = {"layer": obs.update(obs.init(x), x)}
        qstats.save(path, first)
        os.chmod(path, 0o444)
        writers = {
            "open": lambda: open(path, "wb").close(),
            "torch.save": lambda: torch.save({"x": torch.zeros(2)}, path),
            "qstats.save": lambda: qstats.save(path, {"layer": obs.update(first["layer"], x * 10)}),
        }
        for name, write in writers.items():
            try:
                write()
                results[name] = None
            except Exception as error:  # recorded for the test
                results[name] = type(error).__name__
        kept = qstats.load(path)["layer"]
        results["kept"] = all(torch.equal(a, b) for a, b in zip(kept, first["layer"], strict=True))
        results["mode"] = oct(os.stat(path).st_mode & 0o777)
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, "results.pt"))
    os._exit(0)


def test_saving_onto_a_read_only_file_raises_what_open_raises_and_keeps_it():
    folder = tempfile.mkdtemp()  # under /tmp: an unprivileged user can reach it
    try:
        os.chmod(folder, 0o777)
        child = multiprocessing.get_context("fork").Process(target=_writes, args=(folder,))
        child.start()
        child.join(120)
        assert child.exitcode == 0, child.exitcode
        results = torch.load(os.path.join(folder, "results.pt"))
        assert "crash" not in results, results["crash"]
        assert results["open"] == "PermissionError" and results["torch.save"] is not None, results
        assert results["qstats.save"] == "PermissionError", results
        assert results["kept"] and results["mode"] == "0o444", results
    finally:
        shutil.rmtree(folder, ignore_errors=True)
