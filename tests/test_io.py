"""qstats.save / qstats.load (one safetensors file) and torch.save compatibility."""

import io as _stdio
import json

import pytest
import safetensors
import safetensors.torch
import torch
from observer_cases import CASES

import qstats
from qstats import io as qio
from qstats import tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so that NaN payloads and -0.0 count."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got, expected):
    tree.assert_same_structure(got, expected)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(got), tree.leaves_with_paths(expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bits(a), _bits(b)), path


def _every_case_state():
    """{case name: (state, qparams)} for every observer in observer_cases, after two updates."""
    out = {}
    for case in CASES:
        name, factory, make_x = case[:3]
        obs = factory()
        g = torch.Generator().manual_seed(len(out))
        state = obs.init(make_x(g))
        for _ in range(2):
            state = obs.update(state, make_x(g))
        spec = obs.spec
        qparams = qstats.compute_qparams(state, spec) if spec is not None else None
        out[name] = (state, qparams)
    return out


def _odd_values():
    return torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.0e38, 1.0 / 3.0])


@pytest.fixture
def nested_tree():
    states = _every_case_state()
    return {
        "model": {
            name: {"state": state, "qparams": qparams} if qparams is not None else {"state": state}
            for name, (state, qparams) in states.items()
        },
        "experts": [states["minmax/axis0"][0], (states["moving_average_minmax/tensor"][0], _odd_values())],
        "odd/name%": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "low": (torch.randn(3).to(torch.bfloat16), torch.randn(3).to(torch.float8_e4m3fn), torch.tensor([True, False])),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def test_round_trip_is_bit_exact_for_every_state_type(tmp_path, nested_tree):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, nested_tree)
    loaded = qstats.load(path)
    _assert_bit_exact(loaded, nested_tree)
    saved_types = {type(s).__name__ for s, _ in _every_case_state().values()}
    assert saved_types <= set(qstats.observers.state_types())
    for name, entry in loaded["model"].items():
        assert type(entry["state"]) is type(nested_tree["model"][name]["state"])


def test_file_is_plain_safetensors_with_versioned_metadata(tmp_path, nested_tree):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, nested_tree)
    raw = safetensors.torch.load_file(str(path))  # an independent reader
    assert torch.equal(raw["model/minmax%2Faxis0/state/max_val"], nested_tree["model"]["minmax/axis0"]["state"].max_val)
    assert torch.equal(raw["odd%2Fname%25"], nested_tree["odd/name%"])
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "qstats"
    assert metadata["format_version"] == str(qio.FORMAT_VERSION)
    structure = json.loads(metadata["structure"])
    assert structure["t"] == "dict"


def test_bare_state_and_bare_tensor_round_trip(tmp_path):
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.randn(5)
    state = obs.update(obs.init(x), x)
    for value in (state, x, [state, state]):
        path = tmp_path / "one.safetensors"
        qstats.save(path, value)
        _assert_bit_exact(qstats.load(path), value)


def test_torch_load_weights_only_reads_every_state_type_and_state_dicts(nested_tree):
    buffer = _stdio.BytesIO()
    torch.save(nested_tree, buffer)
    buffer.seek(0)
    _assert_bit_exact(torch.load(buffer, weights_only=True), nested_tree)  # registered at import
    assert set(qio.safe_globals()) <= set(torch.serialization.get_safe_globals())

    buffer = _stdio.BytesIO()
    torch.save(qio.to_state_dict(nested_tree), buffer)
    buffer.seek(0)
    plain = torch.load(buffer, weights_only=True)  # no allow-list: strings and tensors only
    _assert_bit_exact(qio.from_state_dict(plain), nested_tree)


def test_from_state_dict_rejects_foreign_and_future_dicts(nested_tree):
    state_dict = qio.to_state_dict(nested_tree)
    with pytest.raises(ValueError, match="format version 2"):
        qio.from_state_dict({**state_dict, "format_version": 2})
    with pytest.raises(ValueError, match="missing"):
        qio.from_state_dict({"tensors": {}})
    with pytest.raises(ValueError, match="no tensor"):
        tensors = dict(state_dict["tensors"])
        tensors.pop(next(iter(tensors)))
        qio.from_state_dict({**state_dict, "tensors": tensors})


def _saved(tmp_path, tree_):
    path = tmp_path / "stats.safetensors"
    qstats.save(path, tree_)
    return path


def _rewrite(path, edit_metadata=None, drop=None):
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    if edit_metadata:
        edit_metadata(metadata)
    if drop:
        tensors.pop(drop)
    out = path.with_name("edited.safetensors")
    safetensors.torch.save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.mark.parametrize("keep", [0, 7, 60, -1, -9])
def test_truncated_file_raises(tmp_path, nested_tree, keep):
    path = _saved(tmp_path, nested_tree)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(ValueError, match="corrupt|truncated"):
        qstats.load(cut)


def test_flipped_data_byte_fails_the_checksum(tmp_path, nested_tree):
    path = _saved(tmp_path, nested_tree)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        qstats.load(path)


def test_garbage_and_foreign_files_raise(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a checkpoint at all" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        qstats.load(garbage)
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="not a qstats checkpoint"):
        qstats.load(foreign)
    with pytest.raises(FileNotFoundError):
        qstats.load(tmp_path / "missing.safetensors")


def test_unknown_format_version_raises(tmp_path, nested_tree):
    path = _saved(tmp_path, nested_tree)
    edited = _rewrite(path, edit_metadata=lambda m: m.update(format_version="99"))
    with pytest.raises(ValueError, match="format version '99'"):
        qstats.load(edited)


def test_missing_tensor_raises_naming_it(tmp_path, nested_tree):
    path = _saved(tmp_path, nested_tree)
    edited = _rewrite(path, drop="model/minmax%2Ftensor/state/count")
    with pytest.raises(ValueError, match="model/minmax%2Ftensor/state/count"):
        qstats.load(edited)


def test_unknown_state_type_and_changed_fields_raise(tmp_path, nested_tree):
    path = _saved(tmp_path, nested_tree)

    def rename(metadata):
        metadata["structure"] = metadata["structure"].replace('"MinMaxState"', '"NoSuchState"')

    with pytest.raises(ValueError, match="unknown state type 'NoSuchState'"):
        qstats.load(_rewrite(path, edit_metadata=rename))

    def refield(metadata):
        metadata["structure"] = metadata["structure"].replace('["nonfinite"', '["non_finite"')

    with pytest.raises(ValueError, match="fields"):
        qstats.load(_rewrite(path, edit_metadata=refield))

    def break_json(metadata):
        metadata["structure"] = metadata["structure"][:-3]

    with pytest.raises(ValueError, match="structure"):
        qstats.load(_rewrite(path, edit_metadata=break_json))


def test_save_rejects_what_it_cannot_rebuild(tmp_path):
    from typing import NamedTuple

    class Unregistered(NamedTuple):
        value: torch.Tensor

    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="not a registered state type"):
        qstats.save(path, {"a": Unregistered(torch.zeros(1))})
    with pytest.raises(TypeError, match=r"float at a"):
        qstats.save(path, {"a": 1.0})
    with pytest.raises(TypeError, match="keys must be strings"):
        qstats.save(path, {1: torch.zeros(1)})


def test_a_qparams_tree_with_runtime_sites_round_trips(tmp_path):
    """compute_qparams_tree gives None for sites whose scales come at run time (compressed-tensors'
    W8A8 inputs): such a tree saves and loads, the None kept, the QParams bit for bit."""
    weights = qstats.QuantSpec.from_compressed_tensors({"num_bits": 8, "type": "int", "strategy": "channel"})
    inputs = qstats.QuantSpec.from_compressed_tensors(
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    )
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=weights),
                            qstats.Rule("Linear", sites=("input",), spec=inputs)])
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    states = qstats.calibrate(model, [torch.randn(2, 3, 8)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    assert qparams["0"]["input"] is None
    qstats.save(tmp_path / "q.safetensors", qparams)
    loaded = qstats.load(tmp_path / "q.safetensors")
    assert loaded["0"]["input"] is None
    assert all(torch.equal(a, b) for a, b in zip(loaded["0"]["weight"], qparams["0"]["weight"]))
    assert qio.from_state_dict(qio.to_state_dict([None, (None,)])) == [None, (None,)]


@pytest.mark.parametrize(
    "tree_",
    [
        {"_": torch.ones(2), "": torch.zeros(2)},
        {"": {"": torch.arange(3.0)}, "_": torch.full((2,), 7.0), "%empty": torch.ones(1), "%root": torch.zeros(1)},
        [torch.ones(1), {"": torch.zeros(1)}],
        torch.arange(4.0),
    ],
    ids=["underscore-and-empty", "nested-empty-and-lookalikes", "list", "bare-tensor"],
)
def test_keys_that_join_to_nothing_do_not_collide(tmp_path, tree_):
    """An empty name (or the bare root) and a real key "_" once mapped to the same tensor key:
    the second tensor overwrote the first."""
    _assert_bit_exact(qstats.load(_saved(tmp_path, tree_)), tree_)
    with safetensors.safe_open(str(tmp_path / "stats.safetensors"), framework="pt") as handle:
        assert len(list(handle.keys())) == len(tree.leaves_with_paths(tree_))


def test_a_top_level_key_named_like_the_safetensors_header_round_trips(tmp_path):
    """A top-level key "__metadata__" became the tensor name safetensors reserves for its header:
    save wrote a file that load refused as corrupt."""
    tree_ = {"__metadata__": torch.arange(3.0), "a": {"__metadata__": torch.ones(2)}}
    _assert_bit_exact(qstats.load(_saved(tmp_path, tree_)), tree_)
    assert list(qstats.load(tmp_path / "stats.safetensors")) == ["__metadata__", "a"]


def test_a_bare_tensor_saved_under_the_earlier_root_key_still_loads(tmp_path):
    """Files written before the root key became "%root" name their bare tensor "_"; loading reads
    the key from the file's own structure."""
    value = torch.arange(5.0)
    path = _saved(tmp_path, value)
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        (key,) = list(handle.keys())
        tensor = handle.get_tensor(key)
    assert key == "%root"
    metadata["structure"] = metadata["structure"].replace('"%root"', '"_"')
    metadata["checksums"] = metadata["checksums"].replace('"%root"', '"_"')
    del metadata["layout_checksum"]  # added to the format later than "%root"
    old = tmp_path / "old.safetensors"
    safetensors.torch.save_file({"_": tensor}, str(old), metadata=metadata)
    assert torch.equal(qstats.load(old), value)


def test_malformed_item_lists_raise_naming_the_structure(tmp_path):
    path = _saved(tmp_path, {"a": torch.ones(1), "b": [torch.zeros(1)]})

    def drop_value(metadata):
        structure = json.loads(metadata["structure"])
        structure["items"][0] = [structure["items"][0][0]]  # a [key] pair without its value
        metadata["structure"] = json.dumps(structure)

    with pytest.raises(ValueError, match="malformed checkpoint structure"):
        qstats.load(_rewrite(path, edit_metadata=drop_value))


@pytest.mark.parametrize("depth", [100_000, 990])
def test_deeply_nested_structure_metadata_is_a_clear_error(tmp_path, depth):
    """A crafted file whose structure metadata nests too deeply for the JSON parser (or for the
    rebuild after it) raises ValueError, not RecursionError."""
    import struct

    path = str(tmp_path / "deep.safetensors")
    qstats.save(path, {"a": torch.ones(2)})
    raw = open(path, "rb").read()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    header["__metadata__"]["structure"] = "[" * depth + "]" * depth
    encoded = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(encoded)) + encoded + raw[8 + size :])
    with pytest.raises(ValueError, match="qstats.io"):
        qstats.load(path)


def test_torch_load_with_weights_only_reads_states_and_qparams_after_import(tmp_path):
    """torch.load's default (weights_only=True) refused every qstats state with UnpicklingError."""
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    w = torch.randn(4, 8)
    state = obs.update(obs.init(w), w)
    tree = {"state": state, "qparams": qstats.compute_qparams(state, spec),
            "lsq": qstats.lsq_init(state, spec)}
    path = tmp_path / "states.pt"
    torch.save(tree, path)
    loaded = torch.load(path)  # weights_only=True is torch's default
    _assert_bit_exact(loaded, tree)
    assert type(loaded["state"]) is qstats.MinMaxState and type(loaded["lsq"]) is qstats.LSQParams


def test_lsq_params_save_and_load(tmp_path):
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    obs = qstats.minmax(spec)
    w = torch.randn(4, 8)
    ranges = qstats.lsq_init(obs.update(obs.init(w), w), spec)
    qstats.save(tmp_path / "lsq.safetensors", {"layer": ranges})
    _assert_bit_exact(qstats.load(tmp_path / "lsq.safetensors"), {"layer": ranges})


def test_meta_tensors_deep_trees_and_duplicate_keys_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="meta device"):
        qstats.save(tmp_path / "meta.safetensors", {"x": torch.empty(3, device="meta")})
    deep = torch.zeros(1)
    for _ in range(3000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested more than"):
        qstats.save(tmp_path / "deep.safetensors", deep)
    # a hand-edited structure with a duplicate key (the checksums still pass)
    state_dict = qio.to_state_dict({"a": torch.ones(1), "b": torch.zeros(1)})
    state_dict["structure"] = state_dict["structure"].replace('["b", ', '["a", ')
    with pytest.raises(ValueError, match="duplicate keys"):
        qio.from_state_dict(state_dict)


def _old_qparams_file(path, fields):
    """A checkpoint as qstats wrote it while QParams had four fields, built by hand (safetensors and
    the documented metadata), not by our encoder."""
    import zlib

    tensors = {f"experts/{name}": value.contiguous() for name, value in fields.items()}
    structure = {"t": "dict", "items": [["experts", {"t": "namedtuple", "type": "QParams", "fields": [
        [name, {"t": "tensor", "key": f"experts/{name}"}] for name in fields]}]]}
    checksums = {key: f"{zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes()):08x}"
                 for key, t in tensors.items()}
    metadata = {"format": "qstats", "format_version": "1", "structure": json.dumps(structure),
                "checksums": json.dumps(checksums)}
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return path


def test_a_checkpoint_saved_before_qparams_had_minval_still_loads(tmp_path):
    """Files written with the four-field QParams load with ``minval`` None and every other field bit for
    bit; they fake-quantize, slice per expert and save again as before. A file missing a field without
    a default still raises."""
    from qstats._qparams import experts_qparams
    from qstats.export.experts import fill_uncovered_experts

    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric", granularity=qstats.PerAxis(0))
    fields = {"scale": torch.tensor([[0.5, 0.25], [1.0, 0.125]]),
              "zero_point": torch.tensor([[3, -2], [0, 7]], dtype=torch.int32),
              "global_scale": torch.ones(2), "calibrated": torch.tensor([[True, True], [False, False]])}
    loaded = qstats.load(_old_qparams_file(tmp_path / "old.safetensors", fields))["experts"]
    assert type(loaded) is qstats.QParams and loaded.minval is None
    for name, value in fields.items():
        assert torch.equal(getattr(loaded, name), value) and getattr(loaded, name).dtype == value.dtype
    expert = experts_qparams(loaded, 0)
    assert expert.minval is None and torch.equal(expert.scale, fields["scale"][0])
    codes = torch.tensor([[-128.0, 5.0], [127.0, 0.0]]).T  # rows are channels: x = (q - zp) * scale
    x = (codes - fields["zero_point"][0].float()) * fields["scale"][0]
    assert torch.equal(qstats.fake_quantize(x.T, expert, spec).T, x)
    filled = fill_uncovered_experts(loaded, spec)
    assert filled.minval is None and torch.equal(filled.scale[1], fields["scale"][0])
    qstats.save(tmp_path / "new.safetensors", {"experts": loaded})
    again = qstats.load(tmp_path / "new.safetensors")["experts"]
    assert again.minval is None and all(torch.equal(a, b) for a, b in zip(again[:4], loaded[:4]))
    three = {name: fields[name] for name in ("scale", "zero_point", "global_scale")}
    with pytest.raises(ValueError, match="fields"):
        qstats.load(_old_qparams_file(tmp_path / "three.safetensors", three))


def test_a_one_element_view_with_a_wide_stride_saves(tmp_path):
    """``x[:1, 0]`` of a (5, 3) tensor is "contiguous" to torch but keeps stride 3: the checksum's byte
    view raised RuntimeError. safetensors' own writer and reader are the reference."""
    base = torch.arange(15.0).reshape(5, 3)
    tree_ = {"scale": base[:1, 0], "neg": torch.tensor([1 + 2j, 3 - 4j]).conj().imag, "row": base[2:3, 1:2]}
    path = _saved(tmp_path, tree_)
    dense = {key: value.clone(memory_format=torch.contiguous_format) for key, value in tree_.items()}
    _assert_bit_exact(qstats.load(path), dense)
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_file({key: value.contiguous() for key, value in tree_.items()}, str(reference))
    raw = safetensors.torch.load_file(str(path))
    for key, value in safetensors.torch.load_file(str(reference)).items():
        assert torch.equal(raw[key], value), key


def test_a_dtype_safetensors_cannot_hold_is_a_clear_error_and_keeps_the_old_file(tmp_path):
    """A quantized or complex32 tensor raised a bare KeyError(torch.qint8) from safetensors."""
    path = _saved(tmp_path, {"good": torch.ones(2)})
    for bad in (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), torch.ones(2, dtype=torch.complex32)):
        with pytest.raises(TypeError, match=rf"'layer/x'.*{bad.dtype}"):
            qstats.save(path, {"layer": {"x": bad}})
    assert torch.equal(qstats.load(path)["good"], torch.ones(2))


def test_a_torch_save_file_is_named_as_such(tmp_path):
    """A file of another kind (torch.save of a to_state_dict) was reported only as corrupt."""
    path = tmp_path / "states.pt"
    torch.save(qio.to_state_dict({"a": torch.ones(2)}), path)
    with pytest.raises(ValueError, match=r"states\.pt.*torch\.save file"):
        qstats.load(path)
    assert torch.equal(qio.from_state_dict(torch.load(path))["a"], torch.ones(2))


@pytest.mark.parametrize("device", [None, {"cuda:0": "cpu"}, "not-a-device"])
def test_load_names_a_bad_device_before_reading_the_file(tmp_path, device):
    """torch.device(None) was a TypeError from deep in load, after the whole file was read: the
    check now runs first (a missing file is not even opened)."""
    with pytest.raises(TypeError, match=r"qstats.io.load: device must be a torch.device or its name"):
        qstats.load(tmp_path / "absent.safetensors", device=device)
    obs = qstats.minmax(qstats.QuantSpec())
    x = torch.tensor([-1.0, 3.0])
    qstats.save(tmp_path / "s.safetensors", {"a": obs.update(obs.init(x), x)})
    loaded = qstats.load(tmp_path / "s.safetensors", device=torch.device("cpu"))["a"]
    assert loaded.min_val.item() == -1.0 and loaded.max_val.item() == 3.0
    assert qstats.load(tmp_path / "s.safetensors", device="meta")["a"].max_val.device.type == "meta"
