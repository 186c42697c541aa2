"""A model inside `qstats.fake_quantized` with q/k/v sites on transformers attention modules compiles
as one graph (``fullgraph=True``) and computes what it computes eagerly."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_fake_quantized_attention_sites_compile_in_one_graph(implementation):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      attn_implementation=implementation)
    model = transformers.Qwen3ForCausalLM(config).eval()
    recipe = qstats.Recipe([qstats.Rule("re:.*self_attn", sites=("q", "k", "v"), observer=qstats.minmax,
                                        spec=qstats.QuantSpec("int8"))])
    batches = [torch.randint(0, 64, (2, 7)) for _ in range(2)]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    with torch.no_grad():
        float_logits = model(batches[0]).logits
        with qstats.fake_quantized(model, qparams, recipe):
            eager_logits = model(batches[0]).logits
            compiled_logits = torch.compile(model, fullgraph=True, backend="eager")(batches[0]).logits
    assert not torch.equal(eager_logits, float_logits)  # the sites are quantized
    assert torch.equal(compiled_logits, eager_logits)
    assert model.config._attn_implementation == implementation
