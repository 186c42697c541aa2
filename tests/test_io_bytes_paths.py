"""qstats.save and qstats.load take a path as bytes, as ``open`` and ``torch.save`` do (they raised
a TypeError about mixing strings and bytes, or about the filename's type): the file written is the
one the str path names, and safetensors reads the same tensors from it."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

import qstats


def test_a_bytes_path_is_saved_and_loaded(tmp_path):
    obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    tree = {"layers": {"0": obs.update(obs.init(x), x)}}
    path = tmp_path / "states.safetensors"
    qstats.save(os.fsencode(path), tree)
    with safe_open(str(path), framework="pt") as handle:
        assert torch.equal(handle.get_tensor("layers/0/max_val"), tree["layers"]["0"].max_val)
    loaded = qstats.load(os.fsencode(path))
    assert all(torch.equal(a, b) for a, b in zip(loaded["layers"]["0"], tree["layers"]["0"]))
