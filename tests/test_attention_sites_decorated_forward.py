"""Attention modules whose ``forward`` is wrapped by a decorator (Mllama's vision attention,
``@deprecate_kwarg``) run eager attention behind qstats' q/k/v hooks: the sites' extremes are those
of the key and value the modeling file's eager attention receives (recorded by wrapping it)."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import eager_attention_arguments

transformers = pytest.importorskip("transformers")
from transformers.models.mllama import modeling_mllama  # noqa: E402


class _Tower(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attn = attention

    def forward(self, x):
        return self.attn(x)[0]


def test_decorated_attention_forward_observes_the_eager_attention_arguments():
    torch.manual_seed(0)
    config = transformers.MllamaVisionConfig(hidden_size=32, attention_heads=4, num_hidden_layers=1,
                                             num_global_layers=1, intermediate_size=48)
    config._attn_implementation = "eager"
    model = _Tower(modeling_mllama.MllamaVisionAttention(config)).eval()
    assert hasattr(modeling_mllama.MllamaVisionAttention.forward, "__wrapped__")  # decorated
    batches = [torch.randn(2, 5, 32) for _ in range(2)]
    recipe = qstats.Recipe([qstats.Rule("attn", sites=("k", "v"), observer=qstats.minmax, spec=qstats.QuantSpec("int8"))])
    states = qstats.calibrate(model, batches, recipe, progress=False)

    seen = eager_attention_arguments(model, batches, modeling_mllama)
    for site in ("k", "v"):
        xs = seen["attn", site]
        assert torch.equal(states["attn"][site].min_val, torch.stack([x.amin() for x in xs]).amin()), site
        assert torch.equal(states["attn"][site].max_val, torch.stack([x.amax() for x in xs]).amax()), site
    assert config._attn_implementation == "eager"
