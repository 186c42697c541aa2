"""``qstats.fake_quantized`` on stacked experts' per-expert input sites (``input``,
``down_proj.input``), against llm-compressor's ``oneshot`` model, whose linearized per-expert Linears
fake-quantize their own inputs: the logits of tiny random MoE models (test_moe_families) after
``QuantizationModifier(targets="Linear", scheme=...)``, in each transformers experts implementation.

compressed-tensors' dynamic ``"token"`` strategy gives one scale to a whole 2-D input (every expert's
rows are 2-D there; docs/differences.md), where qstats and vLLM give one per row: for the dynamic
schemes the reference is run with one scale per row (compressed-tensors' own function on the rows
as a 3-D ``[1, rows, hidden]`` input, its per-token case)."""

from __future__ import annotations

import pytest
import torch

import qstats
from _shared import llm_compressor_oneshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

from test_export_moe_linearized import _load, _sample, _saved  # noqa: E402


def _logits(family: str, scheme: str, folder: str, implementation: str = "eager"):
    """``(ours, theirs, float)`` logits of held-out tokens: qstats' `fake_quantized` after
    calibrating every expert on one sample, llm-compressor's `oneshot` model, the float model."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    _saved(family, folder)
    modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    theirs = llm_compressor_oneshot(_load(folder), [_sample()], modifier)
    x = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    model = _load(folder)
    model.set_attn_implementation("eager")
    model.set_experts_implementation(implementation)
    plan = qstats.Recipe.from_compressed_tensors(modifier).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": _sample()[None]}], plan, progress=False, all_experts=True)
    qparams = qstats.compute_qparams_tree(states, plan)
    with torch.no_grad():
        reference, float_logits = theirs(input_ids=x).logits, model(input_ids=x).logits
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(input_ids=x).logits
    assert any(plan.site(path, site).num_experts for path, entry in qparams.items() for site in entry
               if site.endswith("input"))
    return ours, reference, float_logits


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4", "W8A8", "FP8_DYNAMIC"])
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_qwen3_moe_logits_equal_oneshot(scheme, implementation, tmp_path, single_thread_quiet,
                                        per_row_dynamic_tokens):
    """Static per-expert input scales (FP8), dynamic local scales under each expert's calibrated
    global scale (NVFP4), dynamic per-token (W8A8, FP8_DYNAMIC). Before, the experts' inputs were
    left float: logits 0.002-0.008 off."""
    ours, theirs, float_logits = _logits("qwen3_moe", scheme, str(tmp_path), implementation)
    assert (theirs - float_logits).abs().max() > 1e-3  # the experts' quantization matters
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "glm4_moe", "nemotron_h"])
def test_other_families_fp8_logits_equal_oneshot(family, tmp_path, single_thread_quiet):
    """Static per-expert FP8 input scales on other layouts (Nemotron-H: gate-less ``up_proj``)."""
    ours, theirs, float_logits = _logits(family, "FP8", str(tmp_path))
    assert (theirs - float_logits).abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


class _Experts(torch.nn.Module):
    """Stacked experts whose forward multiplies by ``P[e]`` with F.linear, or, once
    ``unrecognised`` is set, with an einsum (a call `ExpertInputCapture` does not know)."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 6, 4))
        self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 3))
        self.unrecognised = False

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(2):
            token, slot = torch.where(top_k_index == e)
            rows = x[token]
            if self.unrecognised:
                h = torch.einsum("ti,oi->to", rows, self.gate_up_proj[e])
            else:
                h = torch.nn.functional.linear(rows, self.gate_up_proj[e])
            gate, up = h.chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


def _toy_calibrated():
    torch.manual_seed(0)
    experts = _Experts()
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    recipe = qstats.Recipe([qstats.Rule("_Experts", sites=("input", "down_proj.input"), spec=spec)])
    x, index = torch.randn(8, 4), torch.tensor([[0], [1]] * 4)
    batch = (x, index, torch.ones(8, 1))
    states = qstats.calibrate(experts, [batch], recipe, progress=False)
    return experts, recipe, batch, qstats.compute_qparams_tree(states, recipe, experts)


def _toy_by_hand(experts, entry, x, index):
    """`_Experts`' output recomputed in plain torch (one expert a token, routing weights of 1): each
    expert's rows of its ``"input"`` and ``"down_proj.input"`` fake-quantized with
    torch.fake_quantize_per_tensor_affine (int8 symmetric) under that expert's scale of ``entry``."""
    out = torch.zeros_like(x)
    for e in range(2):
        token = torch.where(index[:, 0] == e)[0]

        def quantize(t, site):
            return torch.fake_quantize_per_tensor_affine(t, float(entry[site].scale[e]), 0, -128, 127)

        gate, up = (quantize(x[token], "input") @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        y = quantize(torch.nn.functional.silu(gate) * up, "down_proj.input") @ experts.down_proj[e].T
        out = out.index_add(0, token, y)
    return out


def test_each_expert_input_under_its_own_scale():
    """Against the module recomputed in plain torch: each expert's rows fake-quantized with
    torch.fake_quantize_per_tensor_affine under that expert's scale."""
    experts, recipe, (x, index, weights), qparams = _toy_calibrated()
    entry = qparams[""]
    with torch.no_grad():
        with qstats.fake_quantized(experts, qparams, recipe):
            ours = experts(x, index, weights)
        expected = _toy_by_hand(experts, entry, x, index)
    assert not torch.equal(entry["input"].scale[0], entry["input"].scale[1])
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_an_expert_input_whose_matmul_is_not_found_is_refused():
    experts, recipe, batch, qparams = _toy_calibrated()
    experts.unrecognised = True
    with pytest.raises(ValueError, match=r"\['input'\] of the experts module ''"):
        with qstats.fake_quantized(experts, qparams, recipe):
            experts(*batch)


def _qwen3_experts(implementation):
    """One transformers Qwen3-MoE experts module (8 experts, weights of order 1) in a `_Layer`."""
    from _shared import qwen3_moe_config
    from test_experts_intermediate import _Layer

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config(num_experts=8, num_experts_per_tok=2)).eval()
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.5)
        experts.down_proj.normal_(0.0, 0.5)
    return _Layer(experts)


def _by_hand(experts, quantize, hidden, index, weights):
    """The experts' output with each expert's rows fake-quantized by ``quantize(rows, site,
    expert)``; slots of ids outside [0, E) contribute nothing."""
    out = torch.zeros_like(hidden)
    for expert in range(experts.gate_up_proj.shape[0]):
        token, slot = torch.where(index == expert)
        linear = torch.nn.functional.linear
        gate, up = linear(quantize(hidden[token], "input", expert), experts.gate_up_proj[expert]).chunk(2, -1)
        y = linear(quantize(experts.act_fn(gate) * up, "down_proj.input", expert), experts.down_proj[expert])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_sentinel_expert_ids_are_quantized_by_no_expert(implementation, single_thread_quiet):
    """Expert-parallel sentinels (id 8 of 8 experts, weight 0) route a slot nowhere: batched_mm
    gathers the clamped expert's weights for it, grouped_mm leaves it past the last offset. Their
    rows used to be looked up as expert 8's QParams: IndexError."""
    layer = _qwen3_experts(implementation)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 16, generator=generator)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [5, 6], [7, 0]])
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=spec)])
    states = qstats.calibrate(layer, [(hidden, index, torch.rand(6, 2, generator=generator))], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, layer)
    index = torch.tensor([[0, 8], [1, 2], [8, 3], [3, 4], [5, 6], [1, 8]])
    weights = torch.rand(6, 2, generator=generator) * (index < 8)
    with torch.no_grad():
        with qstats.fake_quantized(layer, qparams, recipe):
            ours = layer(hidden, index, weights)
        scales = {site: qp.scale for site, qp in qparams["experts"].items()}

        def quantize(t, site, expert):  # int8 symmetric under the expert's calibrated scale
            return torch.fake_quantize_per_tensor_affine(t, float(scales[site][expert]), 0, -128, 127)

        expected = _by_hand(layer.experts, quantize, hidden, index, weights)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def _runtime_int8(t, *where):
    """``t`` fake-quantized under the scale torch.ao's MinMaxObserver (qint8, per-tensor symmetric)
    takes of ``t`` itself: a dynamic input's run-time scale (``where``, the site and expert, unused)."""
    from torch.ao.quantization.observer import MinMaxObserver

    observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    observer(t)
    scale, zero_point = observer.calculate_qparams()
    return torch.fake_quantize_per_tensor_affine(t, float(scale), int(zero_point), -128, 127)


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_runtime_per_tensor_scales_of_each_experts_rows(implementation, single_thread_quiet):
    """Dynamic per-tensor inputs where the rows of several experts come in one call (one expert id
    per row): each expert's rows of the call under their own run-time scale, as llm-compressor's
    linearized per-expert Linears compute it, against torch.ao's MinMaxObserver of those rows."""
    layer = _qwen3_experts(implementation)
    generator = torch.Generator().manual_seed(2)
    hidden, index = torch.randn(6, 16, generator=generator), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [5, 6], [7, 0]])
    weights = torch.rand(6, 2, generator=generator)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input", "down_proj.input"), spec=spec,
                                        dynamic=True)])
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(layer, [(hidden, index, weights)], recipe, progress=False), recipe, layer)

    with torch.no_grad():
        with qstats.fake_quantized(layer, qparams, recipe):
            ours = layer(hidden, index, weights)
        expected = _by_hand(layer.experts, _runtime_int8, hidden, index, weights)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_runtime_per_tensor_scales_of_an_expert_without_tokens():
    """Dynamic per-tensor inputs, every token routed to expert 0: the toy's forward still multiplies
    expert 1's (empty) rows, whose run-time scale used to raise 'saw no finite data'. Expert 0's
    rows against torch.ao's MinMaxObserver of those rows."""
    torch.manual_seed(0)
    experts = _Experts()
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    recipe = qstats.Recipe([qstats.Rule("_Experts", sites=("input", "down_proj.input"), spec=spec, dynamic=True)])
    x, index, weights = torch.randn(8, 4), torch.zeros(8, 1, dtype=torch.long), torch.ones(8, 1)
    qparams = qstats.compute_qparams_tree(qstats.calibrate(experts, [(x, index, weights)], recipe, progress=False),
                                          recipe, experts)

    with torch.no_grad():
        with qstats.fake_quantized(experts, qparams, recipe):
            ours = experts(x, index, weights)
        gate, up = (_runtime_int8(x) @ experts.gate_up_proj[0].T).chunk(2, dim=-1)
        expected = _runtime_int8(torch.nn.functional.silu(gate) * up) @ experts.down_proj[0].T
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


class _HalvingExperts(_Experts):
    """`_Experts` whose forward calls the module itself on each half of its tokens."""

    def forward(self, x, top_k_index, top_k_weights):
        if x.shape[0] <= 4:
            return super().forward(x, top_k_index, top_k_weights)
        return torch.cat([self(x[:4], top_k_index[:4], top_k_weights[:4]),
                          self(x[4:], top_k_index[4:], top_k_weights[4:])])


def test_a_nested_call_of_the_experts_is_quantized_once():
    """The inner calls' matmuls were seen by the outer call's capture too: their rows, quantized
    already, did not trace to the outer input, which raised that "input" was never applied."""
    torch.manual_seed(0)
    experts = _HalvingExperts()
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric")
    recipe = qstats.Recipe([qstats.Rule("_HalvingExperts", sites=("input", "down_proj.input"), spec=spec)])
    x, index, weights = torch.randn(8, 4), torch.tensor([[0], [1]] * 4), torch.ones(8, 1)
    states = qstats.calibrate(experts, [(x, index, weights)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, experts)
    with torch.no_grad():
        with qstats.fake_quantized(experts, qparams, recipe):
            ours = experts(x, index, weights)
        expected = _toy_by_hand(experts, qparams[""], x, index)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_input_and_gate_up_proj_input_both_apply():
    """A recipe with both ``"input"`` and ``"gate_up_proj.input"`` (the same rows, both calibrated):
    the rows are quantized under the first, then the second, as nested modules' input sites are.
    Before, only the second applied and fake_quantized raised that "input" was never found."""
    torch.manual_seed(0)
    experts = _Experts()
    int8, int4 = (qstats.QuantSpec(dtype=dtype, mapping="symmetric") for dtype in ("int8", "int4"))
    recipe = qstats.Recipe([qstats.Rule("_Experts", sites=("input",), spec=int8),
                            qstats.Rule("_Experts", sites=("gate_up_proj.input",), spec=int4)])
    x, index, weights = torch.randn(8, 4), torch.tensor([[0], [1]] * 4), torch.ones(8, 1)
    states = qstats.calibrate(experts, [(x, index, weights)], recipe, progress=False)
    entry = qstats.compute_qparams_tree(states, recipe, experts)[""]
    with torch.no_grad():
        with qstats.fake_quantized(experts, {"": entry}, recipe):
            ours = experts(x, index, weights)
        expected = torch.zeros_like(x)
        for e in range(2):
            token = torch.where(index[:, 0] == e)[0]
            rows = torch.fake_quantize_per_tensor_affine(x[token], float(entry["input"].scale[e]), 0, -128, 127)
            rows = torch.fake_quantize_per_tensor_affine(rows, float(entry["gate_up_proj.input"].scale[e]), 0, -8, 7)
            gate, up = (rows @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
            expected[token] = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T
    assert not torch.equal(ours, experts(x, index, weights))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_gradients_equal_torch_straight_through_per_expert():
    """QAT: the gradients of the input and both stacked parameters through the per-expert input
    sites (some inputs past the calibrated range: clipped, no gradient) equal those of the same
    loop written with torch.fake_quantize_per_tensor_affine."""
    experts, recipe, (x, index, weights), qparams = _toy_calibrated()
    entry, x = qparams[""], x * 3

    def gradients(forward):
        leaf = x.clone().requires_grad_(True)
        experts.zero_grad()
        out = forward(leaf)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return leaf.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()

    def ours(leaf):
        with qstats.fake_quantized(experts, qparams, recipe):
            return experts(leaf, index, weights)

    got, expected = gradients(ours), gradients(lambda leaf: _toy_by_hand(experts, entry, leaf, index))
    assert (got[0] == 0).any() and (got[0] != 0).any()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_runtime_per_channel_scales_of_each_experts_rows(implementation, single_thread_quiet):
    """Dynamic per-channel (``PerAxis(1)``) inputs, several experts' rows in one call: each expert's
    scales over all its rows of the call, as in the eager loop, against torch.ao's
    PerChannelMinMaxObserver of those rows. They were computed from each row alone (0.015 off)."""
    from torch.ao.quantization.observer import PerChannelMinMaxObserver

    layer = _qwen3_experts(implementation)
    generator = torch.Generator().manual_seed(2)
    hidden, index = torch.randn(6, 16, generator=generator), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [5, 6], [7, 0]])
    weights = torch.rand(6, 2, generator=generator)
    spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", granularity=qstats.PerAxis(1))
    # the input site only: every column's largest value is a tie (code 127.5), which the
    # intermediate's last bits, batched_mm's differing from F.linear's, would move
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=("input",), spec=spec, dynamic=True)])
    qparams = qstats.compute_qparams_tree(
        qstats.calibrate(layer, [(hidden, index, weights)], recipe, progress=False), recipe, layer)

    def quantize(t, site, expert):
        if site != "input":
            return t
        observer = PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        observer(t)
        scale, zero_point = observer.calculate_qparams()
        return torch.fake_quantize_per_channel_affine(t, scale, zero_point.to(torch.int32), 1, -128, 127)

    with torch.no_grad():
        with qstats.fake_quantized(layer, qparams, recipe):
            ours = layer(hidden, index, weights)
        expected = _by_hand(layer.experts, quantize, hidden, index, weights)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
