"""qstats.save / qstats.load round trips, read back with an independent reader (safetensors' own
``load_file``) and compared bit for bit: the stacked states of every observer in observer_cases (as
`qstats.tree.stack` builds per-expert states), and one tree holding each odd leaf at once (shared,
transposed, expanded and sliced tensors, 0-d tensors of several dtypes, bf16 / float64 / fp8 / uint16,
empty dicts, lists and tuples, None)."""

import pytest
import safetensors.torch
import torch
from observer_cases import CASES

import qstats
from qstats import tree


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got, expected):
    tree.assert_same_structure(got, expected)
    for (path, a), (_, b) in zip(tree.leaves_with_paths(got), tree.leaves_with_paths(expected)):
        assert type(a) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bits(a), _bits(b)), path


def _state(case, seed):
    name, factory, make_x = case[:3]
    observer = factory()
    g = torch.Generator().manual_seed(seed)
    state = observer.init(make_x(g))
    return observer.update(state, make_x(g))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_stacked_states_of_every_observer_round_trip(tmp_path, case):
    experts = [_state(case, seed) for seed in range(3)]
    stacked = tree.stack(experts)
    path = tmp_path / "experts.safetensors"
    qstats.save(path, {"experts": stacked, "first": experts[0]})
    loaded = qstats.load(path)
    _assert_bit_exact(loaded, {"experts": stacked, "first": experts[0]})
    assert type(loaded["experts"]) is type(stacked)
    raw = safetensors.torch.load_file(str(path))  # what the file holds, read without qstats
    for field, leaf in zip(stacked._fields, stacked):
        if isinstance(leaf, torch.Tensor):
            assert torch.equal(_bits(raw[f"experts/{field}"]), _bits(leaf)), field
    _assert_bit_exact(tree.unstack(loaded["experts"]), experts)


def test_a_tree_of_odd_leaves_round_trips(tmp_path):
    shared = torch.randn(4, 3)
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    leaves = {
        "shared": [shared, shared, shared[1:3]],  # one tensor at two leaves, and a view into it
        "transposed": base.t(),
        "expanded": torch.tensor(2.5).expand(3, 2),  # stride 0
        "every_other": base[:, ::2],
        "zero_d": (torch.tensor(-0.0), torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(7, dtype=torch.int64),
                   torch.tensor(True), torch.tensor(3.0).to(torch.float8_e4m3fn)),
        "dtypes": [torch.randn(3).to(torch.bfloat16), torch.randn(3, dtype=torch.float64),
                   torch.tensor([1, 65535]).to(torch.uint16), torch.empty(0, 5)],
        "empty": {"dict": {}, "list": [], "tuple": (), "nested": {"inner": {}}},
        "none": None,
        "odd values": torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-45, -0.0]),
    }
    path = tmp_path / "odd.safetensors"
    qstats.save(path, leaves)
    loaded = qstats.load(path)
    _assert_bit_exact(loaded, leaves)
    assert loaded["none"] is None and loaded["empty"] == {"dict": {}, "list": [], "tuple": (), "nested": {"inner": {}}}
    assert isinstance(loaded["zero_d"], tuple) and isinstance(loaded["dtypes"], list)
    # each leaf is its own tensor once loaded (a functional tree: no leaf is written through another)
    assert loaded["shared"][0].data_ptr() != loaded["shared"][1].data_ptr()
    assert torch.equal(loaded["shared"][2], shared[1:3])
