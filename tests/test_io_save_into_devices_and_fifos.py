"""``qstats.save`` onto a path that is no regular file: a FIFO, ``/dev/stdout`` of a process whose
output is a pipe, and (as root) a character device like ``/dev/null``. ``open(path, "wb")`` and
``torch.save`` write into them and leave them what they are; qstats.save does the same: the
reader gets a file that ``qstats.load`` reads back bit for bit, and the node stays a FIFO / device.
It used to write a file beside the path's real path and rename it over it, which put a regular
file in place of the FIFO, and in place of ``/dev/null`` for a root process (every later writer of
/dev/null then filled a file), and failed for /dev/stdout (its real path, ``/proc/<pid>/fd/pipe:[…]``,
names no file)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys

import pytest
import torch

import qstats

OBS = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))


def _tree() -> dict:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    return {"layer": OBS.update(OBS.init(x), x)}


def _written_through_fifo(path, write) -> bytes:
    """What ``write(path)`` sends through the FIFO at ``path`` (a small file fits in its pipe buffer)."""
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader first: the writer's open does not wait
    try:
        write(path)
        chunks = []
        while True:
            try:
                chunk = os.read(reader, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(reader)


def test_a_fifo_is_written_into_as_open_and_torch_save_do(tmp_path):
    fifo = tmp_path / "checkpoint.fifo"
    os.mkfifo(fifo)
    sent = _written_through_fifo(fifo, lambda path: torch.save(_tree(), path))  # the reference
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and torch.load(io.BytesIO(sent), weights_only=False)
    sent = _written_through_fifo(fifo, lambda path: qstats.save(path, _tree()))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a regular file"
    (tmp_path / "received.safetensors").write_bytes(sent)
    loaded = qstats.load(tmp_path / "received.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(loaded["layer"], _tree()["layer"], strict=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.fifo", "received.safetensors"]  # no leftovers


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a device node needs root")
def test_a_null_device_stays_a_device(tmp_path):
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the node of /dev/null, in a folder of the test's
    except PermissionError:  # a container without CAP_MKNOD
        pytest.skip("this process may not make device nodes")
    torch.save(_tree(), null)  # the reference
    assert stat.S_ISCHR(os.stat(null).st_mode)
    qstats.save(null, _tree())
    assert stat.S_ISCHR(os.stat(null).st_mode), "the device was replaced by a regular file"
    assert [p.name for p in tmp_path.iterdir()] == ["null"]


def test_stdout_of_a_piped_process_is_written_into(tmp_path):
    script = (
        "import torch, qstats\n"
        "x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))\n"
        "obs = qstats.minmax(qstats.QuantSpec(granularity=qstats.PerAxis(0)))\n"
        "{write}\n"
    )
    reference = subprocess.run([sys.executable, "-c", script.format(
        write="open('/dev/stdout', 'wb').write(b'written')")], capture_output=True, timeout=300)
    assert reference.returncode == 0 and reference.stdout == b"written", reference.stderr[-2000:]
    saved = subprocess.run([sys.executable, "-c", script.format(
        write="qstats.save('/dev/stdout', {'layer': obs.update(obs.init(x), x)})")], capture_output=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-2000:]
    (tmp_path / "received.safetensors").write_bytes(saved.stdout)
    loaded = qstats.load(tmp_path / "received.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(loaded["layer"], _tree()["layer"], strict=True))
