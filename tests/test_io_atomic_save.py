"""qstats.save replaces its file whole: a write that fails midway keeps the previous checkpoint, and
the new file is written where and with the mode that Python's ``open(path, "wb")`` would give."""

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import safetensors
import safetensors.torch
import torch

import qstats
from qstats import io as qio


def _state(values):
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.tensor(values)
    return {"layer": obs.update(obs.init(x), x)}


def _assert_holds(path, values):
    loaded = qstats.load(path)["layer"]
    assert torch.equal(loaded.min_val, torch.tensor(min(values)))
    assert torch.equal(loaded.max_val, torch.tensor(max(values)))


def _writer_failing_midway(exception):
    """safetensors' save_file as releases before 0.8 wrote: the target opened with truncation, then
    the bytes, here cut off halfway by ``exception`` (a full disk, an interrupt)."""

    def save_file(tensors, filename, metadata=None):
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as handle:
            handle.write(data[: len(data) // 2])
        raise exception

    return save_file


@pytest.mark.parametrize("exception", [
    safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    KeyboardInterrupt(),
])
def test_a_write_failing_midway_keeps_the_previous_file_and_leaves_no_partial_one(tmp_path, monkeypatch, exception):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, _state([-1.0, 2.0]))
    monkeypatch.setattr(qio, "save_file", _writer_failing_midway(exception))
    with pytest.raises((OSError, KeyboardInterrupt)):
        qstats.save(path, _state([-3.0, 4.0]))
    _assert_holds(path, [-1.0, 2.0])
    assert os.listdir(tmp_path) == ["stats.safetensors"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ")
def test_the_real_writer_stopped_by_a_file_size_limit_keeps_the_previous_file(tmp_path):
    """The operating system refuses the write past 64 KiB (EFBIG), as a full disk refuses it."""
    path = tmp_path / "stats.safetensors"
    qstats.save(path, _state([-1.0, 2.0]))
    script = textwrap.dedent(f"""
        import resource, signal, torch, qstats
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
        try:
            qstats.save({str(path)!r}, {{"layer": torch.zeros(1 << 16)}})
        except OSError as error:
            print("refused:", error)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "refused:" in run.stdout and "could not write" in run.stdout
    _assert_holds(path, [-1.0, 2.0])
    assert os.listdir(tmp_path) == ["stats.safetensors"]


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_mode_open_gives_and_a_replaced_file_keeps_its_own(tmp_path):
    """safetensors 0.8 writes 0o600 files whatever the umask: a teammate could not read the checkpoint
    that open() and torch.save would have made 0o644."""
    reference = tmp_path / "reference"
    open(reference, "wb").close()
    path = tmp_path / "stats.safetensors"
    qstats.save(path, _state([-1.0, 2.0]))
    assert _mode(path) == _mode(reference)
    os.chmod(path, 0o640)
    os.chmod(reference, 0o640)
    open(reference, "wb").close()  # the reference: writing over a file keeps its mode
    qstats.save(path, _state([-3.0, 4.0]))
    assert _mode(path) == _mode(reference) == 0o640
    _assert_holds(path, [-3.0, 4.0])


def test_saving_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    """As open(link, "wb") writes through the link (a ``latest.safetensors`` pointing at a run's file);
    the link was replaced by a file and its target kept the old states."""
    (tmp_path / "run").mkdir()
    real = tmp_path / "run" / "stats.safetensors"
    qstats.save(real, _state([-1.0, 2.0]))
    link = tmp_path / "latest.safetensors"
    os.symlink(real, link)
    qstats.save(link, _state([-3.0, 4.0]))
    assert link.is_symlink() and os.path.realpath(link) == os.path.realpath(real)
    _assert_holds(real, [-3.0, 4.0])
    assert sorted(os.listdir(tmp_path / "run")) == ["stats.safetensors"]


def test_a_refused_tree_or_folder_writes_nothing(tmp_path):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, _state([-1.0, 2.0]))
    with pytest.raises(TypeError):
        qstats.save(path, {"layer": torch.zeros(2, dtype=torch.complex32)})
    with pytest.raises(FileNotFoundError, match="could not write"):
        qstats.save(tmp_path / "missing" / "stats.safetensors", _state([0.0]))
    with pytest.raises(OSError, match="could not write"):
        qstats.save(tmp_path, _state([0.0]))
    _assert_holds(path, [-1.0, 2.0])
    assert os.listdir(tmp_path) == ["stats.safetensors"]


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4_e2m1fn_x2")
def test_a_0_dimensional_float4_pair_is_named_before_writing(tmp_path):
    """safetensors cannot write it (a sub-byte slice off a byte boundary): save called that a failed
    write (OSError "could not write"), sending the user to look at the disk."""
    pair = torch.tensor(0x21, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    # the reference refuses it too (safetensors 0.8: "byte boundary"; 0.7 panics, a BaseException)
    with pytest.raises(BaseException, match="byte boundary|index out of bounds"):
        safetensors.torch.save_file({"t": pair}, str(tmp_path / "raw"))
    path = tmp_path / "stats.safetensors"
    qstats.save(path, _state([-1.0, 2.0]))
    with pytest.raises(TypeError, match="0-dimensional torch.float4_e2m1fn_x2"):
        qstats.save(path, {"t": pair})
    _assert_holds(path, [-1.0, 2.0])
    reshaped = pair.reshape(1)  # the way out the message names
    qstats.save(path, {"t": reshaped})
    loaded = qstats.load(path)["t"]
    assert loaded.shape == (1,) and torch.equal(loaded.view(torch.uint8), reshaped.view(torch.uint8))


def test_a_cpu_tree_is_written_without_a_copy_and_shared_storage_still_round_trips(tmp_path, monkeypatch):
    """Every tensor was cloned before writing: saving a tree took twice its memory (512 MiB of CPU
    states: 576 MiB more at the peak; now none). Views into a larger storage and tensors written
    twice are still copied, as safetensors refuses tensors that share storage."""
    base = torch.arange(10.0)
    own = torch.randn(4, 3)
    tree = {"own": own, "base": base, "again": base, "reshaped": base.view(2, 5), "half": base[5:],
            "transposed": own.t(), "empty": [torch.zeros(0), torch.zeros(0, 3)]}
    written = {}

    def recording(tensors, filename, metadata=None):
        written.update(tensors)
        return save_file(tensors, filename, metadata=metadata)

    save_file = qio.save_file
    monkeypatch.setattr(qio, "save_file", recording)
    path = tmp_path / "stats.safetensors"
    qstats.save(path, tree)
    assert written["own"].data_ptr() == own.data_ptr() and written["base"].data_ptr() == base.data_ptr()
    others = [key for key in written if key not in ("own", "base") and written[key].numel()]
    assert all(written[key].data_ptr() not in (own.data_ptr(), base.data_ptr()) for key in others), others
    loaded = qstats.load(path)
    for key in ("own", "base", "again", "reshaped", "half", "transposed"):
        assert loaded[key].shape == tree[key].shape and torch.equal(loaded[key], tree[key]), key
    assert [t.shape for t in loaded["empty"]] == [(0,), (0, 3)]
    assert torch.equal(base, torch.arange(10.0))  # the tree is left as it was


def test_a_loaded_tree_saved_back_over_its_own_file_round_trips(tmp_path):
    """The loaded tensors may be read from the file itself while it is written: writing in place
    would read back what it had just overwritten (safetensors#762 zero-filled such files)."""
    tree = {"a": torch.randn(1000, 100), "b": torch.arange(7)}
    path = tmp_path / "stats.safetensors"
    qstats.save(path, tree)
    loaded = qstats.load(path)
    qstats.save(path, loaded)
    again = qstats.load(path)
    assert all(torch.equal(again[key], tree[key]) and torch.equal(loaded[key], tree[key]) for key in tree)


def test_a_long_file_name_that_open_accepts_is_written(tmp_path):
    """80 three-byte characters: a 243-byte name, under the 255 bytes a file name may have, that the
    file written beside it must not push over."""
    path = tmp_path / ("\u65e5" * 80 + ".st")
    open(path, "wb").close()  # the reference: the name is valid
    os.remove(path)
    qstats.save(path, _state([-1.0, 2.0]))
    _assert_holds(path, [-1.0, 2.0])
    assert os.listdir(tmp_path) == [path.name]
