"""Stopping and resuming calibration through a qstats.save file changes nothing.

Calibrating all batches in one go must equal, bit for bit, calibrating the first half, saving with
`qstats.save`, and calibrating the second half in a NEW Python process from `qstats.load`
(tests/_resume_worker.py). The recipe mixes an exact observer (minmax), an order-dependent one
(moving average: resuming continues the same sequence of updates, so it is bit-identical too) and
a histogram, with padded batches masked through ``observation_weight``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import optree
import torch

import qstats

sys.path.insert(0, os.path.dirname(__file__))
import _resume_worker as worker  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_resume_worker.py")


def _is_state(x):
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _assert_bit_identical(got, want):
    got_paths, got_states, got_spec = optree.tree_flatten_with_path(got, is_leaf=_is_state)
    want_paths, want_states, want_spec = optree.tree_flatten_with_path(want, is_leaf=_is_state)
    assert got_spec == want_spec, (got_spec, want_spec)
    for path, a, b in zip(got_paths, got_states, want_states):
        assert type(a) is type(b), path
        for field, u, v in zip(a._fields, a, b):
            assert u.dtype == v.dtype and u.shape == v.shape, (path, field)
            if u.is_floating_point():
                u, v = u.view(torch.int32), v.view(torch.int32)
            assert torch.equal(u, v), f"{path} {field} differs after resume"


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    batches = worker.make_batches()
    half = worker.NUM_BATCHES // 2
    one_go = worker.calibrate(batches)

    first = worker.calibrate(batches[:half])
    qstats.save(tmp_path / "half.safetensors", first)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, WORKER, str(tmp_path / "half.safetensors"), str(tmp_path / "resumed.safetensors")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = qstats.load(tmp_path / "resumed.safetensors")

    assert sorted(resumed) == ["fc1", "fc2", "fc3"]
    assert sorted(resumed["fc1"]) == ["input", "weight"]
    _assert_bit_identical(resumed, one_go)
    # the halves really differ from the whole (the test could fail)
    assert not torch.equal(first["fc2"]["input"].max_val, one_go["fc2"]["input"].max_val)
    assert not torch.equal(first["fc3"]["input"].counts, one_go["fc3"]["input"].counts)
    # and so do the quantization parameters
    recipe, model = worker.make_recipe(), worker.make_model()
    want = qstats.compute_qparams_tree(one_go, recipe, model)
    got = qstats.compute_qparams_tree(resumed, recipe, model)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        assert torch.equal(a, b)


def test_padding_is_not_observed():
    """An independent check of the one-go result: fc1's input range is that of the unpadded tokens."""
    batches = worker.make_batches()
    states = worker.calibrate(batches)
    x = torch.cat([b["x"][b["mask"] != 0] for b in batches])
    assert torch.equal(states["fc1"]["input"].min_val, x.amin())
    assert torch.equal(states["fc1"]["input"].max_val, x.amax())
