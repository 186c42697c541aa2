"""A checkpoint whose safetensors header is damaged where the per-tensor CRC-32s do not look (the tree
structure's keys, a tensor's dtype) is refused by qstats.load as corrupt; safetensors' own reader takes
such a file without complaint, and qstats.load used to return the changed tree. Files written before the
header's checksum was added still load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import qstats


def _tree():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    minmax = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    histogram = qstats.histogram(qstats.QuantSpec(), buckets_per_octave=4, octaves=4)
    return {"a": minmax.update(minmax.init(x), x), "h": [histogram.update(histogram.init(x), x)]}


def _damaged(tmp_path, old: bytes, new: bytes):
    """The saved file with the first ``old`` in its header replaced by ``new`` (of the same length)."""
    path = tmp_path / "s.safetensors"
    qstats.save(path, _tree())
    raw = path.read_bytes()
    end = 8 + int.from_bytes(raw[:8], "little")
    assert len(old) == len(new) and old in raw[8:end]
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(raw[:8] + raw[8:end].replace(old, new, 1) + raw[end:])
    return damaged


def test_a_renamed_key_in_the_structure_is_refused(tmp_path):
    path = _damaged(tmp_path, b'[\\"a\\", {', b'[\\"j\\", {')
    with safe_open(str(path), framework="pt") as handle:  # the file itself reads
        assert '"j"' in handle.metadata()["structure"]
    with pytest.raises(ValueError, match="corrupt"):
        qstats.load(path)


def test_a_changed_tensor_dtype_in_the_header_is_refused(tmp_path):
    path = _damaged(tmp_path, b'"dtype":"I64"', b'"dtype":"U64"')
    with safe_open(str(path), framework="pt") as handle:  # the same bytes, read as another dtype
        assert any(handle.get_tensor(key).dtype == torch.uint64 for key in handle.keys())
    with pytest.raises(ValueError, match="corrupt"):
        qstats.load(path)


def test_a_file_written_without_the_header_checksum_still_loads(tmp_path):
    path = tmp_path / "s.safetensors"
    tree = _tree()
    qstats.save(path, tree)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    assert "layout_checksum" in metadata
    del metadata["layout_checksum"]
    save_file(tensors, str(tmp_path / "older.safetensors"), metadata=metadata)
    back = qstats.load(tmp_path / "older.safetensors")
    assert json.dumps(sorted(back)) == json.dumps(sorted(tree))
    for got, want in zip([*back["a"], *back["h"][0]], [*tree["a"], *tree["h"][0]]):
        assert got.dtype == want.dtype and torch.equal(got, want)
