"""Checkpoints of states (qstats.save / load / resume) and trees: the edges a user meets.

Each test compares with an independent authority: safetensors' own writer and limits, ``open()``,
``torch.empty`` on the device, NumPy's writers, ``math.isnan``, or one uninterrupted calibration.
"""

from __future__ import annotations

import io as _stdio
import json
import math
import os

import numpy as np
import optree
import pytest
import safetensors.torch
import torch

import qstats
from qstats import io as qio
from qstats import tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_a_header_over_the_safetensors_limit_is_named_and_the_old_file_kept(tmp_path):
    """safetensors refuses headers over 100 MB (tensor names, structure, checksums: some 300 000
    tensors of a large MoE model's per-expert states); save said "could not write" (an OSError)."""
    with pytest.raises(safetensors.SafetensorError, match="header too large"):  # safetensors' own limit
        safetensors.torch.save_file({"x": torch.ones(1)}, str(tmp_path / "raw"), metadata={"m": "a" * 100_000_001})
    path = tmp_path / "big.safetensors"
    qstats.save(path, {"old": torch.ones(1)})
    big = {"\u65e5" * 5_000_000: torch.arange(3.0)}  # escaped in the metadata: some 120 MB of header
    with pytest.raises(ValueError, match="100 MB header"):
        qstats.save(path, big)
    assert torch.equal(qstats.load(path)["old"], torch.ones(1))  # nothing written
    buffer = _stdio.BytesIO()  # the way out the message names
    torch.save(qio.to_state_dict(big), buffer)
    buffer.seek(0)
    (key,) = big
    assert torch.equal(qio.from_state_dict(torch.load(buffer, weights_only=True))[key], big[key])


def test_a_name_that_is_not_utf8_is_named_before_writing(tmp_path):
    """A lone surrogate (os.fsdecode of undecodable bytes) raised a bare UnicodeEncodeError."""
    key = os.fsdecode(b"layer\xff")
    with pytest.raises(UnicodeEncodeError):  # safetensors itself cannot hold the name
        safetensors.torch.save_file({key: torch.ones(1)}, str(tmp_path / "raw"))
    with pytest.raises(ValueError, match="not valid Unicode"):
        qstats.save(tmp_path / "s.safetensors", {key: torch.ones(1)})
    assert not (tmp_path / "s.safetensors").exists()
    buffer = _stdio.BytesIO()  # torch.save of a state dict keeps it
    torch.save(qio.to_state_dict({key: torch.ones(1)}), buffer)
    buffer.seek(0)
    assert list(qio.from_state_dict(torch.load(buffer, weights_only=True))) == [key]


def test_loading_a_directory_raises_what_open_raises(tmp_path):
    """It was a ValueError "could not be read ... No such device (os error 19)"."""
    with pytest.raises(IsADirectoryError):
        open(tmp_path, "rb")
    with pytest.raises(IsADirectoryError, match="directory"):
        qstats.load(tmp_path)


def _unavailable_device() -> str:
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_an_unavailable_device_is_named_before_the_file_is_read(tmp_path):
    """It read the file, then Tensor.to raised an AssertionError ("Torch not compiled with CUDA")."""
    device = _unavailable_device()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(0, device=device)
    with pytest.raises(ValueError, match=f"device '{device}' is not available"):
        qstats.load(tmp_path / "absent.safetensors", device=device)  # before: FileNotFoundError
    qstats.save(tmp_path / "s.safetensors", {"a": torch.ones(2)})
    assert qstats.load(tmp_path / "s.safetensors", device="meta")["a"].device.type == "meta"


def test_other_formats_are_named_and_an_npz_is_not_called_a_torch_save_file(tmp_path):
    np.save(tmp_path / "x.npy", np.ones(3))
    np.savez(tmp_path / "x.npz", a=np.ones(3))
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    torch.save({"a": torch.ones(1)}, tmp_path / "t.pt")
    expected = {"x.npy": "NumPy .npy", "x.npz": "zip archive", "m.gguf": "GGUF", "t.pt": "torch.save file"}
    for name, kind in expected.items():
        with pytest.raises(ValueError, match="not a readable safetensors file") as error:
            qstats.load(tmp_path / name)
        assert kind in str(error.value), (name, str(error.value))
        assert name == "t.pt" or "torch.save" not in str(error.value), name


def _craft(path, structure, tensors):
    checksums = {key: qio._checksum(t) for key, t in tensors.items()}
    metadata = {"format": "qstats", "format_version": "1", "structure": json.dumps(structure),
                "checksums": json.dumps(checksums)}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def test_a_structure_with_a_shared_tensor_or_a_non_string_key_is_refused(tmp_path):
    """Files save never writes: one tensor at two leaves (an in-place update of one changed the
    other) and an int dict key (save refuses those) were loaded."""
    path = tmp_path / "crafted.safetensors"
    leaf = {"t": "tensor", "key": "a"}
    _craft(path, {"t": "list", "items": [leaf, leaf]}, {"a": torch.ones(1)})
    with pytest.raises(ValueError, match=r"malformed checkpoint structure at tree\[1\]"):
        qstats.load(path)
    _craft(path, {"t": "dict", "items": [[1, leaf]]}, {"a": torch.ones(1)})
    with pytest.raises(ValueError, match="malformed checkpoint structure"):
        qstats.load(path)
    with pytest.raises(TypeError, match="dict keys must be strings"):
        qstats.save(tmp_path / "int.safetensors", {1: torch.ones(1)})


def test_nan_leaves_of_every_number_type_are_equal_and_stack_names_a_device_mismatch():
    for nan in (float("nan"), np.float32("nan"), np.float64("nan"), complex("nan")):
        assert math.isnan(abs(nan))
        tree.assert_same_structure({"a": nan, "x": torch.ones(1)}, {"a": nan, "x": torch.ones(1)})
    with pytest.raises(ValueError, match="tree mismatch"):
        tree.assert_same_structure({"a": np.float32("nan")}, {"a": np.float32(1.0)})
    with pytest.raises(RuntimeError):  # torch.stack's own error names no leaf
        torch.stack([torch.ones(2), torch.ones(2, device="meta")])
    with pytest.raises(ValueError, match=r"trees\[0\]\['b'\] is on devices \['cpu', 'meta'\]"):
        tree.stack([{"a": torch.ones(1), "b": torch.ones(2)}, {"a": torch.ones(1), "b": torch.ones(2, device="meta")}])


_RESUMED_OBSERVERS = {
    "mse": (lambda s: qstats.mse(s, grid=20), qstats.QuantSpec(dtype="int4")),
    "mse_moving_average": (
        lambda s: qstats.mse(s, grid=20, mode="moving_average", averaging_constant=0.5),
        qstats.QuantSpec(dtype="int4"),
    ),
    "moments": (qstats.moments, qstats.QuantSpec(granularity=qstats.PerAxis(-1))),
    "imatrix": (lambda s: qstats.imatrix(), None),
    "hessian": (lambda s: qstats.hessian(), None),
    "recording": (lambda s: qstats.recording(capacity=16), None),
    "nvfp4": (qstats.minmax, qstats.preset("nvfp4")),
    "histogram_group": (lambda s: qstats.histogram(s, buckets_per_octave=4, octaves=10),
                        qstats.QuantSpec(granularity=qstats.PerGroup(8))),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(_RESUMED_OBSERVERS))
def test_resume_from_a_file_equals_one_run_for_half_precision_models(tmp_path, name, dtype):
    """test_resume covers minmax, moving average and histogram on float32; these are the others."""
    observer, spec = _RESUMED_OBSERVERS[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(dtype).eval()
    options = {} if spec is None else {"spec": spec}
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=observer, **options)])
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g) * (1 + i)).to(dtype) for i in range(4)]
    whole = qstats.calibrate(model, batches, recipe, progress=False)
    qstats.save(tmp_path / "half.safetensors", qstats.calibrate(model, batches[:2], recipe, progress=False))
    resumed = qstats.calibrate(model, batches[2:], recipe, states=qstats.load(tmp_path / "half.safetensors"),
                               progress=False)
    want, want_spec = optree.tree_flatten(whole)
    got, got_spec = optree.tree_flatten(resumed)
    assert got_spec == want_spec
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
