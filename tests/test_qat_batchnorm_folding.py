"""``qstats.qat.prepare(..., fold_batchnorm=True)``: a Conv1d/2d or Linear feeding a batch norm fake-quantizes
its weight scaled by the batch norm's running statistics.

References: torch.ao's QAT ``ConvBn1d`` / ``ConvBn2d`` / ``LinearBn1d`` (``torch.ao.nn.intrinsic.qat``, what
``prepare_qat_fx`` fuses Conv+BN and Linear+BN1d into) built on the same parameters, with the same
``FakeQuantize`` modules, trained step by step (forward, gradients, running statistics, ``freeze_bn_stats``);
their ``to_float()`` (the folded float layer ``convert_fx`` observes) for `QATModel.observed_weight`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.intrinsic.qat as nniqat
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import QConfig

import qstats
from _qat_torch_ao_reference import ACT_SPEC, W_SPEC, activation_fake_quant, weight_fake_quant

_QCONFIG = QConfig(activation=activation_fake_quant, weight=weight_fake_quant)
# layer, its batch norm, torch.ao's float fused module and QAT module, an input shape, the head's in_features
_CASES = {
    "conv1d": (lambda bias: nn.Conv1d(2, 4, 3, bias=bias), nn.BatchNorm1d, nni.ConvBn1d, nniqat.ConvBn1d, (5, 2, 6), 16),
    "conv2d": (lambda bias: nn.Conv2d(2, 4, 3, bias=bias), nn.BatchNorm2d, nni.ConvBn2d, nniqat.ConvBn2d, (5, 2, 4, 4), 16),
    "conv2d_reflect": (lambda bias: nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect", bias=bias), nn.BatchNorm2d,
                       nni.ConvBn2d, nniqat.ConvBn2d, (5, 2, 4, 4), 64),
    "linear": (lambda bias: nn.Linear(6, 4, bias=bias), nn.BatchNorm1d, nni.LinearBn1d, nniqat.LinearBn1d, (5, 6), 4),
}


def _models(case: str, bias: bool):
    """(model, torch.ao's QAT fused module on the same parameters and buffers, the head Linear)."""
    layer, norm, fused, qat_fused, _, head = _CASES[case]
    model = nn.Sequential(layer(bias), norm(4, momentum=0.3), nn.ReLU(), nn.Flatten(), nn.Linear(head, 3))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    float_fused = fused(model[0], model[1])
    float_fused.qconfig = _QCONFIG
    reference = qat_fused.from_float(float_fused)
    assert reference.weight is model[0].weight and reference.bn.running_var is model[1].running_var
    return model, reference


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_folded_batchnorm_trains_as_torch_ao_fused_qat_modules(case, bias):
    torch.manual_seed(0)
    model, reference = _models(case, bias)
    shape = _CASES[case][4]
    head_input, head_weight = activation_fake_quant(), weight_fake_quant()
    reference_input = activation_fake_quant()

    def reference_forward(x):
        h = F.relu(reference(reference_input(x))).flatten(1)
        return F.linear(head_input(h), head_weight(model[4].weight), model[4].bias)

    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                             qstats.moving_average_minmax(ACT_SPEC, 0.01), fold_batchnorm=True)
    assert qat.folded_layers == {"0": "1"} and qat.batchnorm_layers == ("1",)
    state = qat.init(torch.zeros(shape))
    params = {name: p.detach().clone() for name, p in qat.params().items()}
    torch_parameters = dict(model.named_parameters())

    def loss_fn(p, s, x, y, phase):
        out, new_state = qat.apply(p, s, x, phase=phase)
        return F.cross_entropy(out, y), (new_state, out)

    grad_fn = torch.func.grad(loss_fn, has_aux=True)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        if step == 3:
            reference.freeze_bn_stats()
        phase = qstats.QATPhase(freeze_batchnorm=step >= 3)
        x, y = torch.randn(shape, generator=g) * (step + 1), torch.randint(0, 3, (shape[0],), generator=g)
        model.zero_grad()
        expected = reference_forward(x)
        F.cross_entropy(expected, y).backward()
        grads, (state, out) = grad_fn(params, state, x, y, phase)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, torch_parameters[name].grad, rtol=1e-5, atol=1e-6, msg=name)
        params = {name: p - 0.1 * grads[name] for name, p in params.items()}
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    statistics = state.batchnorm["1"]
    torch.testing.assert_close(statistics.running_mean, reference.bn.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(statistics.running_var, reference.bn.running_var, rtol=1e-6, atol=1e-7)
    assert statistics.num_batches_tracked == reference.bn.num_batches_tracked == 3
    weight_state = reference.weight_fake_quant.activation_post_process
    torch.testing.assert_close(state.weights["0"].min_val, weight_state.min_val, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state.weights["0"].max_val, weight_state.max_val, rtol=1e-6, atol=1e-7)


def test_observed_weight_of_a_folded_layer_is_the_weight_torch_ao_folds():
    torch.manual_seed(0)
    model, reference = _models("conv2d", True)
    qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01), fold_batchnorm=True)
    state = qat.init(torch.zeros(1, 2, 4, 4))
    _, state = qat.apply(qat.params(), state, torch.randn(8, 2, 4, 4))
    with torch.no_grad():
        reference.bn.running_var.copy_(state.batchnorm["1"].running_var)  # the trained statistics
    folded = reference.to_float()  # fuse_conv_bn_weights, as convert_fx
    assert not torch.allclose(folded.weight, model[0].weight)
    torch.testing.assert_close(qat.observed_weight(qat.params(), "0", state), folded.weight, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="pass state="):
        qat.observed_weight(qat.params(), "0")


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        h = self.conv(x)
        return self.norm(h) + h  # the conv's output is used beside the batch norm: torch.ao's fuser skips it


def test_layers_that_cannot_fold_keep_their_own_weight():
    torch.manual_seed(0)
    observer = qstats.moving_average_minmax(W_SPEC, 0.01)
    # a conv whose weight stays in float has nothing to fold its batch norm into
    unobserved = (nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4)), {nn.Conv2d: None}, "1")
    for model, weight_observer, norm in [(_Residual(), observer, "norm"), unobserved]:
        with pytest.warns(UserWarning, match=rf"batch norms \['{norm}'\] are not folded"):
            assert qstats.qat.prepare(model, weight_observer, fold_batchnorm=True).folded_layers == {}
    model = _Residual()
    x = torch.randn(3, 4, 5, 5)
    with pytest.warns(UserWarning, match="not folded"):
        qat = qstats.qat.prepare(model, observer, fold_batchnorm=True)
    out, _ = qat.apply(qat.params(), qat.init(x), x)
    fake_quant = weight_fake_quant()
    h = F.conv2d(x, fake_quant(model.conv.weight), model.conv.bias, padding=1)
    torch.testing.assert_close(out, model.norm(h) + h)


def test_fold_batchnorm_must_be_a_bool():
    with pytest.raises(TypeError, match="fold_batchnorm must be True or False"):
        qstats.qat.prepare(nn.Sequential(nn.Linear(2, 2)), fold_batchnorm="yes")


def test_a_batchnorm_with_a_zero_weight_is_not_folded_where_torch_aos_fused_module_gives_nan():
    # zero_init_residual (torchvision's ResNet) starts the last batch norm of a block at weight 0: folding divides
    # the layer's output by that weight
    torch.manual_seed(0)
    model, reference = _models("conv2d", True)
    with torch.no_grad():
        model[1].weight[1] = 0.0
    x = torch.randn(5, 2, 4, 4)
    assert copy.deepcopy(reference)(activation_fake_quant()(x)).isnan().any()  # a copy: the model's buffers stay
    with pytest.warns(UserWarning, match=r"batch norms \['1'\] are not folded"):
        qat = qstats.qat.prepare(model, qstats.moving_average_minmax(W_SPEC, 0.01),
                                 qstats.moving_average_minmax(ACT_SPEC, 0.01), fold_batchnorm=True)
    assert qat.folded_layers == {}
    out, _ = qat.apply(qat.params(), qat.init(x), x)
    conv, norm = model[0], model[1]
    expected = F.conv2d(activation_fake_quant()(x), weight_fake_quant()(conv.weight), conv.bias)
    expected = F.linear(activation_fake_quant()(F.relu(norm(expected)).flatten(1)), weight_fake_quant()(model[4].weight),
                        model[4].bias)
    torch.testing.assert_close(out, expected)
