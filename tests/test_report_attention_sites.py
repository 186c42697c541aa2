"""`qstats.report` measures the q/k/v sites of transformers attention modules on the tensors
`calibrate` observes there: the query, key and value the attention function receives (after the
rotary embedding and q/k norms), here recorded by wrapping the modeling file's eager attention."""

from __future__ import annotations

import math

import pytest
import torch

import qstats
from _shared import eager_attention_arguments

transformers = pytest.importorskip("transformers")


def _model():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      attn_implementation="eager")
    return transformers.Qwen3ForCausalLM(config).eval()


def test_report_sqnr_of_q_k_v_is_measured_after_rotary_and_norms():
    model = _model()
    spec = qstats.QuantSpec("int8")
    recipe = qstats.Recipe([qstats.Rule("re:.*self_attn", sites=("q", "k", "v"), observer=qstats.minmax, spec=spec)])
    batches = [torch.randint(0, 64, (2, 7)) for _ in range(3)]
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    rows = {(row.module, row.site): row for row in qstats.report(states, qparams, model, recipe, batches).rows}
    seen = eager_attention_arguments(model, batches)
    assert sorted(seen) == sorted(rows)
    for (path, site), xs in seen.items():
        scale = float(qparams[path][site].scale)
        signal = noise = 0.0
        for x in xs:  # torch's own fake quantization, int8 symmetric per tensor
            fq = torch.fake_quantize_per_tensor_affine(x, scale, 0, -128, 127)
            signal += float(x.pow(2).sum())
            noise += float((x - fq).pow(2).sum())
        assert rows[path, site].sqnr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-4), (path, site)
    assert model.config._attn_implementation == "eager"
