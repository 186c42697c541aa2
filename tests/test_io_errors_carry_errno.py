"""`qstats.save` and `qstats.load` raise the OSError subclass ``open`` raises, with its errno (as the
docstrings say), also where qstats checks the path itself before safetensors sees it: a directory
(``open(path, "wb")`` and ``open(path, "rb")``: IsADirectoryError, EISDIR) and a read-only file
(PermissionError, EACCES). Those two carried no errno (``error.errno`` None)."""

from __future__ import annotations

import os

import pytest
import torch

import qstats


def _raised(call):
    with pytest.raises(OSError) as info:
        call()
    return info.value


@pytest.mark.parametrize("mode", ["wb", "rb"])
def test_a_directory_raises_as_open(tmp_path, mode):
    theirs = _raised(lambda: open(tmp_path, mode))
    if mode == "wb":
        ours = _raised(lambda: qstats.save(tmp_path, {"x": torch.ones(2)}))
    else:
        ours = _raised(lambda: qstats.load(tmp_path))
    assert type(ours) is type(theirs) is IsADirectoryError
    assert ours.errno == theirs.errno


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write a read-only file")
def test_a_read_only_file_raises_as_open(tmp_path):
    path = tmp_path / "states.safetensors"
    qstats.save(path, {"x": torch.ones(2)})
    path.chmod(0o444)
    theirs = _raised(lambda: open(path, "wb"))
    ours = _raised(lambda: qstats.save(path, {"x": torch.zeros(2)}))
    assert type(ours) is type(theirs) is PermissionError
    assert ours.errno == theirs.errno
    assert torch.equal(qstats.load(path)["x"], torch.ones(2))  # kept
