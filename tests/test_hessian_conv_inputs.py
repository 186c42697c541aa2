"""`qstats.hessian` on a convolution's input is refused by name when the plan is resolved.

Its rows would be the input's last dimension (a ``(2, 3, 10, 7)`` Conv2d input gave a 7x7 "Hessian"
over image width), where a conv's GPTQ Hessian is over its unfolded patches, ``in_channels * kh * kw``
features (llm-compressor 0.14's `accumulate_hessian` means to unfold them, but reshapes a 4-D input to
3-D first and then fails in ``permute``); `qstats.gptq` takes Linear weights only.
"""

import pytest
import torch

import qstats
from qstats.observers.hessian import gptq_hessian

llmcompressor_helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=(2, 3), padding=1)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


def _reference_hessian(module, x):
    """llm-compressor 0.14's ``H = 2/n * sum x^T x`` of one batch of ``module``'s inputs."""
    columns = x.shape[-1]
    total, samples = llmcompressor_helpers.accumulate_hessian(x, module, torch.zeros(columns, columns),
                                                              torch.zeros((), dtype=torch.int64))
    return total / samples


@pytest.mark.parametrize("targets", ["Conv2d", "conv", "re:.*"])
def test_hessian_on_a_conv_input_is_refused_naming_the_module(targets):
    model, x = _ConvNet(), torch.randn(2, 3, 10, 7)
    recipe = qstats.Recipe([qstats.Rule(targets, sites=("input",), observer=qstats.hessian)])
    with pytest.raises(ValueError, match=r"'conv'.*Conv2d.*Linear"):
        recipe.resolve(model)
    with pytest.raises(ValueError, match=r"'conv'.*Conv2d.*Linear"):
        qstats.calibrate(model, [(x,)], recipe, progress=False)
    # a conv's GPTQ Hessian would be over its patches (3 * 2 * 3 = 18 features), not the width (7)
    patches = torch.nn.functional.unfold(x, model.conv.kernel_size, padding=model.conv.padding)
    assert patches.shape[1] == 18 and x.shape[-1] == 7


@pytest.mark.parametrize("conv", [torch.nn.Conv1d(3, 4, 2), torch.nn.Conv3d(3, 4, 2), torch.nn.ConvTranspose2d(3, 4, 2)])
def test_every_convolution_kind_is_refused(conv):
    model = torch.nn.Sequential(conv)
    with pytest.raises(ValueError, match=r"'0'.*only"):
        qstats.Recipe([qstats.Rule("re:.*", sites=("input",), observer=qstats.hessian)]).resolve(model)


def test_a_linear_beside_a_conv_is_observed_as_llm_compressor_does():
    """The refusal is of the conv alone: the Linear's Hessian (and other observers on the conv's
    input) still resolve; the Linear's is llm-compressor's."""
    model, x = _ConvNet(), torch.randn(2, 3, 10, 7)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.hessian)])
    with torch.no_grad():
        states = qstats.calibrate(model, [(x,)], recipe, progress=False)
        head_input = model.conv(x).mean(dim=(2, 3))
    # [samples, 1, in]: llm-compressor counts samples (a 2-D input is one), qstats rows; here they agree
    torch.testing.assert_close(gptq_hessian(states["head"]["input"]), _reference_hessian(model.head, head_input[:, None]))
    spec = qstats.QuantSpec(dtype="int8")
    plan = qstats.Recipe([qstats.Rule("Conv2d", sites=("input",), spec=spec)]).resolve(model)
    assert set(plan.sites["conv"]) == {"input"}


def test_imatrix_on_a_conv_input_is_refused_as_llm_compressor_observes_in_features_only():
    """qstats.imatrix reduced a conv input over its last dimension (image width: 7 'channels' of a
    3-channel conv); llm-compressor's imatrix observer hooks only modules with ``in_features``."""
    model = _ConvNet()
    assert not hasattr(model.conv, "in_features") and hasattr(model.head, "in_features")
    with pytest.raises(ValueError, match=r"qstats.imatrix on the input of 'conv' \(Conv2d\)"):
        qstats.Recipe([qstats.Rule("re:.*", sites=("input",), observer="imatrix")]).resolve(model)
    qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer="imatrix")]).resolve(model)
