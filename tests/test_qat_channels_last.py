"""QAT of a channels_last model (``model.to(memory_format=torch.channels_last)``, channels_last batches): torch's
fake-quant ops keep a tensor's memory layout, so torch.ao's QAT convolutions run in channels_last. qstats'
fake-quant points give their output in their input's layout too (before: contiguous, so the convolutions ran in the
other layout and their gradients rounded otherwise than torch.ao's). Reference: torch.ao's ``prepare_qat_fx``
with ``FakeQuantize`` modules of the same specs, trained step by step (outputs and gradients bit for bit)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.ao.quantization import (FakeQuantize, MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver,
                                   QConfig, QConfigMapping)
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, activation_fake_quant, weight_fake_quant

CL = torch.channels_last


class _Convs(nn.Module):
    """A grouped convolution, a depthwise one without bias and a Linear without bias over the last dimension
    (no op between them that torch.ao would give an observer shared with its input)."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv2d(4, 8, 3, groups=2, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, groups=8, bias=False)
        self.head = nn.Linear(5, 3, bias=False)

    def forward(self, x):
        return self.head(self.depthwise(self.grouped(x)))


def _qat(model):
    return qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                              qstats.moving_average_minmax(ACT_SPEC, 0.01))


def test_channels_last_convolutions_train_bit_for_bit_as_torch_ao_prepare_qat_fx():
    torch.manual_seed(0)
    model = _Convs().to(memory_format=CL)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(3, 4, 7, 7, generator=g) * (1 + step / 3)).to(memory_format=CL) for step in range(7)]
    qconfig = QConfig(  # _qat_torch_ao_reference's fake quants, of ACT_SPEC and W_SPEC
        activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                          dtype=torch.quint8, qscheme=torch.per_tensor_affine),
        weight=FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                      dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0))
    reference = prepare_qat_fx(copy.deepcopy(model).train(), QConfigMapping().set_global(qconfig), (batches[0],))
    outputs = [m for name, m in reference.named_modules() if isinstance(m, FakeQuantize) and "." not in name][-1:]
    qat = _qat(model)
    state = qat.init(batches[0])
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    schedule = qstats.QATSchedule(observe_at=0, fake_quantize_at=1, freeze_ranges_at=4)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)

    def loss_fn(p, s, x, phase):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return out.pow(2).sum(), (out, new_state)

    for step, x in enumerate(batches[1:]):
        phase = schedule(step)
        for fq in reference.modules():
            if isinstance(fq, FakeQuantize):  # the model output's fake quant, which qstats has not, stays off
                fq.enable_observer(phase.observe and fq not in outputs)
                fq.enable_fake_quant(phase.fake_quantize and fq not in outputs)
        optimizer.zero_grad()
        expected = reference(x)
        expected.pow(2).sum().backward()
        grads, (out, state) = torch.func.grad(loss_fn, has_aux=True)(params, state, x, phase)
        assert torch.equal(out, expected.detach()), step
        for name, grad in grads.items():  # before: the grouped convolution's weight 1.4e-6 apart at step 1
            assert torch.equal(grad, reference.get_parameter(name).grad), (step, name)
        optimizer.step()
        params = {name: value - 0.05 * grads[name] for name, value in params.items()}


def test_fake_quant_points_keep_a_channels_last_layout_as_torch_ao_fake_quantize():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5).to(memory_format=CL)
    w = torch.randn(8, 4, 3, 3).to(memory_format=CL)
    for value, spec, reference in ((x, ACT_SPEC, activation_fake_quant()), (w, W_SPEC, weight_fake_quant())):
        observer = qstats.moving_average_minmax(spec, 0.01)
        ours, _ = qstats.observe_fake_quantize(value, observer.init(value), observer)
        expected = reference(value)
        assert expected.is_contiguous(memory_format=CL) and ours.stride() == expected.stride()
        assert torch.equal(ours, expected)
    # a convolution of a channels_last model gives a channels_last output, as torch.ao's QAT Conv2d
    model = nn.Sequential(nn.Conv2d(4, 6, 3)).to(memory_format=CL)
    qat = _qat(model)
    out, _ = qat.apply(qat.params(), qat.init(x), x)
    assert out.is_contiguous(memory_format=CL)


def test_channels_last_step_compiled_and_vmapped_equals_eager():
    torch.manual_seed(0)
    model = _Convs().to(memory_format=CL)
    qat = _qat(model)
    x = torch.randn(4, 4, 7, 7).to(memory_format=CL)
    state = qat.init(x)
    params = {name: p.detach().clone() for name, p in qat.params().items()}

    def loss_fn(p, s, x):
        out, new_state = qat.apply(p, s, x)
        return out.pow(2).sum(), new_state

    step = torch.func.grad(loss_fn, has_aux=True)
    grads, new_state = step(params, state, x)
    compiled_grads, compiled_state = torch.compile(step, fullgraph=True)(params, state, x)
    for name in grads:
        torch.testing.assert_close(compiled_grads[name], grads[name], rtol=1e-5, atol=1e-6)
    assert torch.equal(compiled_state.activations["grouped"].max_val, new_state.activations["grouped"].max_val)
    # per-sample gradients: each sample's own step (the layout of a vmapped sample is vmap's)
    per_sample, _ = torch.func.vmap(step, in_dims=(None, None, 0))(params, state, x[:, None])
    for i in range(2):
        alone, _ = step(params, state, x[i:i + 1])
        for name in alone:
            torch.testing.assert_close(per_sample[name][i], alone[name], rtol=1e-5, atol=1e-5)
