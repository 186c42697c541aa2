"""A CNN through torch.ao's ``prepare_qat_fx``, which fuses Conv-BN-ReLU into ``ConvBnReLU2d`` (a depthwise one too) and
fake-quantizes the folded weight, beside `qstats.qat.prepare(..., fold_batchnorm=True)`: outputs, gradients, batch-norm
running statistics and ranges over SGD steps through observe, fake-quantize and frozen phases (docs/qat.md). Where each
of torch.ao's fake quants feeds one layer they agree; its output fake quants feeding no layer are switched off."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantize, QConfigMapping
from torch.ao.quantization.quantize_fx import prepare_qat_fx

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC
from test_qat_functional_parameters import LR, QCONFIG, SCHEDULE


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        # without bias before batch norm: its gradient is analytically 0, rounding noise that SGD moves it by
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)  # depthwise
        self.c3 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c3(F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x)))))))


def test_fused_conv_bn_relu_cnn_trains_as_prepare_qat_fx():
    torch.manual_seed(0)
    model = _Net().train()
    batches = [torch.randn(4, 3, 8, 8) * (1 + i % 3) for i in range(7)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = prepare_qat_fx(copy.deepcopy(model), QConfigMapping().set_global(QCONFIG), (batches[0],))
    assert [type(reference.get_submodule(name)).__name__ for name in ("c1", "c2")] == ["ConvBnReLU2d"] * 2
    inputs = {}  # layer -> torch.ao's fake quant of its input; the output's feeds no layer
    for node in reference.graph.nodes:
        if node.op == "call_module" and isinstance(reference.get_submodule(node.target), FakeQuantize):
            (user,) = node.users
            if user.op == "call_module":
                inputs[user.target] = reference.get_submodule(node.target)
    output_fake_quant = next(m for m in reference.modules() if isinstance(m, FakeQuantize) and m not in inputs.values()
                             and not any(m is layer.weight_fake_quant for layer in reference.modules()
                                         if hasattr(layer, "weight_fake_quant")))
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01), fold_batchnorm=True)
    assert qat.folded_layers == {"c1": "b1", "c2": "b2"} and sorted(inputs) == ["c1", "c2", "c3"]
    ours = {"c1.bn.weight": "b1.weight", "c1.bn.bias": "b1.bias", "c2.bn.weight": "b2.weight", "c2.bn.bias": "b2.bias"}
    state = qat.init(batches[0])
    params = {name: value.detach().clone() for name, value in qat.params().items()}
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)

    def loss_fn(p, s, x, phase):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return out.pow(2).mean(), (out, new_state)

    for step in range(6):
        x, phase = batches[step + 1], SCHEDULE(step)
        for fq in reference.modules():
            if isinstance(fq, FakeQuantize):
                fq.enable_observer(phase.observe and fq is not output_fake_quant)
                fq.enable_fake_quant(phase.fake_quantize and fq is not output_fake_quant)
        optimizer.zero_grad()
        expected = reference(x)
        expected.pow(2).mean().backward()
        grads, (out, state) = torch.func.grad(loss_fn, has_aux=True)(params, state, x, phase)
        torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-5, msg=f"step {step}")
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[ours.get(name, name)], p.grad, rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
        optimizer.step()
        params = {name: value - LR * grads[name] for name, value in params.items()}
    for key, norm in (("b1", reference.c1.bn), ("b2", reference.c2.bn)):
        torch.testing.assert_close(state.batchnorm[key].running_mean, norm.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.batchnorm[key].running_var, norm.running_var, rtol=1e-5, atol=1e-6)
    for key, fq in inputs.items():
        for field in ("min_val", "max_val"):
            torch.testing.assert_close(getattr(state.activations[key], field),
                                       getattr(fq.activation_post_process, field), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(getattr(state.weights[key], field),
                                       getattr(reference.get_submodule(key).weight_fake_quant.activation_post_process,
                                               field), rtol=1e-5, atol=1e-6)
