"""QAT with per-token activation ranges (torchao's Int8DynActInt4Weight style): dynamic, each batch's
own, over batches of any shape, as torchao's per-token ``IntxFakeQuantizer`` (qstats' state was sized
on the first batch: a batch of another shape raised, and frozen phases kept one batch's ranges)."""

import warnings
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, PerChannelMinMaxObserver

import qstats
from _shared import exit_rank, fork_ranks, gloo_group

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization.granularity import PerToken
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
    from torchao.quantization.quant_primitives import MappingType

TOKEN_CONFIG = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
TOKEN_SPEC = qstats.QuantSpec.from_torchao(
    torch.int8, mapping_type=MappingType.ASYMMETRIC, granularity=PerToken(), eps=TOKEN_CONFIG.eps,
    scale_dtype=TOKEN_CONFIG.scale_precision, zero_point_dtype=TOKEN_CONFIG.zero_point_precision)
WEIGHT_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, quant_min=-128, quant_max=127)


def _mlp():
    return nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))


class _Reference(nn.Module):
    """torchao's per-token fake quantizer on each Linear's input, torch.ao's per-channel FakeQuantize
    on its weight."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp
        self.tokens = [IntxFakeQuantizer(TOKEN_CONFIG) for _ in range(2)]
        self.weights = nn.ModuleList(FakeQuantize(observer=PerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                                  dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
                                     for _ in range(2))

    def toggle(self, phase):
        for tokens, weights in zip(self.tokens, self.weights):
            tokens.enabled = phase.fake_quantize
            weights.enable_observer(phase.observe)
            weights.enable_fake_quant(phase.fake_quantize)

    def forward(self, x):
        first, second = self.mlp[0], self.mlp[2]
        h = F.relu(F.linear(self.tokens[0](x), self.weights[0](first.weight), first.bias))
        return F.linear(self.tokens[1](h), self.weights[1](second.weight), second.bias)


def test_per_token_activations_over_batches_of_other_shapes_train_as_torchao():
    torch.manual_seed(0)
    model, reference = _mlp(), _Reference(_mlp())
    reference.mlp.load_state_dict(model.state_dict())
    qat = qstats.qat.prepare(model, qstats.minmax(WEIGHT_SPEC), qstats.memoryless_minmax(TOKEN_SPEC))
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    state = qat.init(torch.zeros(2, 3, 16))
    schedule = qstats.QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=3)

    def loss_fn(p, s, x, y, phase):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return F.mse_loss(out, y), new_state

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    g = torch.Generator().manual_seed(1)
    for step, shape in enumerate([(2, 3), (4, 5), (1, 7), (3, 2), (2, 9)]):
        x, y = torch.randn(*shape, 16, generator=g) * 2, torch.randn(*shape, 4, generator=g)
        phase = schedule(step)
        reference.toggle(phase)
        reference.zero_grad()
        expected = reference(x)
        F.mse_loss(expected, y).backward()
        grads, state = grad_fn(params, state, x, y, phase)
        assert tuple(state.activations["0"].min_val.shape) == shape  # the batch's own tokens
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.mlp.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            out, _ = qat.apply(params, state, x, phase=phase)
            torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-6)
            for p in reference.mlp.parameters():
                p -= 0.1 * p.grad
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}


def _sync_batches_of_other_shapes(rank, port):
    """One rank: a batch of its own shape, then qat.sync; exit code 0 when each keeps its own tokens."""
    try:
        with gloo_group(rank, port, timeout=timedelta(seconds=30)):
            torch.manual_seed(0)
            qat = qstats.qat.prepare(_mlp(), qstats.minmax(WEIGHT_SPEC), qstats.memoryless_minmax(TOKEN_SPEC))
            x = torch.randn((2, 3, 16) if rank == 0 else (1, 5, 16))
            _, state = qat.apply(qat.params(), qat.init(x), x, phase=qstats.QATPhase())
            synced = qat.sync(state, weights=True)
            same = all(torch.equal(synced.activations[key].min_val, state.activations[key].min_val)
                       for key in state.activations)
            torch.distributed.barrier()
        exit_rank(0 if same else 3)
    except Exception as error:  # the rank's error, for the test's message
        print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
        exit_rank(1)


def test_sync_leaves_each_ranks_per_token_ranges_on_batches_of_other_shapes():
    # per-token ranges are the rank's own batch's: nothing to merge (merging states of 6 and 5 tokens raised)
    assert fork_ranks(_sync_batches_of_other_shapes) == [0, 0]
