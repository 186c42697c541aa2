"""An observation weight (padding mask ``[batch, tokens]``) on activations observed per channel by an
axis counted from the start (torch.ao's ``ch_axis=2`` of ``[batch, tokens, hidden]``): the padding
rows are left out exactly, as torch.ao's per-channel observer over the kept rows computes."""

from __future__ import annotations

import torch

import qstats


def test_positive_channel_axis_with_padding_mask_equals_torch_ao_over_kept_rows():
    # calibrate used to raise "PerAxis(axis=2) is out of range for a tensor of shape (8, 32)": on CPU
    # the kept rows were selected (flattened to 2-D) before checking the axis still existed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    batches = [torch.randn(2, 5, 32) for _ in range(3)]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_channel_affine, ch_axis=2)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)])
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda batch: mask)
    qparams = qstats.compute_qparams_tree(states, recipe, model)

    reference = torch.ao.quantization.PerChannelMinMaxObserver(
        ch_axis=1, dtype=torch.quint8, qscheme=torch.per_channel_affine)
    for x in batches:  # the first Linear's input, its padding rows left out
        reference(x[mask != 0])
    scale, zero_point = reference.calculate_qparams()
    assert torch.equal(states["0"]["input"].min_val, reference.min_val)
    assert torch.equal(states["0"]["input"].max_val, reference.max_val)
    assert torch.equal(qparams["0"]["input"].scale.reshape(scale.shape), scale)
    assert torch.equal(qparams["0"]["input"].zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)


class _Heads(torch.nn.Module):
    """A Linear's input of shape [batch, tokens, heads, head_dim], 8 heads of 8: each head scaled apart."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 64)
        self.out = torch.nn.Linear(8, 8)

    def heads(self, x):
        return self.proj(x).unflatten(-1, (8, 8)) * torch.arange(1.0, 9.0)[:, None]

    def forward(self, x):
        return self.out(self.heads(x))


def test_per_head_axis_with_padding_mask_equals_torch_ao_when_heads_equal_head_dim():
    # the kept rows were selected as [rows, heads, head_dim], where PerAxis(2) names head_dim: with as
    # many heads as head_dim the shapes agreed and each head's range was silently one of head_dim's
    torch.manual_seed(0)
    model = _Heads().eval()
    batches = [torch.randn(2, 5, 32) for _ in range(3)]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_channel_affine, ch_axis=2)
    recipe = qstats.Recipe([qstats.Rule("out", sites=("input",), spec=spec)])
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda batch: mask)

    reference = torch.ao.quantization.PerChannelMinMaxObserver(
        ch_axis=1, dtype=torch.quint8, qscheme=torch.per_channel_affine)
    with torch.no_grad():
        for x in batches:
            reference(model.heads(x)[mask != 0])  # [kept tokens, heads, head_dim]
    assert torch.equal(states["out"]["input"].min_val, reference.min_val)
    assert torch.equal(states["out"]["input"].max_val, reference.max_val)
