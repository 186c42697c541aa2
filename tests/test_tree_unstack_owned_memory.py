"""``qstats.tree.unstack`` gives trees whose tensors own their memory, as the trees given to
``qstats.tree.stack`` did: ``torch.save`` of one unstacked state writes that state's data, as
``torch.save`` of the state it was stacked from does, not every layer's."""

from __future__ import annotations

import io

import optree
import torch

import qstats


def _saved_bytes(tree) -> int:
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return len(buffer.getvalue())


def test_torch_save_of_an_unstacked_state_writes_what_the_original_state_writes():
    obs = qstats.histogram(qstats.QuantSpec(granularity=qstats.PerAxis(0)), buckets_per_octave=8, octaves=8)
    layers = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    states = [obs.update(obs.init(w), w) for w in layers]
    unstacked = qstats.tree.unstack(qstats.tree.stack(states))
    for state, again in zip(states, unstacked):
        assert all(torch.equal(a, b) for a, b in zip(state, again))
        assert _saved_bytes(again) == _saved_bytes(state)
        for leaf in optree.tree_leaves(again):
            assert leaf.untyped_storage().nbytes() == leaf.nbytes


def test_unstacked_pieces_keep_autograd_history():
    scale = torch.ones(4, 3, requires_grad=True)
    pieces = qstats.tree.unstack({"scale": scale * 2})
    sum(piece["scale"].sum() for piece in pieces).backward()
    assert torch.equal(scale.grad, torch.full((4, 3), 2.0))
