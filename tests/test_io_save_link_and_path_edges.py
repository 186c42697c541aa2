"""qstats.save on paths that name no writable file, and on hard links, compared with ``open(path, "wb")``.

A symlink loop was replaced by a regular file (open raises ELOOP), a path ending in "/" wrote a file
of the name without it (open raises IsADirectoryError), an empty path said "it is a directory" and a
folder component that is a file raised FileNotFoundError (open: NotADirectoryError). A hard link is
replaced, not written through: the other name keeps the previous checkpoint.
"""

import errno
import os

import pytest
import torch

import qstats


def _tree(value):
    return {"layer": {"max_val": torch.tensor([value]), "none": None, "empty": {}}}


def _open_error(path):
    with pytest.raises(OSError) as info:
        with open(path, "wb"):
            pass
    return info.value


def _same_error_as_open(path, tree):
    expected = _open_error(path)
    with pytest.raises(OSError) as info:
        qstats.save(path, tree)
    assert type(info.value) is type(expected) and info.value.errno == expected.errno
    assert "qstats.io" in str(info.value)


def test_a_symlink_loop_raises_as_open_and_stays_a_link(tmp_path):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    os.symlink(second, first)
    os.symlink(first, second)
    _same_error_as_open(first, _tree(1.0))
    assert first.is_symlink() and second.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors"]  # nothing left beside them


def test_a_path_ending_in_a_separator_raises_as_open(tmp_path):
    existing = tmp_path / "stats.safetensors"
    qstats.save(existing, _tree(1.0))
    for path in (str(existing) + "/", str(tmp_path / "new.safetensors") + "/"):
        _same_error_as_open(path, _tree(2.0))
    assert sorted(os.listdir(tmp_path)) == ["stats.safetensors"]
    assert torch.equal(qstats.load(existing)["layer"]["max_val"], torch.tensor([1.0]))


def test_a_folder_component_that_is_a_file_and_an_empty_path_raise_as_open(tmp_path):
    file = tmp_path / "stats.safetensors"
    qstats.save(file, _tree(1.0))
    _same_error_as_open(file / "inner.safetensors", _tree(2.0))
    with pytest.raises(FileNotFoundError) as info:
        qstats.save("", _tree(2.0))
    assert info.value.errno == errno.ENOENT and type(_open_error("")) is FileNotFoundError


def test_a_missing_folder_is_file_not_found(tmp_path):
    _same_error_as_open(tmp_path / "missing" / "stats.safetensors", _tree(1.0))
    assert os.listdir(tmp_path) == []


def test_a_hard_link_is_replaced_and_its_other_name_keeps_the_previous_file(tmp_path):
    first, second = tmp_path / "run.safetensors", tmp_path / "latest.safetensors"
    qstats.save(first, _tree(1.0))
    os.link(first, second)
    qstats.save(second, _tree(2.0))
    assert torch.equal(qstats.load(second)["layer"]["max_val"], torch.tensor([2.0]))
    assert torch.equal(qstats.load(first)["layer"]["max_val"], torch.tensor([1.0]))  # a snapshot stays whole
    assert os.stat(first).st_nlink == 1 and not os.path.samefile(first, second)
    loaded = qstats.load(second)
    assert loaded["layer"]["none"] is None and loaded["layer"]["empty"] == {}


def test_a_dangling_symlink_creates_its_target_and_stays_a_link(tmp_path):
    link, target = tmp_path / "latest.safetensors", tmp_path / "run" / "stats.safetensors"
    os.mkdir(tmp_path / "run")
    os.symlink(os.path.join("run", "stats.safetensors"), link)  # relative, as open resolves it
    qstats.save(link, _tree(3.0))
    assert link.is_symlink() and target.is_file()
    assert torch.equal(qstats.load(target)["layer"]["max_val"], torch.tensor([3.0]))


def _same_load_error_as_open(path):
    with pytest.raises(OSError) as expected:
        with open(path, "rb"):
            pass
    with pytest.raises(OSError) as info:
        qstats.load(path)
    assert type(info.value) is type(expected.value) and info.value.errno == expected.value.errno
    assert "qstats.io" in str(info.value)


def test_load_raises_what_open_raises_for_a_loop_a_file_used_as_a_folder_and_a_missing_file(tmp_path):
    """safetensors said "No such file or directory" for the first two (FileNotFoundError)."""
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    os.symlink(second, first)
    os.symlink(first, second)
    file = tmp_path / "stats.safetensors"
    qstats.save(file, _tree(1.0))
    for path in (first, file / "inner.safetensors", str(file) + "/", tmp_path / "absent.safetensors", ""):
        _same_load_error_as_open(path)
