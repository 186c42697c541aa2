"""`qstats.coreai_opt.recipe_from_coreai_opt` in graph execution mode next to BatchNorm: coreai_opt's
graph prepare folds a BatchNorm that follows a Conv1d/Conv2d/ConvTranspose1d/ConvTranspose2d into
the weight its quantizer observes (``weight * gamma / sqrt(running_var + eps)``), which no module
site holds, so the recipe refuses it by name; convs no BatchNorm can follow are converted bit for bit."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats
import qstats.coreai_opt

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import Quantizer, QuantizerConfig
    from coreai_opt.quantization.spec.fake_quantize import FakeQuantizeImplBase


def _batchnorm(features: int) -> nn.BatchNorm2d:
    norm = nn.BatchNorm2d(features)
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.25, 4.0)
        norm.weight.normal_()
    return norm


def _weight_scales(model: nn.Module, example: torch.Tensor) -> list:
    """The scales of the weight quantizers of coreai_opt's graph-mode prepared model (w8 preset)."""
    prepared = Quantizer(copy.deepcopy(model), QuantizerConfig.presets.w8()).prepare((example,))
    return [prepared.get_submodule(node.target).qparams_calculator.scale.reshape(-1)
            for node in prepared.graph.nodes
            if node.op == "call_module" and isinstance(prepared.get_submodule(node.target), FakeQuantizeImplBase)]


def test_a_conv_followed_by_batchnorm_is_refused_as_coreai_opt_quantizes_the_folded_weight(single_thread_quiet):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), _batchnorm(8), nn.ReLU()).eval()
    example = torch.randn(2, 4, 6, 6)
    (scale,) = _weight_scales(model, example)
    conv, norm = model[0], model[1]
    folded = conv.weight * (norm.weight / torch.sqrt(norm.running_var + norm.eps)).reshape(-1, 1, 1, 1)
    # coreai_opt's weight scale is the folded weight's absmax / 127.5 (torchao's symmetric int8), not the conv's
    torch.testing.assert_close(scale, folded.detach().abs().amax(dim=(1, 2, 3)) / 127.5)
    assert not torch.allclose(scale, conv.weight.detach().abs().amax(dim=(1, 2, 3)) / 127.5)
    with pytest.raises(ValueError, match="graph execution mode folds a BatchNorm.*module '0' .Conv2d.*BatchNorm '1'"):
        qstats.coreai_opt.recipe_from_coreai_opt(QuantizerConfig.presets.w8(), model)


@pytest.mark.parametrize("conv", [nn.Conv1d(4, 8, 3), nn.ConvTranspose1d(4, 8, 3)], ids=["conv1d", "conv_transpose1d"])
def test_one_dimensional_convs_and_transposed_convs_are_refused_too(conv):
    model = nn.Sequential(conv, nn.BatchNorm1d(8)).eval()
    with pytest.raises(ValueError, match="folds a BatchNorm"):
        qstats.coreai_opt.recipe_from_coreai_opt(QuantizerConfig.presets.w8(), model)


def test_convs_no_batchnorm_can_follow_and_eager_mode_are_converted(single_thread_quiet):
    """A BatchNorm before the conv (of its input channels) is not folded: the recipe's weight
    qparams equal coreai_opt's graph-mode ones; eager mode never folds."""
    torch.manual_seed(0)
    model = nn.Sequential(_batchnorm(4), nn.Conv2d(4, 8, 3)).eval()
    example = torch.randn(2, 4, 6, 6)
    (scale,) = _weight_scales(model, example)
    plan = qstats.coreai_opt.recipe_from_coreai_opt(QuantizerConfig.presets.w8(), model).resolve(model)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [example], plan, progress=False), plan)
    assert torch.equal(qparams["1"]["weight"].scale, scale)
    eager = QuantizerConfig.presets.w8(execution_mode="eager")
    folding = nn.Sequential(nn.Conv2d(4, 8, 3), _batchnorm(8)).eval()
    assert [rule.sites for rule in qstats.coreai_opt.recipe_from_coreai_opt(eager, folding).rules] == [("weight",)]
