"""`qstats.load` of an empty path raises what ``open("")`` raises (FileNotFoundError, ENOENT), its
message saying the path is empty (it read "could not read  (No such file or directory)", naming no
file), as `qstats.save` of an empty path says; a str, bytes or ``os.PathLike`` path alike."""

from __future__ import annotations

import errno

import pytest

import qstats


class _Path:
    def __fspath__(self) -> str:
        return ""


@pytest.mark.parametrize("path", ["", b"", _Path()], ids=["str", "bytes", "pathlike"])
def test_loading_an_empty_path_says_the_path_is_empty(path):
    with pytest.raises(OSError) as reference:
        open(path, "rb")
    with pytest.raises(OSError) as ours:
        qstats.load(path)
    assert type(ours.value) is type(reference.value) is FileNotFoundError
    assert ours.value.errno == reference.value.errno == errno.ENOENT
    assert "empty path" in str(ours.value) and "''" in str(ours.value)


def test_saving_an_empty_path_says_so_as_loading_does():
    with pytest.raises(FileNotFoundError) as saved:
        qstats.save("", {})
    with pytest.raises(FileNotFoundError) as loaded:
        qstats.load("")
    assert str(loaded.value).replace("read", "write") == str(saved.value)
