"""An mse weight search with early stopping (llm-compressor's ``memoryless_mse``, ``patience``) on a stacked
``gate_up_proj [E, 2I, H]``, against llm-compressor 0.14's observer on each Linear its ``linearize_moe``
makes of it (``gate_proj`` = rows ``:I``, ``up_proj`` = rows ``I:``): llm-compressor stops each Linear's
search on its own, and so does `compute_qparams_tree` on the stacked site (one stop of gate and up
together ran gate's search past llm-compressor's stop where up still improved: 2 of 16 projections
picked another scale at patience 1)."""

from __future__ import annotations

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from _shared import llm_compressor_imatrix_mse  # noqa: E402

E, I, H = 8, 64, 128


def _llm_compressor_scale(args, weight):
    observer = llmc_observers.Observer.load_from_registry(args.observer, base_name="weight", args=args)
    observer(weight)
    return observer.get_qparams()["scale"]


def _experts(seed: int = 2, intermediate: int = I, hidden: int = H):
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=E,
                                         num_experts_per_tok=2)
    experts = Qwen3MoeExperts(config)
    weight = torch.randn(E, 2 * intermediate, hidden, generator=torch.Generator().manual_seed(seed)) * 0.02
    with torch.no_grad():
        experts.gate_up_proj.copy_(weight)
    return experts


def _args(patience):
    kwargs = {} if patience is None else {"observer_kwargs": {"patience": patience}}
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                            observer="memoryless_mse", **kwargs)


# None: llm-compressor's default patience (5); seeds and shapes where one stop of gate and up together
# picked another scale (2 of 16 projections at patience 1, 1 of 16 at 5 with one group per row)
@pytest.mark.parametrize("patience, seed, intermediate, hidden", [(1, 2, I, H), (None, 5, 4, 32)])
def test_mse_early_stop_per_linearized_projection(single_thread_quiet, patience, seed, intermediate, hidden):
    experts = _experts(seed, intermediate, hidden)
    I = intermediate  # noqa: N806 (the halves' rows)
    model = torch.nn.ModuleDict({"experts": experts})
    args = _args(patience)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("gate_up_proj",), observer=qstats.mse, spec=spec,
                                        qparams_kwargs={"patience": 5 if patience is None else patience})])
    states = qstats.calibrate(model, [], recipe, progress=False)
    scale = qstats.compute_qparams_tree(states, recipe, model)["experts"]["gate_up_proj"].scale
    weight = experts.gate_up_proj.detach()
    differing = []
    for expert in range(E):
        for name, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
            theirs = _llm_compressor_scale(args, weight[expert, rows])
            if not torch.equal(scale[expert, rows].reshape(theirs.shape), theirs):
                differing.append(f"{expert}.{name}")
    assert differing == []


def test_stacked_equals_per_expert_linears(single_thread_quiet):
    """The stacked ``gate_up_proj`` and the per-expert ``gate_proj`` / ``up_proj`` Linears holding its
    halves (as llm-compressor's ``linearize_moe`` makes them) get the same scales under one recipe."""
    experts = _experts()
    weight = experts.gate_up_proj.detach()
    linears = torch.nn.ModuleDict()
    for expert in range(E):
        for name, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
            linear = torch.nn.Linear(H, I, bias=False)
            with torch.no_grad():
                linear.weight.copy_(weight[expert, rows])
            linears[f"{expert}_{name}"] = linear
    spec = qstats.QuantSpec.from_compressed_tensors(_args(1))

    def scales(model, target, site):
        recipe = qstats.Recipe([qstats.Rule(target, sites=(site,), observer=qstats.mse, spec=spec,
                                            qparams_kwargs={"patience": 1})])
        return qstats.compute_qparams_tree(qstats.calibrate(model, [], recipe, progress=False), recipe, model)

    stacked = scales(torch.nn.ModuleDict({"experts": experts}), "Qwen3MoeExperts", "gate_up_proj")
    stacked = stacked["experts"]["gate_up_proj"].scale
    alone = scales(linears, "Linear", "weight")
    for expert in range(E):
        for name, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
            assert torch.equal(stacked[expert, rows], alone[f"{expert}_{name}"]["weight"].scale), (expert, name)


def test_each_half_observed_alone_equals_llm_compressor(single_thread_quiet):
    """The reference of the expected failure above: each linearized projection's slice, observed on its
    own by the stacked observer (gate halves, then up halves), equals llm-compressor's Linear."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                            observer="memoryless_mse", observer_kwargs={"patience": 1})
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    weight = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(2)) * 0.02
    observer = qstats.stacked_observer(qstats.mse(spec), E)
    for name, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
        half = weight[:, rows]
        scale = qstats.stacked_qparams(observer.update(observer.init(half), half), spec, patience=1).scale
        for expert in range(E):
            theirs = _llm_compressor_scale(args, half[expert])
            assert torch.equal(scale[expert].reshape(theirs.shape), theirs), (expert, name)


def test_imatrix_mse_early_stop_per_linearized_projection(single_thread_quiet):
    """`imatrix_mse` (an mse search weighted by the inputs' importance) on a stacked ``gate_up_proj``
    at patience 1 against llm-compressor's ``imatrix_mse`` on each linearized Linear, which sees the same
    inputs (seed and shapes where one stop of gate and up together picked another scale)."""
    intermediate, hidden, fields = 16, 64, dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(E, 2 * intermediate, hidden, generator=g) * 0.02
    xs = [torch.randn(2, 9, hidden, generator=g) * torch.logspace(-1, 1, hidden)]
    imatrix = qstats.imatrix()
    importance = imatrix.update(imatrix.init(xs[0]), xs[0])
    experts = _experts(5, intermediate, hidden)
    with torch.no_grad():
        experts.gate_up_proj.copy_(weight)
    model = torch.nn.ModuleDict({"experts": experts})
    args, _, _ = llm_compressor_imatrix_mse(fields, torch.nn.Linear(hidden, intermediate, bias=False), xs, patience=1)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule(
        "Qwen3MoeExperts", sites=("gate_up_proj",), spec=spec, qparams_kwargs={"patience": 1},
        observer=lambda s: qstats.imatrix_mse(s, (2 * intermediate, hidden), importance))])
    states = qstats.calibrate(model, [], recipe, progress=False)
    scale = qstats.compute_qparams_tree(states, recipe, model)["experts"]["gate_up_proj"].scale
    differing = []
    for expert in range(E):
        for name, rows in (("gate_proj", slice(0, intermediate)), ("up_proj", slice(intermediate, 2 * intermediate))):
            layer = torch.nn.Linear(hidden, intermediate, bias=False)
            with torch.no_grad():
                layer.weight.copy_(weight[expert, rows])
            _, theirs, _ = llm_compressor_imatrix_mse(fields, layer, xs, patience=1)
            if not torch.equal(scale[expert, rows].reshape(theirs.shape), theirs):
                differing.append(f"{expert}.{name}")
    assert differing == []
