"""qstats.load of a file whose structure does not fit this code: the error names the file and the
problem, and a damaged structure is reported as damage (its checksum), not as code to import.

A state type that gained a field, or that this process does not define, is a file of other code: the
message names the file, the path in the tree and both field lists. A byte flipped in a type or field
name of the header is damage: the layout checksum `qstats.save` writes fails, and the message says
"corrupt" first (it said "import the module that defines it" for a damaged type name, and "the file
is incomplete" for a damaged tensor name).
"""

from typing import NamedTuple

import pytest
import torch

import qstats
from qstats.observers import _base


def _growing_state(*fields):
    """One registered state class, ``GrowingState``, with these fields: as the same class of an older
    or newer version of the code that defines it (same module and name, so it re-registers)."""
    cls = NamedTuple("GrowingState", [(field, torch.Tensor) for field in fields])
    cls.__module__, cls.__qualname__ = __name__, "GrowingState"
    return qstats.register_state(cls)


@pytest.fixture
def restore_registry(monkeypatch):
    monkeypatch.setattr(_base, "_STATE_TYPES", dict(_base._STATE_TYPES))


def _state(cls):
    return cls(*[torch.arange(3.0) + i for i in range(len(cls._fields))])


def test_a_state_that_gained_a_field_names_the_file_and_both_field_lists(tmp_path, restore_registry):
    older = _growing_state("total", "count")
    path = tmp_path / "older.safetensors"
    qstats.save(path, {"layer": {"input": _state(older)}})
    _growing_state("total", "count", "peak")  # the class, one version later
    with pytest.raises(ValueError) as raised:
        qstats.load(path)
    message = str(raised.value)
    assert str(path) in message
    assert "['total', 'count']" in message and "['total', 'count', 'peak']" in message
    assert "tree['layer']['input']" in message and "corrupt" not in message
    _growing_state("total", "count")
    assert torch.equal(qstats.load(path)["layer"]["input"].count, _state(older).count)  # loads where it fits


def test_a_state_type_this_process_lacks_names_the_file(tmp_path, restore_registry):
    cls = _growing_state("total")
    path = tmp_path / "other.safetensors"
    qstats.save(path, [_state(cls)])
    del _base._STATE_TYPES["GrowingState"]  # a process that never imported the defining module
    with pytest.raises(ValueError, match="unknown state type 'GrowingState'") as raised:
        qstats.load(path)
    assert str(path) in str(raised.value) and "corrupt" not in str(raised.value)


def _flipped(path, old: bytes, new: bytes):
    """The file with the first ``old`` in its header replaced by ``new`` (same length: the header
    stays readable JSON and the tensors' offsets stay valid)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    at = data.index(old, 8, header_end)
    out = path.with_name("damaged.safetensors")
    out.write_bytes(data[:at] + new + data[at + len(old):])
    return out


@pytest.mark.parametrize(
    "old, new",
    [
        (b"MinMaxState", b"MinMaxStbte"),  # a type name: was "unknown state type ... import the module"
        (b'min_val\\", {', b'min_vbl\\", {'),  # a field name: was "saved with fields ..."
        (b'count\\"}', b'counT\\"}'),  # a tensor's name in the structure: was "the file is incomplete"
        (b'\\"t\\": \\"dict', b'\\"t\\": \\"dicT'),  # a node kind: was "malformed checkpoint structure"
    ],
)
def test_a_damaged_structure_is_reported_as_corrupt_naming_the_file(tmp_path, old, new):
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.randn(16, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "stats.safetensors"
    qstats.save(path, {"fc": {"weight": obs.update(obs.init(x), x)}})
    damaged = _flipped(path, old, new)
    with pytest.raises(ValueError) as raised:
        qstats.load(damaged)
    message = str(raised.value)
    assert message.startswith(f"qstats.io: {damaged} is corrupt: its structure"), message
    assert "checksum" in message
