"""`qstats.mse(spec, mode="moving_average")` on the stacked ``gate_up_proj [E, 2I, H]`` of a small Qwen3-MoE
(random weights from a transformers config) through `qstats.calibrate` and `qstats.compute_qparams_tree`,
against llm-compressor 0.14's ``mse`` observer (its moving average of per-batch searches, early stop
included) on each Linear its ``linearize_moe`` makes of the stack (``gate_proj`` = rows ``:I``, ``up_proj``
= rows ``I:``). A Recipe runs the search of each half on its own (`searched_per_part`): one stop of gate
and up together picked other scales on some halves."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

from _shared import qwen3_moe_config  # noqa: E402

E, I, H = 8, 64, 128


def _args(strategy: str):
    group = {"group_size": 32} if strategy == "group" else {}
    bits = 8 if strategy == "tensor" else 4
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, observer="mse",
                            observer_kwargs={"patience": 1}, **group)


def _model(seed: int):
    torch.manual_seed(seed)
    config = qwen3_moe_config(hidden_size=H, moe_intermediate_size=I, intermediate_size=2 * I, num_experts=E,
                              num_hidden_layers=1, head_dim=16)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():  # weights of a trained model's scale, whatever the initialization
        experts.gate_up_proj.normal_(0.0, 0.02)
    return model, experts


def _differing(model, experts, args):
    """The linearized Linears (``expert.gate_proj`` / ``expert.up_proj``) whose calibrated scale is not
    llm-compressor's ``mse`` observer's on that Linear's weight."""
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj",), observer=qstats.mse,
                                        spec=qstats.QuantSpec.from_compressed_tensors(args),
                                        observer_kwargs={"mode": "moving_average", "patience": 1})])
    states = qstats.calibrate(model, [], recipe, progress=False)
    path = next(path for path, module in model.named_modules() if module is experts)
    scale = qstats.compute_qparams_tree(states, recipe, model)[path]["gate_up_proj"].scale
    weight = experts.gate_up_proj.detach()
    differing = []
    for expert in range(E):
        for half, (name, rows) in enumerate((("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I)))):
            observer = llmc_observers.Observer.load_from_registry("mse", base_name="weight", args=args)
            observer(weight[expert, rows])
            theirs = observer.get_qparams()["scale"]
            ours = scale[expert, half] if args.strategy == "tensor" else scale[expert, rows]  # tensor: [E, 2, 1]
            if not torch.equal(ours.reshape(theirs.shape), theirs):
                differing.append(f"{expert}.{name}")
    return differing


@pytest.mark.parametrize("strategy", ["group", "channel", "tensor"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_each_half_searched_as_its_linear(single_thread_quiet, strategy, seed):
    model, experts = _model(seed)
    assert _differing(model, experts, _args(strategy)) == []
