"""qstats.save(path, tree) called in torch.save's order, (tree, path): a TypeError saying that the path
comes first, and no file. It said "cannot save a str at <root>" (the path read as the tree), which
names neither the order nor the tree given."""

import pathlib

import pytest
import torch

import qstats


@pytest.mark.parametrize("as_path", [str, pathlib.Path, lambda p: str(p).encode()], ids=["str", "Path", "bytes"])
@pytest.mark.parametrize("tree", [{"layer": torch.ones(2)}, torch.ones(2), None], ids=["dict", "tensor", "None"])
def test_torch_save_argument_order_is_refused_naming_it(tmp_path, as_path, tree):
    path = as_path(tmp_path / "stats.safetensors")
    torch.save(tree, tmp_path / "reference.pt")  # the reference's order: the object first
    with pytest.raises(TypeError, match=r"takes the path first"):
        qstats.save(tree, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference.pt"]
    qstats.save(path, tree)  # the documented order writes it
    loaded = qstats.load(path)
    assert loaded is None if tree is None else torch.equal(torch.as_tensor(qstats.tree.leaves_with_paths(loaded)[0][1]),
                                                           torch.ones(2))
