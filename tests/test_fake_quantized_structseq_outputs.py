"""A module returning torch's named tuples (``torch.return_types``: ``max(dim)``, ``topk``, ``sort``),
whose caller reads ``.values``: inside `qstats.fake_quantized` its output site keeps that type, and the
model computes what torch's own ``fake_quantize_per_tensor_affine`` of the values gives."""

from __future__ import annotations

import pytest
import torch

import qstats


class TokenMax(torch.nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(x)


class Pooled(torch.nn.Module):
    def __init__(self, reduce, kept: int):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.pool = TokenMax(reduce)
        self.head = torch.nn.Linear(32 * kept, 4)

    def forward(self, x):
        pooled = self.pool(self.proj(x))
        return self.head(pooled.values.flatten(1))


REDUCTIONS = {  # name: (reduction over the 5 tokens, tokens it keeps)
    "max": (lambda x: x.max(dim=1), 1),
    "topk": (lambda x: x.topk(2, dim=1), 2),
    "sort": (lambda x: x.sort(dim=1), 5),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_return_types_output_site_keeps_its_type_and_equals_torch(name):
    # fake_quantized gave back a plain tuple: the caller's ``.values`` raised AttributeError
    torch.manual_seed(0)
    reduce, kept = REDUCTIONS[name]
    model = Pooled(reduce, kept).eval()
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8)
    recipe = qstats.Recipe([qstats.Rule("TokenMax", sites=("output",), spec=spec)])
    batches = [torch.randn(3, 5, 32) for _ in range(2)]
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, batches, recipe, progress=False), recipe, model)
    scale, zero_point = qparams["pool"]["output"].scale, qparams["pool"]["output"].zero_point

    x = batches[0]
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, recipe):
            out = model(x)
        values = reduce(model.proj(x)).values
        expected = model.head(torch.fake_quantize_per_tensor_affine(
            values, float(scale), int(zero_point), 0, 255).flatten(1))
    assert torch.equal(out, expected)
