"""qstats.fake_quantized inside torch.nn.utils.parametrize.cached() (docs/calibrate_api.md's advice for
transformers' eager experts) on a MoE with activation sites: the second forward raised "no per-expert
matmul taking that input was found", the cached stack running no parametrization hook. Now every
forward gives the logits of fake_quantized without the cache (which the oneshot tests tie to
llm-compressor's), with the stack fake-quantized once per layer for all the forwards."""

import pytest
import torch
from torch.nn.utils import parametrize

import qstats

pytest.importorskip("transformers")
from test_moe_families import _model  # noqa: E402


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_cached_forwards_equal_uncached_ones(implementation):
    model = _model("qwen3_moe")
    model.set_experts_implementation(implementation)
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    batches = [torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    states = qstats.calibrate(model, batches, recipe, progress=False, all_experts=True)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with qstats.fake_quantized(model, qparams, recipe), torch.no_grad():
        expected = [model(batch).logits for batch in batches]
        experts = model.model.layers[0].mlp.experts
        computed = []
        experts.parametrizations["gate_up_proj"].register_forward_hook(lambda *_: computed.append(1))
        with parametrize.cached():
            got = [model(batch).logits for batch in batches]
    assert len(computed) == 1  # the stack is fake-quantized once for the three forwards
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
