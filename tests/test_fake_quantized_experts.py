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


@pytest.fixture
def per_row_dynamic_tokens(monkeypatch):
    """compressed-tensors' dynamic ``"token"`` scales of a 2-D input, one per row (its 3-D case)."""
    import compressed_tensors.quantization.lifecycle.forward as forward

    original = forward.compute_dynamic_scales_and_zp

    def per_row(value, args, module, global_scale=None):
        if value.ndim != 2 or args.strategy != "token":
            return original(value=value, args=args, module=module, global_scale=global_scale)
        scale, zero_point = original(value=value[None], args=args, module=module, global_scale=global_scale)
        return scale[0], None if zero_point is None else zero_point[0]

    monkeypatch.setattr(forward, "compute_dynamic_scales_and_zp", per_row)


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


def test_each_expert_input_under_its_own_scale():
    """Against the module recomputed in plain torch: each expert's rows fake-quantized with
    torch.fake_quantize_per_tensor_affine under that expert's scale."""
    experts, recipe, (x, index, weights), qparams = _toy_calibrated()
    entry = qparams[""]
    with torch.no_grad():
        with qstats.fake_quantized(experts, qparams, recipe):
            ours = experts(x, index, weights)
        expected = torch.zeros_like(x)
        for e in range(2):
            token = torch.where(index[:, 0] == e)[0]

            def quantize(t, site):
                return torch.fake_quantize_per_tensor_affine(t, float(entry[site].scale[e]), 0, -128, 127)

            h = quantize(x[token], "input") @ experts.gate_up_proj[e].T
            gate, up = h.chunk(2, dim=-1)
            expected[token] = quantize(torch.nn.functional.silu(gate) * up, "down_proj.input") @ experts.down_proj[e].T
    assert not torch.equal(entry["input"].scale[0], entry["input"].scale[1])
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_an_expert_input_whose_matmul_is_not_found_is_refused():
    experts, recipe, batch, qparams = _toy_calibrated()
    experts.unrecognised = True
    with pytest.raises(ValueError, match=r"\['input'\] of the experts module ''"):
        with qstats.fake_quantized(experts, qparams, recipe):
            experts(*batch)
