"""``qstats.fake_quantized`` entered inside a ``torch.func`` transform: ``torch.func.grad`` and
``torch.func.jvp`` of a loss with respect to the QParams' scales (learned scales, JAX style), on
stacked experts (their weights and each expert's ``input`` / ``down_proj.input``) and on a plain
Linear, against the straight-through estimate written out by hand (codes ``round(t / s)`` clamped,
gradient 1 to ``t`` inside the range, the codes to ``s``). Registering the parametrizations there
made torch ``set_`` a tensor captured from outside the transform, which it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import qstats
from test_qat_experts import TOKENS, _hand_fake_quantize, _qwen3_moe, _reference_experts, _toy


def _with_scales(qparams: dict, scales: dict) -> dict:
    """``qparams`` with each site's scale replaced by ``scales[path][site]``."""
    return {path: {site: qp._replace(scale=scales[path][site]) for site, qp in entry.items()}
            for path, entry in qparams.items()}


def _scales(qparams: dict) -> dict:
    return {path: {site: qp.scale.detach().clone() for site, qp in entry.items()} for path, entry in qparams.items()}


def _toy_losses():
    """``(ours, reference, scales)``: the toy experts' loss as a function of every site's scales,
    through `fake_quantized` (entered inside the function) and through the hand-written loop."""
    model, recipe, index, weights, qparams = _toy()
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(3)) * 1.5, torch.randn(8, 4)

    def ours(scales):
        with qstats.fake_quantized(model, _with_scales(qparams, scales), recipe):
            return F.mse_loss(model(x, index, weights), y)

    def reference(scales):
        experts = copy.deepcopy(model)
        experts.forward = _reference_experts(qparams[""], scales=scales[""]).__get__(experts)
        return F.mse_loss(experts(x, index, weights), y)

    return ours, reference, _scales(qparams), model


def test_grad_of_expert_scales_equals_the_hand_written_straight_through_loop():
    ours, reference, scales, model = _toy_losses()
    parameters = dict(model.named_parameters())
    grads, expected = torch.func.grad(ours)(scales), torch.func.grad(reference)(scales)
    for site, grad in expected[""].items():
        assert grad.abs().sum() > 0, site
        torch.testing.assert_close(grads[""][site], grad, rtol=1e-5, atol=1e-6, msg=site)
    # the model leaves the context as it entered it: its own Parameter objects, no parametrization
    assert dict(model.named_parameters()) == parameters and not hasattr(model, "parametrizations")


def test_jvp_along_expert_scales_equals_the_hand_written_loop():
    ours, reference, scales, _ = _toy_losses()
    generator = torch.Generator().manual_seed(4)
    tangents = {"": {site: torch.randn(s.shape, generator=generator) for site, s in scales[""].items()}}
    value, tangent = torch.func.jvp(ours, (scales,), (tangents,))
    expected_value, expected_tangent = torch.func.jvp(reference, (scales,), (tangents,))
    assert expected_tangent.abs() > 0
    torch.testing.assert_close(value, expected_value, rtol=0, atol=0)
    torch.testing.assert_close(tangent, expected_tangent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_grad_of_qwen3_moe_expert_scales_equals_the_hand_written_loop(implementation):
    model, recipe, qparams = _qwen3_moe(implementation)
    reference = copy.deepcopy(model)

    def ours(scales):
        with qstats.fake_quantized(model, _with_scales(qparams, scales), recipe):
            return model(input_ids=TOKENS, labels=TOKENS).loss

    def theirs(scales):
        for path, entry in qparams.items():
            experts = reference.get_submodule(path)
            experts.forward = _reference_experts(entry, experts.act_fn, scales[path]).__get__(experts)
        return reference(input_ids=TOKENS, labels=TOKENS).loss

    scales = _scales(qparams)
    grads, expected = torch.func.grad(ours)(scales), torch.func.grad(theirs)(scales)
    for path, entry in expected.items():
        for site, grad in entry.items():
            torch.testing.assert_close(grads[path][site], grad, rtol=1e-4, atol=1e-6, msg=f"{path} {site}")


def test_grad_of_linear_weight_and_input_scales_equals_the_hand_written_estimate():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5))
    spec_w = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerRow(-1))
    spec_a = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec_w),
                            qstats.Rule("Linear", sites=("input",), spec=spec_a)])
    states = qstats.calibrate(model, [torch.randn(4, 6)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    x = torch.randn(4, 6) * 1.5  # some values past the calibrated range: clipped

    def ours(scales):
        with qstats.fake_quantized(model, _with_scales(qparams, scales), recipe):
            return model(x).square().sum()

    def reference(scales):
        weight = _hand_fake_quantize(model[0].weight, scales["0"]["weight"].reshape(-1, 1))
        return F.linear(_hand_fake_quantize(x, scales["0"]["input"]), weight, model[0].bias).square().sum()

    scales = _scales(qparams)
    grads, expected = torch.func.grad(ours)(scales), torch.func.grad(reference)(scales)
    for site, grad in expected["0"].items():
        assert grad.abs().sum() > 0, site
        torch.testing.assert_close(grads["0"][site], grad, rtol=1e-5, atol=1e-6, msg=site)
