"""`qstats.coreai_opt.recipe_from_coreai_opt` resolves a weight's ``axis=None`` for subclasses of
coreai_opt's module types as its prepare does: graph mode reads it from the op the weight feeds
(``aten.linear``: a Linear subclass's weight is a Linear's), so the recipe gives coreai_opt's
qparams bit for bit; eager mode reads the parametrized module's base class, which a subclass is
not in coreai_opt's table: both refuse it."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats
import qstats.coreai_opt
from test_coreai_opt_config_recipe import EAGER, _compare, _data

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import Quantizer, QuantizerConfig


class _Linear(nn.Linear):
    pass


class _ConvTranspose2d(nn.ConvTranspose2d):
    pass


PRESETS = {"w8": lambda **kw: QuantizerConfig.presets.w8(**kw),
           "w4_per_block": lambda **kw: QuantizerConfig.presets.w4_per_block(block_size=4, **kw)}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_graph_mode_resolves_a_linear_subclass_weight_axis_as_a_linears(preset, single_thread_quiet):
    torch.manual_seed(0)
    model = nn.Sequential(_Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    equal, total = _compare(model, PRESETS[preset](), *_data(16))
    assert equal == total == 4


def test_graph_mode_resolves_a_conv_transpose_subclass_weight_axis(single_thread_quiet):
    torch.manual_seed(0)
    model = nn.Sequential(_ConvTranspose2d(8, 4, 3), nn.ReLU()).eval()
    recipe = qstats.coreai_opt.recipe_from_coreai_opt(QuantizerConfig.presets.w8(), model)
    assert recipe.sites(model)["0"]["weight"].spec.granularity == qstats.PerAxis(1)
    equal, total = _compare(model, QuantizerConfig.presets.w8(), *_data(8, (5, 5)))
    assert equal == total == 2


def test_eager_mode_refuses_a_subclass_weight_axis_none_as_coreai_opt(single_thread_quiet):
    model = nn.Sequential(_Linear(16, 8)).eval()
    config = QuantizerConfig.presets.w8(execution_mode=EAGER)
    with pytest.raises(ValueError, match="unresolved axis=None"):
        Quantizer(copy.deepcopy(model), config).prepare((torch.randn(2, 16),))
    with pytest.raises(ValueError, match="axis None"):
        qstats.coreai_opt.recipe_from_coreai_opt(config, model)
