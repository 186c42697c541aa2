"""qstats.load from a path that is no regular file: a FIFO another process saves into, ``/dev/stdin``
of a process reading a pipe, and ``/dev/null``. qstats.save writes into such paths as ``open`` does
(tests/test_io_save_into_devices_and_fifos.py), but load refused what it wrote ("could not be read as a
safetensors file: No such device (os error 19)": safetensors maps a file into memory, which a pipe
refuses). The tree read back is compared with the one saved, bit for bit, and with safetensors' own
reader of the same bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch

import qstats

OBS = qstats.histogram(qstats.QuantSpec(), buckets_per_octave=4, octaves=8)


def _tree() -> dict:
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    state = OBS.update(OBS.init(x), x)
    return {"layer": {"input": state}, "scale": torch.tensor([0.5, 0.25], dtype=torch.float16), "none": None}


def _assert_bit_equal(got: dict, want: dict) -> None:
    assert got["none"] is None and type(got["layer"]["input"]) is qstats.HistogramState
    for a, b in zip((*got["layer"]["input"], got["scale"]), (*want["layer"]["input"], want["scale"])):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


SAVE_TO_ARGV1 = textwrap.dedent("""
    import sys, torch, qstats
    sys.path.insert(0, {tests!r})
    from test_io_load_from_fifos_and_pipes import _tree
    qstats.save(sys.argv[1], _tree())
""").format(tests=os.path.dirname(__file__))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_another_process_saves_into_is_loaded(tmp_path):
    fifo = tmp_path / "stats.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", SAVE_TO_ARGV1, str(fifo)], stderr=subprocess.PIPE)
    try:
        loaded = qstats.load(fifo)  # open() waits for the writer, as it does for any reader of a FIFO
    finally:
        _, stderr = writer.communicate(timeout=120)
    assert writer.returncode == 0, stderr.decode()[-2000:]
    _assert_bit_equal(loaded, _tree())


def test_dev_stdin_of_a_pipe_is_loaded(tmp_path):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, _tree())
    data = path.read_bytes()
    read = textwrap.dedent("""
        import sys, torch, qstats
        tree = qstats.load("/dev/stdin")
        sys.stdout.buffer.write(qstats.io.to_state_dict(tree)["structure"].encode())
        torch.save(qstats.io.to_state_dict(tree), sys.argv[1])
    """)
    out = tmp_path / "read.pt"
    done = subprocess.run([sys.executable, "-c", read, str(out)], input=data, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    loaded = qstats.io.from_state_dict(torch.load(out, weights_only=True))
    _assert_bit_equal(loaded, _tree())
    # and the numbers are those safetensors' own reader finds in the bytes
    reference = safetensors.torch.load(data)
    assert torch.equal(reference["scale"], loaded["scale"])
    assert torch.equal(reference["layer/input/counts"], loaded["layer"]["input"].counts)


def test_dev_null_is_refused_as_an_empty_file():
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    with pytest.raises(ValueError, match="/dev/null is corrupt or truncated"):
        qstats.load("/dev/null")
