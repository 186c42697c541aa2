"""torch.ao's ``FakeQuantize`` modules and the qstats specs that equal them, for the QAT tests that wire
them around a model's layers as the reference of `qstats.qat.prepare`'s rewritten model: quint8 per-tensor
affine activations and qint8 per-channel symmetric weights (axis 0), both with moving-average ranges."""

from __future__ import annotations

import torch
from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver

import qstats

ACT_SPEC = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
W_SPEC = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric, ch_axis=0)


def activation_fake_quant() -> FakeQuantize:
    """torch.ao's fake quantization of ``ACT_SPEC`` with a moving-average range."""
    return FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
                        qscheme=torch.per_tensor_affine)


def weight_fake_quant() -> FakeQuantize:
    """torch.ao's fake quantization of ``W_SPEC`` with moving-average per-channel ranges."""
    return FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)


def train_beside_reference(qat, params: dict, state, reference_forward, reference_parameters: torch.nn.Module,
                           batches, loss, **apply_kwargs) -> tuple:
    """SGD steps (learning rate 0.1) of ``qat.apply`` from ``params`` and of the reference model, whose
    forward is ``reference_forward`` and whose parameters ``reference_parameters`` holds under the names
    ``params`` has, over ``batches`` of ``(x, y)``; every step's gradients of ``loss(out, y)`` are compared
    by name. Returns ``(params, state, [each step's gradients])``."""

    def loss_fn(p, s, x, y):
        out, new_state = qat.apply(p, s, x, **apply_kwargs)
        return loss(out, y), new_state

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    steps = []
    for x, y in batches:
        reference_parameters.zero_grad()
        loss(reference_forward(x), y).backward()
        grads, state = grad_fn(params, state, x, y)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_parameters.get_parameter(name).grad, rtol=1e-5, atol=1e-6,
                                       msg=name)
        steps.append(grads)
        params = {name: p - 0.1 * grads[name] for name, p in params.items()}
        with torch.no_grad():
            for p in reference_parameters.parameters():
                p -= 0.1 * p.grad
    return params, state, steps


def train_beside_prepared(qat, reference: torch.nn.Module, points: dict, others: list, batches, schedule,
                          lr: float, steps: int = 6) -> dict:
    """SGD steps of ``qat.apply`` and of torch.ao's prepared ``reference`` (``prepare_qat_fx``) on ``batches[1:]``
    (``qat.init`` sizes on ``batches[0]``) through ``schedule``'s phases, torch.ao's fake quants in ``others``
    (which qstats has not: outputs) kept off. Outputs and gradients are compared every step, and at the end the
    ranges of every point ``{"kind.key": FakeQuantize}`` with its qstats state. Returns qstats' parameters."""
    state = qat.init(batches[0])
    params = {name: value.detach().clone() for name, value in qat.params().items()}
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)

    def loss_fn(p, s, x):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return out.pow(2).sum(), (out, new_state)

    for step in range(steps):
        x, phase = batches[step + 1], schedule(step)
        for fq in reference.modules():
            if isinstance(fq, FakeQuantize):
                fq.enable_observer(phase.observe and fq not in others)
                fq.enable_fake_quant(phase.fake_quantize and fq not in others)
        optimizer.zero_grad()
        expected = reference(x)
        expected.pow(2).sum().backward()
        grads, (out, state) = torch.func.grad(loss_fn, has_aux=True)(params, state, x)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
        assert set(grads) == {name for name, _ in reference.named_parameters()}
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-5,
                                       msg=f"step {step}: {name}")
        optimizer.step()
        params = {name: value - lr * grads[name] for name, value in params.items()}
    for point, fq in points.items():
        kind, key = point.split(".", 1)
        ranges, observer = getattr(state, kind)[key], fq.activation_post_process
        torch.testing.assert_close(ranges.min_val, observer.min_val, rtol=1e-6, atol=1e-7, msg=point)
        torch.testing.assert_close(ranges.max_val, observer.max_val, rtol=1e-6, atol=1e-7, msg=point)
    return params
