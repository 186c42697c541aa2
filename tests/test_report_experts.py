"""qstats.report on the per-expert activation sites of stacked experts (``input``,
``<parameter>.input``): each expert's matmul input rows measured under that expert's scale, against
the experts' forward recomputed by hand in plain torch (torch's own fake-quant ops, torch.ao's
per-row observer for run-time scales); and on a tiny transformers Qwen3-MoE, that the rows are
measured in every experts implementation. Before, these sites were skipped (SQNR None)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.ao.quantization.observer import PerChannelMinMaxObserver

import qstats

STATIC = qstats.QuantSpec(dtype="int8", mapping="symmetric")
DYNAMIC = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerToken())
SITES = ("input", "down_proj.input")


class _Experts(torch.nn.Module):
    """Two stacked experts multiplying by ``P[e]`` with F.linear (as test_fake_quantized_experts');
    ``untraced``: the rows are a product of the gathered tokens, which the capture does not follow."""

    def __init__(self, untraced=False):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 6, 4))
        self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 3))
        self.untraced = untraced

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(2):
            token, slot = torch.where(top_k_index == e)
            rows = x[token] * 1.0 if self.untraced else x[token]
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


def _rows_by_hand(experts, x, index):
    """``{site: [rows of expert 0, rows of expert 1]}`` and each expert's tokens, in plain torch."""
    rows, tokens = {"input": [], "down_proj.input": [], "gate_up_proj.input": []}, []
    for e in range(2):
        token = torch.where(index[:, 0] == e)[0]
        gate, up = (x[token] @ experts.gate_up_proj[e].detach().T).chunk(2, dim=-1)
        rows["input"].append(x[token])
        rows["gate_up_proj.input"].append(x[token])
        rows["down_proj.input"].append(F.silu(gate) * up)
        tokens.append(token)
    return rows, tokens


def _expected(parts, scales):
    """``(sqnr_db, clipped_fraction)`` of fake-quantizing each part under its per-row (or one)
    int8 scale with torch's own ops, over all parts together."""
    signal = noise = 0.0
    clipped = total = 0
    for part, scale in zip(parts, scales):
        scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).expand(part.shape[0]).contiguous()
        zero = torch.zeros(part.shape[0], dtype=torch.int32)
        quantized = torch.fake_quantize_per_channel_affine(part, scale, zero, 0, -128, 127)
        codes = torch.round(part * (1.0 / scale[:, None]))  # as torch's fake-quant kernel: times 1 / scale
        signal += float(part.double().pow(2).sum())
        noise += float((part - quantized).double().pow(2).sum())
        clipped += int(((codes < -128) | (codes > 127)).sum())
        total += part.numel()
    return 10 * math.log10(signal / noise), clipped / total


def _setup(spec, sites=SITES, untraced=False):
    torch.manual_seed(0)
    experts = _Experts(untraced).eval()
    recipe = qstats.Recipe([qstats.Rule("_Experts", sites=sites, observer=qstats.minmax, spec=spec)])
    index = torch.tensor([[0], [1], [1]] * 4)
    calibration = (torch.randn(12, 4), index, torch.ones(12, 1))
    states = qstats.calibrate(experts, [calibration], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, experts)
    held_out = (torch.randn(12, 4, generator=torch.Generator().manual_seed(3)) * 1.5, index, torch.ones(12, 1))
    return experts, recipe, states, qparams, held_out


def _rows(rep):
    return {row.site: row for row in rep.rows}


def _assert_measured_as_by_hand(rows, experts, qparams, x, index, sites=SITES, weight=None) -> None:
    """Each site's SQNR and clipped fraction in ``rows`` are `_expected`'s of the rows computed by hand,
    each expert's under its own static scale (the rows of tokens whose ``weight`` is 0 left out)."""
    by_hand, tokens = _rows_by_hand(experts, x, index)
    for site in sites:
        parts = by_hand[site]
        if weight is not None:
            parts = [rows_e[weight[token] != 0] for rows_e, token in zip(parts, tokens)]
        sqnr, clipped = _expected(parts, [float(qparams[""][site].scale[e]) for e in range(2)])
        assert rows[site].sqnr_db == pytest.approx(sqnr, rel=1e-5)
        assert rows[site].clipped_fraction == pytest.approx(clipped)


def test_static_expert_inputs_under_each_experts_scale():
    """Held-out rows larger than the calibration's: each expert's rows under its own scale, some clipped."""
    experts, recipe, states, qparams, (x, index, weights) = _setup(STATIC)
    rows = _rows(qstats.report(states, qparams, experts, recipe, [(x, index, weights)]))
    by_hand, _ = _rows_by_hand(experts, x, index)
    for site in SITES:
        scales = [float(qparams[""][site].scale[e]) for e in range(2)]
        sqnr, clipped = _expected(by_hand[site], scales)
        assert rows[site].sqnr_db == pytest.approx(sqnr, rel=1e-5)
        assert rows[site].clipped_fraction == pytest.approx(clipped)
        assert rows[site].nonfinite == 0 and rows[site].experts == 2
    assert rows["input"].clipped_fraction > 0
    assert scales[0] != scales[1]


def test_runtime_per_token_expert_inputs_use_each_rows_scales():
    """A run-time (per-token) site: each row under its own scale, torch.ao's per-row symmetric observer's."""
    experts, recipe, states, qparams, (x, index, weights) = _setup(DYNAMIC)
    rows = _rows(qstats.report(states, qparams, experts, recipe, [(x, index, weights)]))
    by_hand, _ = _rows_by_hand(experts, x, index)
    for site in SITES:
        scales = []
        for part in by_hand[site]:
            observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            observer(part)
            scales.append(observer.calculate_qparams()[0])
        sqnr, clipped = _expected(by_hand[site], scales)
        assert rows[site].sqnr_db == pytest.approx(sqnr, rel=1e-5)
        assert rows[site].clipped_fraction == pytest.approx(clipped)
        assert rows[site].mean_scale is None


def test_padding_tokens_are_left_out_of_each_site():
    """Tokens whose observation weight is 0 (huge values there) are left out of both sites: ``input``
    through the rows' traced tokens, ``down_proj.input`` through the ``gate_up_proj`` rows they follow."""
    experts, recipe, states, qparams, (x, index, weights) = _setup(STATIC)
    padding = torch.tensor([0, 5, 7])
    x = x.clone()
    x[padding] = 1e3
    weight = torch.ones(12)
    weight[padding] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every row traced to its token
        rows = _rows(qstats.report(states, qparams, experts, recipe, [(x, index, weights)],
                                   observation_weight=lambda batch: weight))
    _assert_measured_as_by_hand(rows, experts, qparams, x, index, weight=weight)


def test_untraced_rows_warn_and_are_all_measured():
    """Rows the capture cannot trace to their tokens: a warning (as calibrate's), every row measured."""
    sites = ("gate_up_proj.input",)
    experts, recipe, states, qparams, (x, index, weights) = _setup(STATIC, sites=sites, untraced=True)
    with pytest.warns(UserWarning, match="could not be traced"):
        rep = qstats.report(states, qparams, experts, recipe, [(x, index, weights)],
                            observation_weight=lambda batch: torch.ones(12))
    _assert_measured_as_by_hand(_rows(rep), experts, qparams, x, index, sites)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_qwen3_moe_expert_sites_are_measured(implementation):
    pytest.importorskip("transformers")
    from test_moe_families import INPUTS, _model

    model = _model("qwen3_moe")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(implementation)
    elif implementation != "eager":
        pytest.skip("this transformers has one experts implementation")
    experts = next(m for m in model.modules() if qstats.experts.expert_count(m))
    recipe = qstats.Recipe([qstats.Rule(type(experts).__name__, sites=SITES, observer=qstats.minmax, spec=INPUTS)])
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, 128, (2, 6), generator=generator),
             "attention_mask": torch.tensor([[1] * 6, [1] * 3 + [0] * 3])}
    states = qstats.calibrate(model, [batch], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # every row traced to its token
        rep = qstats.report(states, qparams, model, recipe, [batch],
                            observation_weight=lambda batch: batch["attention_mask"])
    assert len(rep) == 2 * len(SITES)  # two layers
    for row in rep:
        assert row.experts == 8 and row.nonfinite == 0
        # measured on the calibration batch: its min/max scales clip nothing, int8 noise well below the signal
        assert row.clipped_fraction == 0.0
        assert 25.0 < row.sqnr_db < 60.0


def test_input_and_gate_up_proj_input_are_both_measured():
    """Both sites on the same rows (`fake_quantized` applies both): each measured under its own
    scales. Before, the rows went to ``gate_up_proj.input`` only and ``input`` had no SQNR."""
    sites = ("input", "gate_up_proj.input")
    experts, recipe, states, qparams, (x, index, weights) = _setup(STATIC, sites=sites)
    rows = _rows(qstats.report(states, qparams, experts, recipe, [(x, index, weights)]))
    _assert_measured_as_by_hand(rows, experts, qparams, x, index, sites)


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_sentinel_expert_ids_are_measured_by_no_expert(implementation):
    """Expert-parallel sentinels (id 8 of 8 experts, weight 0) route a slot nowhere: their rows are
    left out, as `fake_quantized` leaves them float. They were looked up as expert 8: IndexError."""
    transformers = pytest.importorskip("transformers")
    from _shared import qwen3_moe_config
    from test_experts_intermediate import _Layer

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(num_experts=8, num_experts_per_tok=2)).eval()
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip("this transformers has one experts implementation")
    model.set_experts_implementation(implementation)
    layer = _Layer(model.model.layers[0].mlp.experts)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 16, generator=generator)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [5, 6], [7, 0]])
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=SITES, observer=qstats.minmax, spec=STATIC)])
    states = qstats.calibrate(layer, [(hidden, index, torch.rand(6, 2, generator=generator))], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, layer)
    index = torch.tensor([[0, 8], [1, 2], [8, 3], [3, 4], [5, 6], [1, 8]])
    weights = torch.rand(6, 2, generator=generator) * (index < 8)
    hidden = torch.randn(6, 16, generator=generator) * 1.5  # held out: no value at a calibrated extreme (a tie)
    rows = _rows(qstats.report(states, qparams, layer, recipe, [(hidden, index, weights)]))
    experts, parts = layer.experts, {site: [] for site in SITES}
    with torch.no_grad():
        for expert in range(8):
            token = torch.where(index == expert)[0]
            gate, up = F.linear(hidden[token], experts.gate_up_proj[expert]).chunk(2, -1)
            parts["input"].append(hidden[token])
            parts["down_proj.input"].append(experts.act_fn(gate) * up)
    for site in SITES:
        scales = [float(s) for s in qparams["experts"][site].scale]
        sqnr, clipped = _expected(*zip(*[(part, scale) for part, scale in zip(parts[site], scales) if len(part)]))
        assert rows[site].sqnr_db == pytest.approx(sqnr, rel=1e-5)
        assert rows[site].clipped_fraction == pytest.approx(clipped)


class _HalvingExperts(_Experts):
    """`_Experts` whose forward calls the module itself on each half of its tokens."""

    def forward(self, x, top_k_index, top_k_weights):
        if x.shape[0] <= 6:
            return super().forward(x, top_k_index, top_k_weights)
        return torch.cat([self(x[:6], top_k_index[:6], top_k_weights[:6]),
                          self(x[6:], top_k_index[6:], top_k_weights[6:])])


def test_a_nested_call_is_measured_once_with_its_padding_left_out():
    """The inner calls' matmuls are the outer call's: measured once, by the outer call, whose rows
    trace to its tokens. Before, the inner calls measured them again without the observation
    weight (it fits the outer input only): the padding's huge values were measured (0.2 dB)."""
    torch.manual_seed(0)
    experts = _HalvingExperts().eval()
    recipe = qstats.Recipe([qstats.Rule("_HalvingExperts", sites=SITES, observer=qstats.minmax, spec=STATIC)])
    index = torch.tensor([[0], [1], [1]] * 4)
    states = qstats.calibrate(experts, [(torch.randn(12, 4), index, torch.ones(12, 1))], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, experts)
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(3)) * 1.5
    x[[1, 8]] = 1e3
    weight = torch.ones(12)
    weight[[1, 8]] = 0
    rows = _rows(qstats.report(states, qparams, experts, recipe, [(x, index, torch.ones(12, 1))],
                               observation_weight=lambda batch: weight))
    _assert_measured_as_by_hand(rows, experts, qparams, x, index, weight=weight)
