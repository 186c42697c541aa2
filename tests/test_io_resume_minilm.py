"""Stopping calibration of all-MiniLM-L6-v2 halfway, saving with qstats.save and resuming from
qstats.load equals calibrating every batch at once, bit for bit, for minmax, histogram, mse,
imatrix and hessian (one observer per Linear of the first layer on its padded inputs, minmax on the
weights), and so do the quantization parameters and the GPTQ weights computed from them.
"""

from __future__ import annotations

import os
import sys
import warnings

import optree
import pytest
import torch

import qstats

sys.path.insert(0, os.path.dirname(__file__))
from _shared import MINILM_SENTENCES, minilm  # noqa: E402

LAYER = "encoder.layer.0"
OBSERVERS = {  # module of the first layer -> its observer (weights and inputs)
    f"{LAYER}.attention.self.query": qstats.minmax,
    f"{LAYER}.attention.self.key": qstats.histogram,
    f"{LAYER}.attention.self.value": qstats.mse,
    f"{LAYER}.attention.output.dense": qstats.imatrix,
    f"{LAYER}.intermediate.dense": qstats.hessian,
}
SPEC = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))


def _recipe() -> qstats.Recipe:
    weights = qstats.Rule(targets=list(OBSERVERS), sites=("weight",), observer=qstats.minmax, spec=SPEC)
    return qstats.Recipe([weights] + [qstats.Rule(targets=path, sites=("input",), observer=observer, spec=qstats.QuantSpec())
                                      for path, observer in OBSERVERS.items()])


def _calibrate(model, batches, states=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a weight that fits no 2-D weight site: nothing to leave out
        return qstats.calibrate(model, batches, _recipe(), states=states, progress=False,
                                observation_weight=lambda batch: batch["attention_mask"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _assert_bit_equal(got, want):
    got_leaves, got_spec = optree.tree_flatten(got)
    want_leaves, want_spec = optree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model, tokenizer = minilm()
    batches = [dict(tokenizer(list(MINILM_SENTENCES[i:i + 2]), padding=True, return_tensors="pt")) for i in (0, 2)]
    whole = _calibrate(model, batches)
    first = _calibrate(model, batches[:1])
    path = tmp_path_factory.mktemp("resume") / "first_half.safetensors"
    qstats.save(path, first)
    resumed = _calibrate(model, batches[1:], states=qstats.load(path))
    return model, first, whole, resumed


def test_resumed_states_are_bit_equal_to_one_calibration(calibrated):
    _, first, whole, resumed = calibrated
    assert sorted(whole) == sorted(OBSERVERS)
    for path, observer in OBSERVERS.items():
        state_type = type(whole[path]["input"])
        assert type(resumed[path]["input"]) is state_type, (path, observer.__name__)
        # the second half changed every input state: the comparison below could fail
        assert any(not torch.equal(a, b) for a, b in zip(first[path]["input"], whole[path]["input"])), path
    _assert_bit_equal(resumed, whole)


def test_qparams_and_gptq_weights_of_the_resumed_states_are_equal(calibrated):
    model, _, whole, resumed = calibrated
    def ranged(states):  # imatrix and hessian states have no range of their own
        return {path: {site: state for site, state in sites.items()
                       if not isinstance(state, (qstats.IMatrixState, qstats.HessianState))}
                for path, sites in states.items()}

    want = qstats.compute_qparams_tree(ranged(whole), _recipe(), model)
    assert sum(len(sites) for sites in want.values()) == len(OBSERVERS) + 3  # every weight, 3 inputs
    _assert_bit_equal(qstats.compute_qparams_tree(ranged(resumed), _recipe(), model), want)
    hessian_path = f"{LAYER}.intermediate.dense"
    weight = model.get_submodule(hessian_path).weight.detach()
    weight_qparams = qstats.compute_qparams(whole[hessian_path]["weight"], SPEC)
    one_go = qstats.gptq(weight, whole[hessian_path]["input"], SPEC, qparams=weight_qparams)
    again = qstats.gptq(weight, resumed[hessian_path]["input"], SPEC, qparams=weight_qparams)
    _assert_bit_equal(again, one_go)
