"""A 0-d observation weight (one per batch: 1 keeps the batch, 0 leaves it out) on activations
observed per token position (PerAxis(1) of [batch, tokens, hidden], batch size equal to the token
count): the kept batches' statistics equal torch.ao's per-channel observer over them."""

from __future__ import annotations

import torch

import qstats


def test_a_per_batch_weight_leaves_whole_batches_out_as_torch_ao_observes_the_others():
    # on CPU, x[weight != 0] with a 0-d weight gave [1, B, T, H]: PerAxis(1) then named the batch rows,
    # and with B == T the shapes agreed, so each token position silently got a batch row's range
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    batches = [torch.randn(4, 4, 32) * torch.arange(1.0, 5.0)[:, None, None] for _ in range(3)]
    keep = [torch.tensor(1), torch.tensor(0), torch.tensor(1)]
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_channel_affine, ch_axis=1)
    recipe = qstats.Recipe([qstats.Rule("0", sites=("input",), spec=spec)])
    weights = iter(keep)
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda batch: next(weights))

    reference = torch.ao.quantization.PerChannelMinMaxObserver(
        ch_axis=1, dtype=torch.quint8, qscheme=torch.per_channel_affine)
    for x, kept in zip(batches, keep):
        if kept:
            reference(x)
    assert torch.equal(states["0"]["input"].min_val, reference.min_val)
    assert torch.equal(states["0"]["input"].max_val, reference.max_val)
