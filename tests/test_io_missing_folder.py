"""qstats.save into a folder that does not exist: FileNotFoundError naming the path and its missing
folder, as torch.save names the parent directory ("Parent directory ... does not exist."), and nothing
written. It named the hidden temporary file the writer makes beside the target
(``.stats.safetensors.<random>.tmp``), a path the caller never gave."""

import errno

import pytest
import torch

import qstats


@pytest.mark.parametrize("depth", [1, 2])
def test_a_missing_folder_is_named_as_torch_save_names_it(tmp_path, depth):
    folder = tmp_path.joinpath(*["missing"] * depth)
    with pytest.raises(RuntimeError, match=f"Parent directory {folder} does not exist"):
        torch.save({"layer": torch.ones(2)}, folder / "reference.pt")
    with pytest.raises(FileNotFoundError) as info:
        qstats.save(folder / "stats.safetensors", {"layer": torch.ones(2)})
    assert info.value.errno == errno.ENOENT
    assert f"{folder} does not exist" in str(info.value) and ".tmp" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
