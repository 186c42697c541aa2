"""The tensors qstats.load returns own their memory, as torch.load's do: writing into the file afterwards
(torch.save to the same path, open(path, "wb"), another process) leaves them as loaded. They mapped the
file (safetensors' get_tensor): an overwrite of the same size turned them into the new bytes (NaN) after
their checksums had passed, and a truncation killed the process with SIGBUS on the next read."""

import torch

import qstats


def _overwrite_in_place(path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as file:  # same inode, same size: what a writer that does not rename does
        file.write(b"\xff" * size)


def test_loaded_tensors_keep_their_values_when_the_file_is_overwritten(tmp_path):
    tree = {"layer": {"total": torch.arange(50_000, dtype=torch.float32), "count": torch.tensor(7)},
            "half": torch.linspace(-1, 1, 4096).to(torch.bfloat16)}
    reference_path, path = tmp_path / "reference.pt", tmp_path / "stats.safetensors"
    torch.save(tree, reference_path)
    qstats.save(path, tree)
    reference, loaded = torch.load(reference_path), qstats.load(path)
    _overwrite_in_place(reference_path)
    _overwrite_in_place(path)
    for got, want in ((reference, tree), (loaded, tree)):
        assert torch.equal(got["layer"]["total"], want["layer"]["total"])
        assert torch.equal(got["layer"]["count"], want["layer"]["count"])
        assert torch.equal(got["half"], want["half"])
