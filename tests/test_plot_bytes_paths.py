"""`qstats.plot.histogram` saves to a bytes path (as `qstats.save` takes one) in the format its
suffix names, as matplotlib's ``savefig`` writes the same path given as str: "h.pdf" as bytes held
PNG bytes (matplotlib reads no suffix from bytes, and its PDF writer refuses them)."""

import os

import pytest
import torch

import qstats

pytest.importorskip("matplotlib")


@pytest.mark.parametrize("suffix", ["pdf", "svg", "png", "jpg"])
def test_a_bytes_path_is_saved_in_the_format_its_suffix_names(tmp_path, suffix):
    spec = qstats.QuantSpec(dtype="int8")
    observer = qstats.histogram(spec, buckets_per_octave=16, octaves=16)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    state = observer.update(observer.init(x), x)
    path = os.fsencode(tmp_path / f"h.{suffix}")
    figure = qstats.plot.histogram(state, None, spec, path)
    figure.savefig(tmp_path / f"reference.{suffix}", dpi=100)  # matplotlib's own choice of format
    with open(path, "rb") as handle:
        assert handle.read()[:4] == (tmp_path / f"reference.{suffix}").read_bytes()[:4]
