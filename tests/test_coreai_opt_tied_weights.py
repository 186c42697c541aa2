"""`qstats.coreai_opt.recipe_from_coreai_opt` on tied weights (an Embedding and a Linear head holding
one Parameter): coreai_opt quantizes such a tensor once, for every module that uses it, under the
spec of its owner of highest config precedence (a ``module_state_spec`` naming it first), a
disabled owner included; the recipe gives every owner that spec, and its qparams and the model's
fake-quantized outputs equal coreai_opt's prepared model's, in eager and graph execution mode."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats
import qstats.coreai_opt
from test_coreai_opt_config_recipe import EAGER, _compare, _qstats_qparams, _spec

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import ModuleQuantizerConfig, Quantizer, QuantizerConfig


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


def _ids():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 12, (3, 5), generator=g) for _ in range(4)]


W8, W4 = ModuleQuantizerConfig.presets.w8(), ModuleQuantizerConfig.presets.w4()
UINT8_STATE = ModuleQuantizerConfig(op_input_spec=None, op_output_spec=None, module_state_spec={
    "weight": _spec(torch.uint8, "asymmetric", {"type": "per_channel", "axis": 0})})
CONFIGS = {  # (config, the dtype coreai_opt quantizes the tied weight in, None: left float)
    "head_by_name": (dict(global_config=W8, module_name_configs={"head": W4}), "int4"),
    "embedding_disabled_by_name": (dict(global_config=W8, module_name_configs={"embed": None}), None),
    "embedding_type_over_global": (dict(global_config=W8, module_type_configs={nn.Embedding: W4}), "int4"),
    "module_state_spec_over_a_name": (dict(global_config=W8, module_name_configs={"embed": W4},
                                           module_type_configs={nn.Linear: UINT8_STATE}), "uint8"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_tied_weights_take_the_spec_of_their_owner_of_highest_precedence(case, single_thread_quiet):
    fields, dtype = CONFIGS[case]
    torch.manual_seed(0)
    model = _Tied().eval()
    config = QuantizerConfig(execution_mode=EAGER, **fields)
    sites = qstats.coreai_opt.recipe_from_coreai_opt(config, model).sites(model)
    assert {path: sites.get(path, {}).get("weight") and sites[path]["weight"].spec.dtype
            for path in ("embed", "head")} == {"embed": dtype, "head": dtype}
    ids = _ids()
    equal, total = _compare(model, config, ids[0], ids[1:])
    assert equal == total > 0


@pytest.mark.parametrize("case", ["head_by_name", "embedding_disabled_by_name"])
def test_tied_weights_in_graph_execution_mode(case, single_thread_quiet):
    fields, _ = CONFIGS[case]
    torch.manual_seed(0)
    model = _Tied().eval()
    config = QuantizerConfig(**fields)
    ids = _ids()
    quantizer = Quantizer(copy.deepcopy(model), config)
    prepared = quantizer.prepare((ids[0],))
    plan = qstats.coreai_opt.recipe_from_coreai_opt(config, model).resolve(model)
    qparams = _qstats_qparams(model, plan, ids[0], ids[1:])
    with torch.no_grad(), qstats.fake_quantized(model, qparams, plan):
        assert torch.equal(model(ids[2]), prepared(ids[2]))
