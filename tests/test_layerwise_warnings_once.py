"""`calibrate_layerwise` warns of each fact once, as `qstats.calibrate` does on the loaded model,
naming the modules of every layer: before, the checks that depend on the model and the recipe alone
(a weight stored transposed read ``PerAxis(0)``, a 3-D parameter without an expert count) and the
warning of sites that saw no data ran on each layer's part of the plan, one warning per layer."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402
from _shared import assert_site_states_equal  # noqa: E402

SPEC = qstats.QuantSpec(dtype="int8", mapping="asymmetric")
RECIPE = qstats.Recipe([
    qstats.Rule("Conv1D", sites=("weight",), spec=SPEC.replace(granularity=qstats.PerAxis(0))),
    qstats.Rule("_Stack", sites=("weight",), spec=SPEC),
    qstats.Rule("Linear", sites=("input", "weight"), spec=SPEC),
])  # fmt: skip
FACTS = ("stored transposed", "is observed as one tensor", "saw no data")


class _Stack(torch.nn.Module):  # a 3-D parameter, no expert count
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):
        return x @ self.weight.sum(dim=0)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.conv, self.stack = torch.nn.Linear(8, 8), Conv1D(8, 8), _Stack()
        self.unused = torch.nn.Linear(8, 8)  # never called: its input sees no data

    def forward(self, hidden):
        return self.proj(hidden) + self.conv(hidden) + self.stack(hidden)


class _Model(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(layers))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids):
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


def _saved_model(tmp_path, layers: int) -> tuple:
    """``(loaded, meta, batches)``: a `_Model` saved to ``tmp_path``, its twin on meta and two token batches."""
    loaded = _Model(layers).eval()
    save_file({name: value.contiguous() for name, value in loaded.state_dict().items()},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with torch.device("meta"):
        model = _Model(layers).eval()
    return loaded, model, [torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(seed))
                           for seed in range(2)]


def _warned(run) -> tuple:
    """``run()``'s result and its warnings ``(category, message without the caller)``, of `FACTS`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    found = [(w.category, str(w.message).split(": ", 1)[1]) for w in caught
             if any(fact in str(w.message) for fact in FACTS)]
    return result, found


@pytest.mark.parametrize("layers", [2, 4])
def test_each_fact_is_warned_of_once_naming_every_layer(tmp_path, layers):
    torch.manual_seed(0)
    loaded, model, batches = _saved_model(tmp_path, layers)
    want, expected = _warned(lambda: qstats.calibrate(loaded, batches, RECIPE, progress=False))
    assert [sum(fact in message for _, message in expected) for fact in FACTS] == [1, layers, 1]
    got, warned = _warned(lambda: qstats.calibrate_layerwise(model, str(tmp_path), batches, RECIPE, progress=False))
    assert sorted(warned, key=str) == sorted(expected, key=str)
    assert_site_states_equal(got, want)


def test_experts_without_tokens_are_warned_of_once_naming_every_layer(tmp_path):
    """A Qwen3-MoE of 3 layers, top-1 of 8 experts over 3 tokens: every layer has experts without a
    token. Before: one warning per layer, each naming its layer's experts."""
    from _shared import qwen3_moe_config, saved_loaded_and_meta

    config = qwen3_moe_config(num_experts=8, num_experts_per_tok=1, num_hidden_layers=3)
    loaded, model = saved_loaded_and_meta(tmp_path, config)
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=SPEC)])
    batches = [torch.randint(1, 64, (1, 3), generator=torch.Generator().manual_seed(3))]

    def uncovered(run) -> tuple:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
        return result, [str(w.message) for w in caught if "received no calibration token" in str(w.message)]

    want, expected = uncovered(lambda: qstats.calibrate(loaded, batches, recipe, progress=False))
    assert len(expected) == 1 and all(f"layers.{index}.mlp.experts" in expected[0] for index in range(3))
    got, warned = uncovered(lambda: qstats.calibrate_layerwise(model, str(tmp_path), batches, recipe, progress=False))
    assert warned == expected
    assert_site_states_equal(got, want)


def test_gptq_warns_once_of_the_weights_never_called_in_every_layer(tmp_path):
    """`gptq_layerwise` names the weights without a Hessian (modules never called) once, those of every
    layer: the modules whose inputs `qstats.calibrate` names as sites that saw no data. Before: one
    warning per layer."""
    torch.manual_seed(0)
    loaded, model, batches = _saved_model(tmp_path, 4)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))

    def named(run, fact: str) -> list:  # per warning of ``fact``, the modules it names
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        return [sorted(re.findall(r"(layers\.\d+\.\w+)\.\w+", str(w.message))) for w in caught if fact in str(w.message)]

    inputs = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=SPEC)])
    expected = named(lambda: qstats.calibrate(loaded, batches, inputs, progress=False), "saw no data")
    assert expected == [[f"layers.{index}.unused" for index in range(4)]]
    weights = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    got = named(lambda: qstats.gptq_layerwise(model, str(tmp_path), batches, weights, progress=False),
                "were never called")
    assert got == expected


def test_an_observation_weight_fitting_no_activation_is_warned_of_once_per_batch(tmp_path):
    """A weight of shape (7,) fits no activation of (2, 5) token batches: `qstats.calibrate` warns once per
    batch; before, `calibrate_layerwise` warned once per batch and pass (each layer, then the modules
    outside them: 2 batches, 3 layers, 8 warnings)."""
    torch.manual_seed(0)
    loaded, model, batches = _saved_model(tmp_path, 3)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=SPEC)])
    weight = lambda batch: torch.ones(7)  # noqa: E731

    def unfitted(run) -> tuple:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
        return result, [(w.category, str(w.message).split(": ", 1)[1]) for w in caught if "fits no" in str(w.message)]

    want, expected = unfitted(lambda: qstats.calibrate(loaded, batches, recipe, progress=False,
                                                       observation_weight=weight))
    assert len(expected) == 2
    got, warned = unfitted(lambda: qstats.calibrate_layerwise(model, str(tmp_path), batches, recipe, progress=False,
                                                              observation_weight=weight))
    assert warned == expected
    assert_site_states_equal(got, want)
