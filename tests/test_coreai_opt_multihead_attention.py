"""`qstats.coreai_opt.recipe_from_coreai_opt` on ``nn.MultiheadAttention``: coreai_opt's eager
handler sees its forward as one op it does not register (its ``out_proj``'s forward never runs)
and leaves everything inside it float, so the recipe gives it no sites and its qparams and outputs
equal coreai_opt's; graph mode quantizes the parameters of the linear ops it decomposes into, under
the attention module's config, which no module site holds: refused, naming the module."""

import copy
import warnings

import pytest
import torch
from torch import nn

import qstats.coreai_opt
from test_coreai_opt_config_recipe import EAGER, _compare, _data, _qstats_qparams, _spec

pytest.importorskip("coreai_opt")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import ModuleQuantizerConfig, Quantizer, QuantizerConfig


class _Attention(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=batch_first)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


PER_CHANNEL = {"weight": _spec(granularity={"type": "per_channel", "axis": 0})}


@pytest.mark.parametrize("weights_only", [False, True], ids=["default_config", "weights_per_channel"])
def test_eager_mode_leaves_multihead_attention_float(weights_only, single_thread_quiet):
    torch.manual_seed(0)
    model = _Attention(batch_first=False).eval()  # its python path in both: bit for bit
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_state_spec=PER_CHANNEL, op_input_spec=None, op_output_spec=None)) if weights_only else QuantizerConfig(
        execution_mode=EAGER)
    assert set(qstats.coreai_opt.recipe_from_coreai_opt(config, model).sites(model)) == {"fc"}
    equal, total = _compare(model, config, *_data(5, (16,)))
    assert equal == total == (2 if weights_only else 6)


@pytest.mark.parametrize("state", [None, {"*": _spec(granularity={"type": "per_channel", "axis": 0})}],
                         ids=["w8_preset", "every_state_per_channel"])
def test_graph_mode_quantizing_inside_multihead_attention_is_refused_by_name(state):
    config = QuantizerConfig.presets.w8() if state is None else QuantizerConfig(global_config=ModuleQuantizerConfig(
        op_state_spec=state, op_input_spec=None, op_output_spec=None))
    with pytest.raises(ValueError, match="graph execution mode quantizes .* nn.MultiheadAttention 'attn'"):
        qstats.coreai_opt.recipe_from_coreai_opt(config, _Attention(batch_first=True).eval())


def test_graph_mode_with_the_attention_disabled_is_converted(single_thread_quiet):
    """coreai_opt's graph prepare then quantizes the head's weight only, with the recipe's qparams."""
    torch.manual_seed(0)
    model = _Attention(batch_first=True).eval()
    config = QuantizerConfig(global_config=ModuleQuantizerConfig.presets.w8(),
                             module_name_configs={"attn": None})
    example, batches = _data(5, (16,))
    prepared = Quantizer(copy.deepcopy(model), config).prepare((example,))
    quantized = {node.args[0].target: prepared.get_submodule(node.target).qparams_calculator
                 for node in prepared.graph.nodes if node.op == "call_module"}
    assert set(quantized) == {"fc.weight"}
    plan = qstats.coreai_opt.recipe_from_coreai_opt(config, model).resolve(model)
    qparams = _qstats_qparams(model, plan, example, batches)
    assert set(qparams) == {"fc"} and set(qparams["fc"]) == {"weight"}
    assert torch.equal(qparams["fc"]["weight"].scale, quantized["fc.weight"].scale.reshape(-1))
