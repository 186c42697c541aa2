"""Checkpoints of states: one safetensors file, versioned, rebuilt by type name.

`save(path, tree)` writes a tree of dicts, lists, tuples, registered states, `QParams`, tensors and
None (a run-time site's qparams) bit-exactly, with format version, nesting, type names, a CRC-32
per tensor and one over the structure and the tensors' names, dtypes and shapes in the metadata; `load(path)` rebuilds it by looking state types up by name, so nothing
is pickled. `to_state_dict` / `from_state_dict` give plain containers for ``torch.save``. Bad files
raise ValueError naming the problem. See docs/distributed.md.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import zipfile
import zlib
from typing import Any

import optree
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ._checks import check_available
from ._qparams import QParams
from .distributed import flat_unit_stride
from .lsq import LSQParams
from .observers._base import state_types
from .qat import BatchNormState, QATState

__all__ = ["save", "load", "to_state_dict", "from_state_dict", "safe_globals", "FORMAT", "FORMAT_VERSION", "MAX_DEPTH"]

FORMAT = "qstats"
FORMAT_VERSION = 1
MAX_DEPTH = 100  # nesting of a checkpoint's tree (a model's tree is a few levels deep)

# what compute_qparams and lsq_init return, and what a QAT model carries between steps
_RESULT_TYPES = (QParams, LSQParams, QATState, BatchNormState)
torch.serialization.add_safe_globals(list(_RESULT_TYPES))


def _named_types() -> dict[str, type]:
    types = state_types()
    for cls in _RESULT_TYPES:
        types.setdefault(cls.__name__, cls)
    return types


def safe_globals() -> list[type]:
    """The NamedTuple classes a checkpoint may hold (every registered state type and QParams), for
    ``torch.serialization.safe_globals`` / ``add_safe_globals`` with ``torch.load(weights_only=True)``."""
    return list(_named_types().values())


def _encode(tree: Any, path: list[str], tensors: dict[str, torch.Tensor]) -> dict:
    where = "/".join(path) or "<root>"
    if len(path) > MAX_DEPTH:
        raise ValueError(f"qstats.io: the tree is nested more than {MAX_DEPTH} levels deep (at {where[:200]})")
    if isinstance(tree, torch.Tensor):
        if tree.device.type == "meta":
            raise ValueError(f"qstats.io: tensor at {where} is on the meta device and holds no data to save")
        # escaped components hold "%" only as "%25" or "%2F", so distinct paths give distinct keys: the
        # two keys of an empty join (the root itself, or a single empty name) collide with no other path
        key = "/".join(part.replace("%", "%25").replace("/", "%2F") for part in path)
        key = key or ("%root" if not path else "%empty")
        if key == "__metadata__":  # safetensors' own header entry: a tensor of that name made an unreadable file
            key = "%5F_metadata__"
        if tree.is_nested:  # strided nested tensors too: rows of uneven lengths, which safetensors cannot hold
            raise TypeError(f"qstats.io: tensor at {where} is a nested tensor (layout {tree.layout}); only dense "
                            "tensors are saved")
        if tree.layout != torch.strided:
            raise TypeError(f"qstats.io: tensor at {where} has layout {tree.layout}; only dense tensors are saved")
        tensors[key] = tree
        return {"t": "tensor", "key": key}
    if tree is None:
        return {"t": "none"}
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        name = type(tree).__name__
        known = _named_types().get(name)
        if known is not type(tree):
            raise TypeError(f"qstats.io: {name} at {where} is not a registered state type; decorate it with "
                            "qstats.register_state")
        fields = [[field, _encode(value, path + [field], tensors)] for field, value in zip(tree._fields, tree)]
        return {"t": "namedtuple", "type": name, "fields": fields}
    if isinstance(tree, dict):
        items = []
        for key, value in tree.items():
            if not isinstance(key, str):
                raise TypeError(f"qstats.io: dict keys must be strings, got {key!r} at {where}")
            items.append([key, _encode(value, path + [key], tensors)])
        return {"t": "dict", "items": items}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        if type(tree) not in (list, tuple):
            raise TypeError(f"qstats.io: unsupported container {type(tree).__name__} at {where}")
        return {"t": kind, "items": [_encode(value, path + [str(i)], tensors) for i, value in enumerate(tree)]}
    raise TypeError(f"qstats.io: cannot save a {type(tree).__name__} at {where}; a checkpoint holds dicts, "
                    "lists, tuples, registered states, QParams, tensors and None")


def _malformed(where: str, node: Any) -> ValueError:
    return ValueError(f"qstats.io: malformed checkpoint structure at {where}: {str(node)[:200]}")


def _decode(node: Any, tensors: dict[str, torch.Tensor], used: set, where: str) -> Any:
    if not isinstance(node, dict) or "t" not in node:
        raise _malformed(where, node)
    kind = node["t"]
    try:
        if kind == "tensor":
            key = node["key"]
            if key not in tensors:
                raise ValueError(f"qstats.io: the checkpoint has no tensor {key!r} (needed at {where}); the "
                                 "file is incomplete")
            if key in used:  # save writes one tensor per leaf: a shared key would alias two leaves
                raise ValueError(f"qstats.io: malformed checkpoint structure at {where}: tensor {key!r} is used by two "
                                 "leaves (qstats.save writes one per leaf)")
            used.add(key)
            return tensors[key]
        if kind == "namedtuple":
            name = node["type"]
            types = _named_types()
            cls = types.get(name)
            if cls is None:
                raise ValueError(f"qstats.io: unknown state type {name!r} at {where}; import the module that "
                                 f"defines it (registered: {sorted(types)})")
            names = [field for field, _ in node["fields"]]
            # a checkpoint from before trailing fields with defaults were added (QParams.minval) loads
            # with those defaults
            older = tuple(names) == cls._fields[: len(names)] and set(cls._fields[len(names):]) <= set(
                cls._field_defaults)
            if tuple(names) != tuple(cls._fields) and not older:
                raise ValueError(f"qstats.io: state {name} at {where} was saved with fields {names}, but "
                                 f"{name} now has fields {list(cls._fields)}")
            return cls(*[_decode(value, tensors, used, f"{where}.{field}") for field, value in node["fields"]])
        if kind == "none":
            return None
        if kind == "dict":
            keys = [key for key, _ in node["items"]]
            bad = [key for key in keys if not isinstance(key, str)]
            if bad:
                raise ValueError(f"qstats.io: malformed checkpoint structure at {where}: dict key {bad[0]!r} is "
                                 "not a string (qstats.save writes string keys only)")
            if len(set(keys)) != len(keys):
                duplicates = sorted({key for key in keys if keys.count(key) > 1})
                raise ValueError(f"qstats.io: malformed checkpoint structure at {where}: duplicate keys {duplicates[:5]}")
            return {key: _decode(value, tensors, used, f"{where}[{key!r}]") for key, value in node["items"]}
        if kind in ("list", "tuple"):
            items = [_decode(value, tensors, used, f"{where}[{i}]") for i, value in enumerate(node["items"])]
            return items if kind == "list" else tuple(items)
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        if isinstance(error, ValueError) and str(error).startswith("qstats.io:"):
            raise  # a clear error from a nested node: keep it
        raise _malformed(where, node) from None
    raise _malformed(where, node)


def _check_header(format_name: Any, version: Any, source: str) -> None:
    if format_name != FORMAT:
        raise ValueError(f"qstats.io: {source} is not a qstats checkpoint (format {format_name!r})")
    if str(version) != str(FORMAT_VERSION):
        newer = str(version).isdigit() and int(version) > FORMAT_VERSION
        hint = ": it was written by a newer qstats; upgrade qstats to read it" if newer else ""
        raise ValueError(f"qstats.io: {source} has format version {version!r}; this qstats reads version "
                         f"{FORMAT_VERSION}{hint}")


def _rebuild(structure: Any, tensors: dict[str, torch.Tensor], source: str) -> Any:
    if isinstance(structure, str):
        try:
            structure = json.loads(structure)
        except (json.JSONDecodeError, RecursionError) as error:
            raise ValueError(f"qstats.io: {source} has unreadable structure metadata ({error})") from None
    used: set = set()
    try:
        tree = _decode(structure, tensors, used, "tree")
    except RecursionError:
        raise ValueError(f"qstats.io: {source} has structure metadata nested too deeply (corrupt checkpoint)") from None
    except ValueError as error:  # a state type or fields of other code, a missing tensor: name the file too
        raise ValueError(f"qstats.io: {source}: {str(error).removeprefix('qstats.io: ')}") from None
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"qstats.io: {source} holds tensors that its structure does not mention: {extra[:5]}")
    return tree


def to_state_dict(tree: Any) -> dict:
    """A plain dict for ``torch.save`` / ``torch.load(weights_only=True)`` with no allow-list:
    ``{"format", "format_version", "structure" (JSON), "tensors"}`` of strings, ints and the tree's own
    tensors (not copied).
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, [], tensors)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "structure": json.dumps(structure),
            "tensors": tensors}


def from_state_dict(state_dict: dict) -> Any:
    """Inverse of `to_state_dict` (ValueError for a dict that is not one, or is incomplete)."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"qstats.io.from_state_dict: expected a dict, got {type(state_dict).__name__}")
    missing = [k for k in ("format", "format_version", "structure", "tensors") if k not in state_dict]
    if missing:
        raise ValueError(f"qstats.io.from_state_dict: not a qstats state dict (missing {missing})")
    _check_header(state_dict["format"], state_dict["format_version"], "the state dict")
    tensors = state_dict["tensors"]
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError("qstats.io.from_state_dict: 'tensors' must be a dict of tensors")
    return _rebuild(state_dict["structure"], tensors, "the state dict")


def _checksum(tensor: torch.Tensor) -> str:
    data = flat_unit_stride(tensor.to("cpu")).view(torch.uint8).numpy()  # read in place, not copied to bytes
    return f"{zlib.crc32(data):08x}"


def _unshared_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense CPU tensors, none sharing storage with another (safetensors refuses that): a CPU tensor
    that spans its storage alone is written as it is, the others are copied (not the whole tree, which
    would double the memory a save takes)."""
    out = {}
    owners: set = set()
    for key, tensor in tensors.items():
        dense = flat_unit_stride(tensor.to("cpu")).reshape(tensor.shape)  # unit strides of its own
        storage = dense.untyped_storage()
        whole = dense.storage_offset() == 0 and storage.nbytes() == dense.numel() * dense.element_size()
        if not whole or storage.data_ptr() in owners:  # a view into more, or a storage already written
            dense = dense.clone()
        elif storage.nbytes():
            owners.add(storage.data_ptr())
        out[key] = dense
    return out


def _layout_checksum(structure: str, checksums: str, tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 of what the per-tensor checksums leave out: the tree's structure (nesting, keys, state
    types), the checksums themselves and each tensor's name, dtype and shape in the safetensors header."""
    layout = sorted((key, str(tensor.dtype), list(tensor.shape)) for key, tensor in tensors.items())
    return f"{zlib.crc32(json.dumps([structure, checksums, layout]).encode()):08x}"


def _check_storable(tensors: dict[str, torch.Tensor]) -> None:
    storable = getattr(safetensors.torch, "_SIZE", None)  # the dtypes safetensors writes (private: may go)
    for key, tensor in tensors.items():
        # the structure metadata escapes it; tensor names are UTF-8, which holds no surrogate code point
        if not key.isascii() and any("\ud800" <= char <= "\udfff" for char in key):
            raise ValueError(f"qstats.io: the tree path {key!r} is not valid Unicode text (a lone surrogate, "
                             "as os.fsdecode gives for undecodable bytes); a safetensors file holds tensor "
                             "names as UTF-8")
        if tensor.is_quantized or (storable is not None and tensor.dtype not in storable):
            raise TypeError(f"qstats.io: tensor {key!r} has dtype {tensor.dtype}, which a safetensors file "
                            "cannot hold (dequantize it, or save its int_repr() and qparams)")
        if tensor.dim() == 0 and tensor.dtype == getattr(torch, "float4_e2m1fn_x2", None):
            raise TypeError(f"qstats.io: tensor {key!r} is a 0-dimensional {tensor.dtype}, which a "
                            "safetensors file cannot hold (it stores the two 4-bit values of each byte along "
                            "the last dimension): save it reshaped to (1,)")


_FOREIGN_MAGIC = (  # the first bytes of other files a checkpoint path may name by mistake
    (b"\x93NUM", "a NumPy .npy file"),
    (b"PK\x03\x04", "a zip archive (a NumPy .npz file?)"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x89HDF", "an HDF5 file"),
)


def _zip_holds_pickle(source: str) -> bool:
    """A torch.save zip holds ``<name>/data.pkl``; other zips (numpy's .npz) do not."""
    try:
        with zipfile.ZipFile(source) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _describe_foreign(source: str) -> str:
    """What a file that is not a safetensors file looks like it is, for the error message."""
    try:
        with open(source, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return ""
    if (head.startswith(b"PK\x03\x04") and _zip_holds_pickle(source)) or head[:1] == b"\x80":
        return ("; it looks like a torch.save file: read it with torch.load (and qstats.io.from_state_dict "
                "for a to_state_dict file)")
    for magic, kind in _FOREIGN_MAGIC:
        if head.startswith(magic):
            return f"; it looks like {kind}"
    return ""


def _header_too_large(target: str, count: int) -> ValueError:
    """safetensors refuses a header (tensor names, structure, checksums) over 100 MB: some 300 000
    tensors, the per-expert states of a large MoE model's Linear modules."""
    return ValueError(f"qstats.io: {target} not written: the tree's {count} tensor names, structure and "
                      "checksums exceed the 100 MB header a safetensors file may have; save it in parts (one "
                      "file per layer), stack experts' states (qstats.tree.stack), or "
                      "torch.save(qstats.io.to_state_dict(tree), path)")


def save(path: str | bytes | os.PathLike, tree: Any) -> None:
    """Writes ``tree`` to one safetensors file at ``path`` (tensors copied to the CPU).

    Args:
      path: file to write. It is replaced whole: the file is written beside it and renamed over it, so a
        failure midway (a full disk, a killed process) keeps the previous file; a symlink's target is
        replaced, with its mode. A hard link is not written through: ``path`` names the new file and the
        old file's other names keep the previous checkpoint (as a rename, ``rsync`` and safetensors' own
        writer replace files; writing into it would lose the previous file on a failure midway). A device,
        FIFO or pipe (``/dev/null``, ``/dev/stdout``) is written into, as ``open`` does.
      tree: dicts with string keys, lists, tuples, registered states, QParams, tensors and None.

    Raises:
      TypeError: for anything else in the tree (names the path and the type); the arguments in
        ``torch.save``'s order (a tree, then a path).
      OSError: the file cannot be written (FileNotFoundError when its folder does not exist or the path
        is empty, NotADirectoryError when a folder in it is a file, IsADirectoryError for a directory or
        a path ending in a separator, PermissionError for a file this process may not write, which is
        kept, OSError ELOOP for a symlink loop), as ``open`` raises, before anything is written.

    >>> import torch, qstats, tempfile, os
    >>> obs = qstats.minmax(qstats.QuantSpec())
    >>> x = torch.tensor([-1.0, 2.0])
    >>> path = os.path.join(tempfile.mkdtemp(), "stats.safetensors")
    >>> qstats.save(path, {"layer0": obs.update(obs.init(x), x)})
    >>> qstats.load(path)["layer0"].max_val
    tensor(2.)
    """
    if isinstance(tree, (str, bytes, os.PathLike)) and not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"qstats.save(path, tree) takes the path first (torch.save(obj, f) takes it last): got a "
                        f"{type(path).__name__} as the path and {os.fsdecode(tree)!r} as the tree")
    state_dict = to_state_dict(tree)
    _check_storable(state_dict["tensors"])
    tensors = _unshared_cpu(state_dict["tensors"])
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "structure": state_dict["structure"],
                "checksums": json.dumps({key: _checksum(t) for key, t in tensors.items()})}
    metadata["layout_checksum"] = _layout_checksum(metadata["structure"], metadata["checksums"], tensors)
    target = os.fsdecode(path)  # a bytes path too, as open() takes
    if target.endswith(("/", os.sep)):
        raise IsADirectoryError(errno.EISDIR, f"qstats.io: could not write {target} (a path ending in a "
                                              "separator names a directory)")
    _check_path(target, "write")
    real = os.path.realpath(target)  # a symlink's target is replaced, as open() writes through it
    if os.path.isdir(real):
        raise IsADirectoryError(errno.EISDIR, f"qstats.io: could not write {target} (it is a directory)")
    if not os.path.isdir(os.path.dirname(real)):  # as torch.save names it (the writer named its temporary file)
        raise FileNotFoundError(errno.ENOENT, f"qstats.io: could not write {target} (its folder "
                                              f"{os.path.dirname(real)} does not exist)")
    if os.path.exists(target) and not os.access(target, os.W_OK):  # open() refuses it; a rename would replace it
        raise PermissionError(errno.EACCES, f"qstats.io: could not write {target} (permission denied: the file is "
                                            "read-only)")
    try:
        # a device, FIFO or pipe (/dev/null; /dev/stdout, whose real path names no file): open() writes into it
        if os.path.exists(target) and not os.path.isfile(target):
            data = safetensors.torch.save(tensors, metadata=metadata)  # in memory: safetensors' writer takes a path
            with open(target, "wb") as handle:
                handle.write(data)
        else:
            _write_replacing(tensors, metadata, real)
    except (SafetensorError, OSError) as error:  # the writer's I/O failures, as open() and torch.save raise them
        if isinstance(error, SafetensorError) and "header too large" in str(error).lower():
            raise _header_too_large(target, len(tensors)) from None
        message = f"qstats.io: could not write {target} ({error})"
        if not os.path.isdir(os.path.dirname(real)):
            raise FileNotFoundError(errno.ENOENT, message) from None
        code = getattr(error, "errno", None)  # the OSError subclass open() raises (the writer's have none)
        raise (OSError(code, message) if isinstance(code, int) else OSError(message)) from None


def _check_path(path: str, verb: str) -> None:
    """The OSError ``open`` raises to ``verb`` (``"read"`` or ``"write"``) ``path`` where it names no file,
    raised before anything is read or written: an empty path, a symlink loop (which a rename would
    replace by a file; safetensors reads it as "No such file or directory"), a folder in it that is a
    file (ELOOP, ENOTDIR, EACCES: the subclass ``open`` raises) and, to read, a path naming nothing."""
    if not path:  # open("") raises FileNotFoundError too, naming no file
        raise FileNotFoundError(errno.ENOENT, f"qstats.io: could not {verb} '' (an empty path names no file)")
    try:
        os.stat(path)
    except OSError as error:
        if verb == "read" or error.errno != errno.ENOENT:  # a file to write may be new
            raise OSError(error.errno, f"qstats.io: could not {verb} {path} ({error.strerror})") from None


def _write_replacing(tensors: dict[str, torch.Tensor], metadata: dict, target: str) -> None:
    """Writes the file beside ``target`` and renames it over ``target`` once complete and on disk, so
    that a failure midway (a full disk, a killed process) leaves the previous file whole and no
    partial one. The file gets the mode of the one it replaces, or ``open``'s (0o666 less the umask)."""
    temporary, mode = _new_file_beside(target)
    try:
        if os.path.isfile(target):
            mode = stat.S_IMODE(os.stat(target).st_mode)
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "r+b") as handle:  # on disk before the rename makes it the checkpoint
            os.fsync(handle.fileno())
        # after the fsync, which reopens it (a write-only mode would refuse that): the writer may have
        # made it 0o600 (safetensors 0.8 renames its own)
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        if os.path.lexists(temporary):
            os.remove(temporary)
        raise


def _new_file_beside(target: str) -> tuple[str, int]:
    """An empty file of a new, unguessable name in ``target``'s folder, and the mode ``open`` gives."""
    folder, name = os.path.split(target)
    candidate = os.path.join(folder, f".{name[:40]}.{secrets.token_hex(8)}.tmp")  # under 255 bytes in UTF-8
    descriptor = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 64 random bits: no clash
    mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
    os.close(descriptor)
    return candidate, mode


_MAX_HEADER = 100_000_000  # safetensors' own limit on a header's size


def _read_stream(source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of the safetensors file that ``source``, a FIFO, pipe or device, yields:
    the header's length, the header, then as many bytes as its tensors span (no more: ``/dev/zero``
    never ends), parsed by safetensors. SafetensorError for what is no such file."""
    with open(source, "rb") as handle:
        head = handle.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else 0
        if size > _MAX_HEADER:
            raise SafetensorError(f"header too large ({size} bytes)")
        header = handle.read(size)
        try:
            entries = json.loads(header)
            spans = [entry["data_offsets"][1] for key, entry in entries.items() if key != "__metadata__"]
            length = max([0] + [int(end) for end in spans])
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            entries, length = {}, 0  # safetensors names what is wrong with the header
        data = head + header + handle.read(length)
    tensors = safetensors.torch.load(data)
    return (entries.get("__metadata__") or {}), tensors


def _read_safetensors(source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of the safetensors file at ``source`` (a FIFO, pipe or device too:
    `_read_stream`); ValueError naming what it is where safetensors cannot read it."""
    regular = os.path.isfile(source)
    try:
        if not regular:  # a FIFO, pipe or device (/dev/stdin), which save writes into: safe_open maps files in memory
            return _read_stream(source)
        with safe_open(source, framework="pt", device="cpu") as handle:
            # copies, as torch.load gives: get_tensor's tensors map the file, so a later write into it (torch.save
            # to the path, open(path, "wb")) changed the loaded tensors (0 -> NaN) or killed the process (SIGBUS)
            return handle.metadata() or {}, {key: _byte_copy(handle.get_tensor(key)) for key in handle.keys()}
    except SafetensorError as error:
        raise ValueError(f"qstats.io: {source} is corrupt or truncated (not a readable safetensors file: "
                         f"{error}){_describe_foreign(source) if regular else ''}") from None
    except (OSError, RuntimeError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"qstats.io: {source} could not be read as a safetensors file: {error}") from None


def _byte_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s bytes as they are (``clone`` makes a bool byte 0x11 a 1, past its checksum)."""
    return tensor.reshape(-1).view(torch.uint8).clone().view(tensor.dtype).reshape(tensor.shape)


def load(path: str | bytes | os.PathLike, device: str | torch.device = "cpu") -> Any:
    """Reads a tree written by `save`; tensors are put on ``device``. Bit-exact.

    Raises:
      ValueError: a corrupt, truncated, foreign or unknown-version file, a missing tensor, a checksum
        mismatch or an unknown state type (the message says which).
      TypeError: ``device`` is no device (``None``, a ``map_location`` dict), before the file is read.
      ValueError: ``device`` is not available here (no CUDA, a GPU index beyond the last), also before.
      OSError: no file at ``path``, as ``open`` raises (FileNotFoundError, for an empty path too, saying
        so; IsADirectoryError, NotADirectoryError when a folder in it is a file, OSError ELOOP for a
        symlink loop).

    A FIFO, pipe or device (``/dev/stdin``, a FIFO `save` writes into) is read as ``open`` reads it
    (a FIFO waits for its writer), up to the end of the file's last tensor.
    """
    try:  # before the file is read: torch.device(None) is a TypeError
        device = torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise TypeError(f"qstats.io.load: device must be a torch.device or its name, got {device!r} ({error})") from None
    if device.type not in ("cpu", "meta"):
        check_available(device, "qstats.io.load")
    source = os.fsdecode(path)  # a bytes path too, as open() takes
    _check_path(source, "read")
    if os.path.isdir(source):  # safetensors reports "No such device (os error 19)"
        raise IsADirectoryError(errno.EISDIR, f"qstats.io: {source} is a directory, not a checkpoint file")
    metadata, tensors = _read_safetensors(source)
    if "format" not in metadata:
        raise ValueError(f"qstats.io: {source} is a safetensors file without qstats metadata (not a qstats checkpoint)")
    _check_header(metadata.get("format"), metadata.get("format_version"), source)
    for field in ("structure", "checksums"):
        if field not in metadata:
            raise ValueError(f"qstats.io: {source} lacks its {field!r} metadata (corrupt checkpoint)")
    try:
        checksums = json.loads(metadata["checksums"])
    except json.JSONDecodeError as error:
        raise ValueError(f"qstats.io: {source} has unreadable checksum metadata ({error})") from None
    if not isinstance(checksums, dict):
        raise ValueError(f"qstats.io: {source} has malformed checksum metadata")
    for key, tensor in tensors.items():
        expected = checksums.get(key)
        if expected is None:
            raise ValueError(f"qstats.io: {source} has no checksum for tensor {key!r} (corrupt checkpoint)")
        if _checksum(tensor) != expected:
            raise ValueError(f"qstats.io: {source} is corrupt: tensor {key!r} fails its checksum")
    layout = metadata.get("layout_checksum")  # files written before it was added have none
    damaged = layout is not None and _layout_checksum(metadata["structure"], metadata["checksums"], tensors) != layout
    corrupt = (f"qstats.io: {source} is corrupt: its structure or its tensors' names, dtypes or shapes fail their "
               "checksum")
    try:
        tree = _rebuild(metadata["structure"], tensors, source)  # its own errors name what is malformed
    except ValueError as error:
        if not damaged:  # a file of other code: a state type it lacks, fields that changed
            raise
        # a damaged type or field name is damage, not a state type of other code to import
        raise ValueError(f"{corrupt} (read as it is: {str(error).removeprefix(f'qstats.io: {source}: ')})") from None
    if damaged:
        raise ValueError(corrupt)
    if device.type != "cpu":
        tree = optree.tree_map(lambda t: t.to(device), tree)
    return tree
