"""Llama 4's stacked experts (transformers' ``Llama4TextExperts``), whose MoE block calls them with dense
rows ``[E * tokens, hidden]`` (the tokens repeated per expert, block ``e`` times expert ``e``'s router
score, zero where the router did not send the token), without a routing tensor: their per-expert
activation sites (``input``, ``gate_up_proj.input``, ``down_proj.input``) against each expert's rows
recomputed in plain torch from the recorded calls (routed: the nonzero rows of its block; with
``all_experts``: every row, as llm-compressor's ``Llama4LinearExperts`` runs each expert under
``moe_calibrate_all_experts``), against the input scales and NVFP4 input global scales llm-compressor
0.14's ``oneshot`` writes, and through ``fake_quantized`` and ``report`` against compressed-tensors'
fake quantization applied expert by expert."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")

from test_moe_families import _batches, _model  # noqa: E402

SITES = ("input", "gate_up_proj.input", "down_proj.input")
MINMAX = qstats.QuantSpec(dtype="int8", mapping="asymmetric", on_uncalibrated="fallback")


def _experts(model) -> dict:
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "Llama4TextExperts"}


def _recorded_inputs(model, batches, weights=None) -> dict:
    """``{path: [(rows [E * T, H], token weight [T] or None)]}``: each experts call's input."""
    modules = _experts(model)
    calls = {path: [] for path in modules}
    current = [None]
    handles = [m.register_forward_pre_hook(lambda _, args, path=path: calls[path].append((args[0].detach(), current[0])))
               for path, m in modules.items()]
    with torch.no_grad():
        for index, batch in enumerate(batches):
            current[0] = None if weights is None else weights[index].reshape(-1)
            model(batch)
    for handle in handles:
        handle.remove()
    return calls


def _rows_by_hand(experts, calls, all_experts: bool) -> dict:
    """``{site: [rows of expert e]}`` in plain torch: expert ``e`` multiplies its block (all rows
    with ``all_experts``) by ``gate_up_proj[e]``; routed, it keeps the block's nonzero rows; rows of
    tokens of weight 0 are left out."""
    num, inter = experts.num_experts, experts.expert_dim
    out = {site: [[] for _ in range(num)] for site in SITES}
    for x, token_weight in calls:
        tokens = x.shape[0] // num
        kept = torch.ones(x.shape[0], dtype=torch.bool) if token_weight is None else (token_weight != 0).repeat(num)
        for e in range(num):
            block = slice(None) if all_experts else slice(e * tokens, (e + 1) * tokens)
            rows, keep = x[block], kept[block]
            if not all_experts:
                keep = keep & rows.ne(0).any(dim=-1)
            gate, up = (rows @ experts.gate_up_proj[e].detach()[None]).squeeze(0).split(inter, dim=-1)
            for site, value in (("input", rows), ("gate_up_proj.input", rows),
                                ("down_proj.input", up * experts.act_fn(gate))):
                out[site][e].append(value[keep])
    return {site: [torch.cat(parts) for parts in per_expert] for site, per_expert in out.items()}


@pytest.mark.parametrize("all_experts", [False, True])
def test_expert_sites_observe_each_experts_rows(all_experts, single_thread_quiet):
    model = _model("llama4_text")  # 8 experts, 2 per token
    recipe = qstats.Recipe([qstats.Rule("Llama4TextExperts", sites=SITES, observer=qstats.minmax, spec=MINMAX)])
    batches = _batches()
    states = qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts)
    calls = _recorded_inputs(model, batches)
    for path, experts in _experts(model).items():
        by_hand = _rows_by_hand(experts, calls[path], all_experts)
        for site in SITES:
            state = states[path][site]
            for e, rows in enumerate(by_hand[site]):
                assert int(state.count[e]) == rows.numel(), (path, site, e)
                assert torch.equal(state.min_val[e], rows.amin()) and torch.equal(state.max_val[e], rows.amax())
        if not all_experts:  # each token in 2 of the 8 experts' blocks: the other rows are zero and left out
            assert int(states[path]["input"].count.sum()) == 2 * sum(x.numel() // 8 for x, _ in calls[path])


@pytest.mark.parametrize("all_experts", [False, True])
def test_tokens_of_weight_zero_are_left_out(all_experts, single_thread_quiet):
    model = _model("llama4_text")
    recipe = qstats.Recipe([qstats.Rule("Llama4TextExperts", sites=SITES, observer=qstats.minmax, spec=MINMAX)])
    batches = _batches()
    weights = [torch.ones(b.shape) for b in batches]
    weights[0][0, :2] = 0
    weights[0][1, 4:] = 0
    by_batch = {id(b): w for b, w in zip(batches, weights)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the weight fits every site
        states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=lambda b: by_batch[id(b)],
                                  all_experts=all_experts)
    calls = _recorded_inputs(model, batches, weights)
    for path, experts in _experts(model).items():
        for site, per_expert in _rows_by_hand(experts, calls[path], all_experts).items():
            for e, rows in enumerate(per_expert):
                assert int(states[path][site].count[e]) == rows.numel()
                assert torch.equal(states[path][site].max_val[e], rows.amax())


def _llama4_folder(tmp_path) -> str:
    from test_moe_families_linearized_names import _llama4  # llm-compressor reads the multimodal config

    folder = str(tmp_path / "float")
    _llama4().save_pretrained(folder)
    return folder


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (12,), generator=generator), torch.randint(1, 128, (7,), generator=generator)]


def _expert_input_recipe(scheme: str):
    """The scheme's input rule (llm-compressor's observer and args) on the experts' activation sites."""
    rule = next(rule for rule in qstats.Recipe.from_scheme(scheme).rules if rule.sites == ("input",))
    return qstats.Recipe([qstats.Rule("Llama4TextExperts", sites=("input", "down_proj.input"), observer=rule.observer,
                                      spec=rule.spec, dynamic=rule.dynamic)])


@pytest.mark.parametrize("all_experts", [True, False])
@pytest.mark.parametrize("scheme,field,key", [("FP8", "scale", "input_scale"),
                                              ("NVFP4", "global_scale", "input_global_scale")])
def test_input_scales_equal_llm_compressor_oneshot(scheme, field, key, all_experts, tmp_path, single_thread_quiet):
    """Each expert's ``gate_proj``/``up_proj`` (``input``) and ``down_proj`` (``down_proj.input``) input
    scale, as llm-compressor's linearized ``Llama4LinearExperts`` writes it, bit for bit."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file

    from _shared import llm_compressor_oneshot

    folder, theirs = _llama4_folder(tmp_path), str(tmp_path / "theirs")
    cls = transformers.Llama4ForConditionalGeneration
    modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head", "re:.*vision.*",
                                                                             "re:.*multi_modal.*"])
    llm_compressor_oneshot(cls.from_pretrained(folder).eval(), _samples(), modifier, theirs,
                           moe_calibrate_all_experts=all_experts)
    tensors = load_file(os.path.join(theirs, "model.safetensors"))
    model = cls.from_pretrained(folder).eval()
    model.set_attn_implementation("eager")  # as llm-compressor's calibration runs it
    plan = _expert_input_recipe(scheme).resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in _samples()], plan, progress=False,
                              all_experts=all_experts)
    qparams = qstats.compute_qparams_tree(states, plan)
    compared = 0
    for path, entry in qparams.items():
        for site, qp in entry.items():
            for e in range(qp.scale.shape[0]):
                for linear in ("gate_proj", "up_proj") if site == "input" else ("down_proj",):
                    expected = tensors[f"{path}.{e}.{linear}.{key}"]
                    ours = getattr(qp, field)[e].reshape(expected.shape).to(expected.dtype)
                    assert torch.equal(ours, expected), (path, site, e, linear)
                    compared += 1
    assert compared == 2 * 4 * 3  # 2 layers, 4 experts, 3 Linears each


def _fake_quantize_by_hand(model, qparams, args):
    """A copy of ``model`` whose experts' forward runs expert by expert, each input and ``down_proj``
    input fake-quantized by compressed-tensors under that expert's static scale (or, for run-time
    scales, its own rows' scales under that expert's global scale)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    reference = copy.deepcopy(model)
    for path, experts in _experts(reference).items():
        def forward(x, experts=experts, path=path):
            num, inter = experts.num_experts, experts.expert_dim
            out = []
            for e, rows in enumerate(x.view(num, -1, x.shape[-1])):
                def quantized(value, site):
                    qp = qparams[path][site]
                    global_scale = None if qp is None or qp.global_scale is None else qp.global_scale[e].reshape(1)
                    if args.dynamic:  # [1, rows, in]: compressed-tensors' "token" scales a 2-D input as one
                        # tensor (docs/differences.md); qstats, as vLLM, per row
                        scale, zero = compute_dynamic_scales_and_zp(value[None], args, torch.nn.Module(), global_scale)
                        scale, zero = scale[0], zero[0]
                    else:
                        scale = qp.scale[e].reshape(1)
                        zero = torch.zeros_like(scale)
                    return fake_quantize(value, scale, zero, args, global_scale=global_scale)

                gate, up = (quantized(rows, "input") @ experts.gate_up_proj[e]).split(inter, dim=-1)
                out.append(quantized(up * experts.act_fn(gate), "down_proj.input") @ experts.down_proj[e])
            return torch.cat(out)

        experts.forward = forward
    return reference


@pytest.mark.parametrize("scheme", ["W8A8", "NVFP4"])
def test_fake_quantized_run_time_scales_take_each_experts_rows(scheme, single_thread_quiet):
    compressed = pytest.importorskip("compressed_tensors.quantization")
    args = compressed.preset_name_to_scheme(scheme, ["Linear"]).input_activations
    model = _model("llama4_text")
    plan = _expert_input_recipe(scheme).resolve(model)
    states = qstats.calibrate(model, _batches(), plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    held_out = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(held_out).logits
        expected = _fake_quantize_by_hand(model, qparams, args)(held_out).logits
        plain = model(held_out).logits
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, plain)


def test_fake_quantized_and_report_take_each_experts_rows(single_thread_quiet):
    compressed = pytest.importorskip("compressed_tensors.quantization")
    args = compressed.preset_name_to_scheme("FP8", ["Linear"]).input_activations
    model = _model("llama4_text")
    plan = _expert_input_recipe("FP8").resolve(model)
    batches = _batches()
    states = qstats.calibrate(model, batches, plan, progress=False)
    qparams = qstats.compute_qparams_tree(states, plan)
    reference = _fake_quantize_by_hand(model, qparams, args)
    held_out = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(held_out).logits
        expected = reference(held_out).logits
        plain = model(held_out).logits
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, plain)

    # scales an eighth of the calibrated ones: the largest rows clip, and zero rows (tokens not routed to
    # the expert, left out) would count as unclipped values
    small = {path: {site: qp._replace(scale=qp.scale / 8) for site, qp in entry.items()} for path, entry in qparams.items()}
    rows = {(row.module, row.site): row for row in qstats.report(states, small, model, plan, [held_out]).rows}
    calls = _recorded_inputs(model, [held_out])
    for path, experts in _experts(model).items():
        by_hand = _rows_by_hand(experts, calls[path], False)
        for site in ("input", "down_proj.input"):
            signal = noise = 0.0
            clipped = total = 0
            for e, part in enumerate(by_hand[site]):
                scale = small[path][site].scale[e].reshape(1)
                quantized = compressed.lifecycle.forward.fake_quantize(part, scale, torch.zeros_like(scale), args)
                signal += float(part.double().pow(2).sum())
                noise += float((part - quantized).double().pow(2).sum())
                clipped += int(((part / scale).abs() > 448 + 16).sum())  # rounds past e4m3fn's maximum (step 32)
                total += part.numel()
            assert rows[(path, site)].sqnr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-5)
            assert clipped and rows[(path, site)].clipped_fraction == pytest.approx(clipped / total)


@pytest.mark.parametrize("all_experts", [False, True])
def test_layerwise_calibration_equals_calibrate(all_experts, tmp_path, single_thread_quiet):
    """``calibrate_layerwise`` (float propagation) on the model built on meta, read from its checkpoint:
    the states of ``calibrate`` on the loaded model, bit for bit."""
    model = _model("llama4_text")
    model.save_pretrained(str(tmp_path))
    recipe = qstats.Recipe([qstats.Rule("Llama4TextExperts", sites=SITES, observer=qstats.minmax, spec=MINMAX)])
    batches = _batches()
    expected = qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = type(model)(model.config).eval()
    states = qstats.calibrate_layerwise(meta, str(tmp_path), batches, recipe, progress=False, all_experts=all_experts)
    assert sorted(states) == sorted(expected) and len(states) == 2
    for path, entry in expected.items():
        for site, state in entry.items():
            assert all(torch.equal(a, b) for a, b in zip(states[path][site], state)), (path, site)


class _BlockWithRouter(torch.nn.Module):
    """A whole MoE block owning stacked experts and its router, called with the tokens alone."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.router = torch.nn.Linear(4, 2, bias=False)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 4, 6))

    def forward(self, hidden_states):
        expert = self.router(hidden_states).argmax(dim=-1)
        return torch.stack([hidden_states[t] @ self.gate_up_proj[e] for t, e in enumerate(expert.tolist())])


def test_a_block_with_its_router_is_not_read_as_dense_rows(single_thread_quiet):
    """Its [T, hidden] tokens (T a multiple of E) are no per-expert blocks: ``input`` raises, naming it."""
    block = _BlockWithRouter().eval()
    recipe = qstats.Recipe([qstats.Rule("_BlockWithRouter", sites=("input",), observer=qstats.minmax, spec=MINMAX)])
    assert qstats.experts.dense_expert_rows(block, (torch.randn(6, 4),), {}) is None
    for all_experts in (False, True):
        with pytest.raises(ValueError, match="experts module ''"):
            qstats.calibrate(block, [torch.randn(6, 4)], recipe, progress=False, all_experts=all_experts)


class _StacksOnly(torch.nn.Module):
    """Stacked experts without routing that run every expert on every token: its [T, hidden] tokens
    look like dense blocks when T is a multiple of E, but each expert sees all of them."""

    def __init__(self):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 4, 6))
        self.down_proj = torch.nn.Parameter(torch.randn(2, 6, 4))

    def forward(self, x):
        hidden = torch.bmm(x.expand(self.num_experts, *x.shape), self.gate_up_proj)
        return torch.bmm(hidden, self.down_proj).sum(0)


@pytest.mark.parametrize("tokens", [3, 4])
def test_stacks_only_experts_of_another_class_are_not_read_as_dense_rows(tokens, single_thread_quiet):
    """Only Llama 4's experts are called with dense per-expert rows; a shape alone cannot tell them
    from tokens every expert sees (expert 1 would have been reported as receiving nothing)."""
    experts = _StacksOnly().eval()
    recipe = qstats.Recipe([qstats.Rule("_StacksOnly", sites=("input",), observer=qstats.minmax, spec=MINMAX)])
    assert qstats.experts.dense_expert_rows(experts, (torch.randn(tokens, 4),), {}) is None
    with pytest.raises(ValueError, match="experts module ''"):
        qstats.calibrate(experts, [torch.randn(tokens, 4)], recipe, progress=False)
