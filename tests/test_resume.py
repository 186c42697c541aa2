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


def _coremltools_flags(milestones, steps):
    """coremltools' LinearQuantizer as a loop of toggles: prepare() turns observers and fake quantization
    off, and at step count ``m[0]`` observers go on, ``m[1]`` fake quantization on, ``m[2]`` observers
    off, ``m[3]`` batch norm frozen (each an event, in that order, at the start of the step)."""
    observe = fake_quantize = frozen_bn = False
    flags = []
    for step in range(steps):
        observe = True if step == milestones[0] else observe
        fake_quantize = True if step == milestones[1] else fake_quantize
        observe = False if step == milestones[2] else observe
        frozen_bn = True if step == milestones[3] else frozen_bn
        flags.append((observe, fake_quantize, frozen_bn))
    return flags


def test_schedule_follows_coremltools_milestones_and_resumes_mid_schedule():
    """coremltools' own example, milestones [0, 100, 300, 200], freezes batch norm before the ranges:
    from_milestones refused it (freeze_batchnorm_at had to come after freeze_ranges_at). Every
    step's phase equals the toggles above, from step 0 or resumed at any step (int or tensor)."""
    for milestones in ([0, 100, 300, 200], [2, 4, 7, 9], [3, 3, 3, 0], [0, 0, 5, 5], [1, 6, 6, 2]):
        schedule = qstats.QATSchedule.from_milestones(milestones)
        steps = max(milestones) + 3
        expected = _coremltools_flags(milestones, steps)
        for resume_at in (0, milestones[1], milestones[2] - 1 if milestones[2] else 0):
            got = [tuple(schedule(step)) for step in range(resume_at, steps)]
            assert got == expected[resume_at:], (milestones, resume_at)
        tensor_steps = torch.arange(steps)
        as_tensors = schedule(tensor_steps)
        assert [tuple(bool(flag[i]) for flag in as_tensors) for i in range(steps)] == expected
        assert all(flag.shape == tensor_steps.shape for flag in as_tensors)
