"""Stacked experts that transformers stores transposed (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``)
with gate and up as halves and per-expert biases, built by its ``use_experts_implementation(is_transposed=True,
has_bias=True)`` (the OpenAI privacy filter's ``OpenAIPrivacyFilterExperts``): llm-compressor 0.14's generic
``LinearExperts2D`` reads them as per-expert Linears (``gate_up_proj[e, :, :I].T`` is gate, biases copied).
The references: those Linears, and ``oneshot``'s checkpoint of the same model and scheme."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

E, HIDDEN, INTER = 4, 32, 16
EXPERTS = "model.layers.{}.mlp.experts"
IGNORE = ["score", "re:.*router"]


def _config():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(
            "openai_privacy_filter", num_hidden_layers=2, num_local_experts=E, num_experts_per_tok=2, vocab_size=64,
            hidden_size=HIDDEN, intermediate_size=INTER, head_dim=16, num_attention_heads=2, num_key_value_heads=1,
            sliding_window=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=0, num_labels=3)


def _model():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForTokenClassification.from_config(_config()).eval()
    with torch.no_grad():  # the experts' biases start at zero: draw them too
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.normal_(0, 0.1)
    return model


def test_stacks_read_as_llm_compressors_linear_experts():
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    experts = _model().get_submodule(EXPERTS.format(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linear = LinearExperts2D.get_linear_experts_cls(type(experts)).from_experts_module(experts, _config())
    assert qstats.experts.linearized_layout_problem(experts) is None
    gate_up_layout = qstats.experts.stack_layout(experts, "gate_up_proj")
    down_layout = qstats.experts.stack_layout(experts, "down_proj")
    gate_up = gate_up_layout.canonical(experts.gate_up_proj.detach())
    down = down_layout.canonical(experts.down_proj.detach())
    gate_up_bias = gate_up_layout.canonical_bias(getattr(experts, gate_up_layout.bias).detach())
    down_bias = getattr(experts, down_layout.bias).detach()
    for expert in range(E):
        theirs = linear[expert]
        assert torch.equal(gate_up[expert, :INTER], theirs.gate_proj.weight)
        assert torch.equal(gate_up[expert, INTER:], theirs.up_proj.weight)
        assert torch.equal(down[expert], theirs.down_proj.weight)
        assert torch.equal(gate_up_bias[expert, :INTER], theirs.gate_proj.bias)
        assert torch.equal(gate_up_bias[expert, INTER:], theirs.up_proj.bias)
        assert torch.equal(down_bias[expert], theirs.down_proj.bias)


def test_linearized_names_are_llm_compressors_modules():
    from llmcompressor.modeling.moe.linearize import linearize_moe

    model, fresh = _model(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        linearize_moe(fresh)
    theirs = [name for name, module in fresh.named_modules() if isinstance(module, torch.nn.Linear) and ".experts." in name]
    ours = [name for layer in range(2) for name in qstats.experts.linearized_experts(
        EXPERTS.format(layer), model.get_submodule(EXPERTS.format(layer)))]
    assert ours == theirs and len(ours) == 2 * 3 * E
    first = EXPERTS.format(0)  # with a site: only the Linears behind it
    down = [name for name in theirs if name.startswith(first + ".") and name.endswith(".down_proj")]
    assert qstats.experts.linearized_experts(first, model.get_submodule(first), "down_proj") == down and len(down) == E


def _saved_model(tmp_path) -> tuple:
    """The model saved to ``tmp_path/float``, the folders of llm-compressor's and qstats' checkpoints,
    and three calibration samples: ``(float, llm_compressor, qstats, samples)``."""
    folders = [str(tmp_path / name) for name in ("float", "llm_compressor", "qstats")]
    _model().save_pretrained(folders[0])
    generator = torch.Generator().manual_seed(1)
    return (*folders, [torch.randint(1, 64, (12,), generator=generator) for _ in range(3)])


def _their_and_our_checkpoints(tmp_path, scheme: str) -> tuple:
    """``oneshot``'s checkpoint of the model under ``scheme`` and qstats' (``Recipe.from_scheme`` with
    ``all_experts``, as oneshot calibrates every expert): ``(our tensors, theirs, our config, theirs)``."""
    from _shared import llm_compressor_oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    saved, theirs, ours, samples = _saved_model(tmp_path)
    model_class = transformers.AutoModelForTokenClassification
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm_compressor_oneshot(model_class.from_pretrained(saved).eval(), samples,
                               QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE), theirs)
        model = model_class.from_pretrained(saved).eval()
    model.set_attn_implementation("eager")  # as llm-compressor calibrates
    plan = qstats.Recipe.from_scheme(scheme, ignore=IGNORE, experts="OpenAIPrivacyFilterExperts").resolve(model)
    states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False, all_experts=True)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    configs = []
    for folder in (ours, theirs):
        with open(os.path.join(folder, "config.json")) as file:
            configs.append(json.load(file)["quantization_config"])
    return (load_file(os.path.join(ours, "model.safetensors")), load_file(os.path.join(theirs, "model.safetensors")),
            *configs)


def test_w8a8_checkpoint_equals_llm_compressor_oneshot(tmp_path, single_thread_quiet):
    """Every tensor bit for bit (per-expert int8 weights, their biases, weight scales; inputs dynamic),
    and the same scheme and ignore list; the config group's targets name the unpacked experts (theirs: Linear)."""
    from _shared import bit_equal

    ours, theirs, our_config, their_config = _their_and_our_checkpoints(tmp_path, "W8A8")
    assert sorted(ours) == sorted(theirs)
    assert f"{EXPERTS.format(1)}.3.up_proj.bias" in ours and f"{EXPERTS.format(1)}.3.up_proj.weight_scale" in ours
    assert not [name for name in theirs if not bit_equal(ours[name], theirs[name])]
    (our_group,), (their_group,) = (list(config.pop("config_groups").values()) for config in (our_config, their_config))
    modules = {key.rsplit(".", 1)[0] for key in theirs if key.endswith(".weight_scale")}
    for target in our_group.pop("targets"):
        assert any(re.fullmatch(target[3:], m) if target.startswith("re:") else target == m for m in modules), target
    their_group.pop("targets")
    assert our_group == their_group
    assert sorted(our_config.pop("ignore")) == sorted(their_config.pop("ignore"))
    assert our_config == their_config


def test_fp8_per_tensor_gate_and_up_equal_llm_compressor_oneshot(tmp_path, single_thread_quiet):
    """FP8 (per-tensor): gate and up each get their own weight scale from the transposed halves, as
    oneshot's Linears do; every weight and scale bit for bit but the input scales of down_proj after the
    first MoE layer, which differ in the last bits (docs/differences.md, linearized experts' sums)."""
    from _shared import bit_equal

    ours, theirs, _, _ = _their_and_our_checkpoints(tmp_path, "FP8")
    assert sorted(ours) == sorted(theirs)
    gate, up = (ours[f"{EXPERTS.format(0)}.1.{name}.weight_scale"] for name in ("gate_proj", "up_proj"))
    assert not torch.equal(gate, up)
    differing = [name for name in theirs if not bit_equal(ours[name], theirs[name])]
    assert all(name.startswith(EXPERTS.format(1)) and name.endswith("down_proj.input_scale") for name in differing)
    for name in differing:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=0)


def _routed_rows(model, batches) -> dict:
    """``{experts path: [(input rows, down_proj input rows, expert)]}``: each expert's routed tokens and
    ``act(gate) * up`` of them, recomputed in plain torch as the experts' forward computes them (in
    float32 from the cast slices) from the calls a pre-hook records."""
    calls, handles = {}, []
    for path, module in model.named_modules():
        if type(module).__name__ == "OpenAIPrivacyFilterExperts":
            def hook(module, args, kwargs, path=path):
                hidden, index = args[0], args[1] if len(args) > 1 else kwargs["router_indices"]
                calls.setdefault(path, []).append((module, hidden.detach(), index))
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    rows = {}
    with torch.no_grad():
        for path, seen in calls.items():
            for module, hidden, index in seen:
                for expert in range(E):
                    x = hidden[(index == expert).any(dim=-1)]
                    gate_up = x.float() @ module.gate_up_proj[expert].float() + module.gate_up_proj_bias[expert].float()
                    rows.setdefault(path, []).append((x, module._apply_gate(gate_up), expert))
    return rows


def test_bf16_eager_experts_observe_the_rows_of_their_cast_slices(single_thread_quiet):
    """The eager forward multiplies by ``gate_up_proj[e].float()``, a copy of the bf16 slice: each
    expert's ``input`` and ``down_proj.input`` states hold the min/max of its routed rows (they were
    refused, no matmul with a slice being found)."""
    model = _model().to(torch.bfloat16)
    model.set_experts_implementation("eager")
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(1, 64, (1, 12), generator=generator) for _ in range(2)]
    spec = qstats.QuantSpec(dtype="int8", on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("OpenAIPrivacyFilterExperts", sites=("input", "down_proj.input"), spec=spec)])
    states = qstats.calibrate(model, batches, recipe, progress=False)
    for path, seen in _routed_rows(model, batches).items():
        for site, column in (("input", 0), ("down_proj.input", 1)):
            state = states[path][site]
            for expert in range(E):
                values = torch.cat([entry[column].float().flatten() for entry in seen if entry[2] == expert])
                assert int(state.count[expert]) == values.numel(), (path, site, expert)
                if values.numel():
                    assert float(state.min_val[expert]) == float(values.min()), (path, site, expert)
                    assert float(state.max_val[expert]) == float(values.max()), (path, site, expert)


def test_gptq_layerwise_codes_equal_llm_compressor_oneshot(tmp_path, single_thread_quiet):
    """W8A8 GPTQ (every expert on every token): the first layer's int8 codes, experts' included, equal those
    of llm-compressor's GPTQModifier (basic pipeline), whose inputs do not depend on GPTQ's changes, but for
    a few codes of at most two tensors on some CPUs."""
    from _shared import llm_compressor_oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    folder, theirs, ours, samples = _saved_model(tmp_path)
    model_class = transformers.AutoModelForTokenClassification
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm_compressor_oneshot(model_class.from_pretrained(folder).eval(), samples,
                               GPTQModifier(targets="Linear", scheme="W8A8", ignore=IGNORE), theirs, "basic",
                               moe_calibrate_all_experts=True)
        with torch.device("meta"):
            meta = model_class.from_config(transformers.AutoConfig.from_pretrained(folder)).eval()
        model = model_class.from_pretrained(folder).eval()
    for each in (meta, model):
        each.set_attn_implementation("eager")
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=IGNORE)
    result = qstats.gptq_layerwise(meta, folder, [{"input_ids": s[None]} for s in samples], recipe, progress=False,
                                   all_experts=True)
    model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), ours, plan)
    our_tensors, their_tensors = (load_file(os.path.join(f, "model.safetensors")) for f in (ours, theirs))
    assert sorted(our_tensors) == sorted(their_tensors)
    codes = [name for name in their_tensors if name.startswith("model.layers.0.") and name.endswith(".weight")
             and their_tensors[name].dtype == torch.int8]
    assert len([name for name in codes if ".experts." in name]) == 3 * E
    # equal, up to the float rounding of the Hessian sums (an AVX-512/AMX CPU flips a few codes of one expert)
    same = {name: float((our_tensors[name] == their_tensors[name]).float().mean()) for name in codes}
    assert sum(value < 1.0 for value in same.values()) <= 2 and min(same.values()) >= 0.995, same
