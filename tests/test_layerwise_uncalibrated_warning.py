"""``calibrate_layerwise(propagate="quantized")`` fake-quantizes each layer with its own qparams: it
warned (`UncalibratedWarning`) once per layer that held a site without data, where a full-model
`qstats.calibrate` warns nothing and the user's `compute_qparams_tree` of the whole tree warns once."""

from __future__ import annotations

import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

SPEC = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")
# the v_proj inputs of every layer see only padding: their observation weight is zero throughout
RECIPE = qstats.Recipe([qstats.Rule("re:.*v_proj$", sites=("input",), spec=SPEC),
                        qstats.Rule("Linear", sites=("weight",), spec=SPEC)])  # fmt: skip


def _uncalibrated(run) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [w for w in caught if issubclass(w.category, qstats.UncalibratedWarning)]


def test_quantized_propagation_warns_as_calibrate_does(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 64, (2, 6), generator=generator)} for _ in range(2)]
    nothing = lambda batch: torch.zeros_like(batch["input_ids"])  # noqa: E731
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    full, warned = _uncalibrated(lambda: qstats.calibrate(model, batches, RECIPE, observation_weight=nothing,
                                                          progress=False))
    assert warned == []
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config).eval()
    states, warned = _uncalibrated(lambda: qstats.calibrate_layerwise(
        meta, str(tmp_path), batches, RECIPE, observation_weight=nothing, propagate="quantized", progress=False))
    assert warned == []  # it warned once per layer
    _, warned = _uncalibrated(lambda: qstats.compute_qparams_tree(states, RECIPE, model))
    assert len(warned) == 1 and all(f"layers.{i}.self_attn.v_proj.input" in str(warned[0].message) for i in range(3))
    assert full.keys() == states.keys()
