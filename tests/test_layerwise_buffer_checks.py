"""qstats.calibrate_layerwise checks the checkpoint's buffers as its parameters: before any batch runs.

A plain ``nn.Module`` (no transformers ``_init_weights`` to recompute a buffer) whose checkpoint lacks a
persistent buffer of its last layer, holds it in another shape, or as integers for a float buffer, is
refused naming the tensor before the first batch is drawn, as for a parameter; the buffers were read (and
the error found) only when their layer was, after every batch had run through the earlier layers.
The reference is torch's own ``load_state_dict`` of the same file into the loaded model, which refuses
the same missing or misshapen tensor (integers it casts: those are refused as for a parameter, a
quantized checkpoint); a good checkpoint calibrates as `qstats.calibrate` of that loaded model.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import qstats

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=qstats.QuantSpec(dtype="int8"))])


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("gain", torch.full((8,), 0.5))

    def forward(self, hidden):
        return hidden + self.linear(hidden) * self.gain


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, ids):
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def _saved(folder, change) -> dict:
    torch.manual_seed(0)
    tensors = change({name: value.clone() for name, value in _Net().state_dict().items()})
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return load_file(os.path.join(folder, "model.safetensors"))


def _batches(drawn: list):
    generator = torch.Generator().manual_seed(1)
    for index in range(2):
        drawn.append(index)
        yield torch.randint(0, 16, (2, 5), generator=generator)


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return _Net().eval()


CHANGES = {
    "missing": (lambda tensors: {name: value for name, value in tensors.items() if name != "layers.2.gain"},
                "has no tensor 'layers.2.gain'"),
    "shape": (lambda tensors: {**tensors, "layers.2.gain": torch.ones(7)}, r"'layers.2.gain' has shape \(7,\)"),
    "dtype": (lambda tensors: {**tensors, "layers.2.gain": torch.ones(8, dtype=torch.int8)},
              "'layers.2.gain' is stored as torch.int8"),
}


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_a_bad_buffer_of_the_last_layer_is_refused_before_any_batch_runs(tmp_path, how):
    change, message = CHANGES[how]
    stored = _saved(str(tmp_path), change)
    if how != "dtype":  # torch refuses the same tensor (it casts integers into a float buffer)
        with pytest.raises(RuntimeError, match="layers.2.gain"):
            _Net().load_state_dict(stored)
    drawn: list = []
    with pytest.raises(ValueError, match=message):
        qstats.calibrate_layerwise(_meta(), str(tmp_path), _batches(drawn), RECIPE, progress=False)
    assert drawn == []


def test_a_checkpoint_holding_its_buffers_calibrates_as_the_loaded_model(tmp_path):
    loaded = _Net().eval()
    loaded.load_state_dict(_saved(str(tmp_path), lambda tensors: tensors))
    states = qstats.calibrate_layerwise(_meta(), str(tmp_path), list(_batches([])), RECIPE, progress=False)
    full = qstats.calibrate(loaded, list(_batches([])), RECIPE, progress=False)
    assert set(states) == set(full)
    assert all(torch.equal(a, b) for path in full for a, b in zip(full[path]["input"], states[path]["input"]))


class _Scaled(torch.nn.Module):
    """A layer scaling by a non-persistent buffer (as a rotary embedding's frequencies): no state dict
    holds it, so no checkpoint does, and built on the meta device it has no values."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)

    def forward(self, hidden):
        return hidden + self.linear(hidden) * self.scale


def _scaled_net() -> torch.nn.Module:
    net = _Net()
    net.layers = torch.nn.ModuleList([_Scaled() for _ in range(3)])
    return net


def test_a_non_persistent_buffer_is_named_as_such_and_calibrates_once_set(tmp_path):
    torch.manual_seed(0)
    loaded = _scaled_net().eval()
    assert "layers.0.scale" not in loaded.state_dict()  # torch saves no non-persistent buffer
    save_file(loaded.state_dict(), os.path.join(tmp_path, "model.safetensors"))
    # moved to meta rather than built under torch.device("meta"): where this process first entered a device
    # context inside transformers' meta_device_safe_creation_ops (a transformers model built on meta by an
    # earlier test), torch cached its list of constructors with transformers' linspace, so torch.linspace
    # there ignores the context and this buffer came out on the CPU
    model = _scaled_net().to("meta").eval()
    drawn: list = []
    with pytest.raises(ValueError, match="'layers.0.scale' is a non-persistent buffer"):
        qstats.calibrate_layerwise(model, str(tmp_path), _batches(drawn), RECIPE, progress=False)
    assert drawn == []
    for layer in model.layers:  # what the message says to do: give it its values before the call
        layer.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)
    states = qstats.calibrate_layerwise(model, str(tmp_path), list(_batches([])), RECIPE, progress=False)
    full = qstats.calibrate(loaded, list(_batches([])), RECIPE, progress=False)
    assert set(states) == set(full)
    assert all(torch.equal(a, b) for path in full for a, b in zip(full[path]["input"], states[path]["input"]))
