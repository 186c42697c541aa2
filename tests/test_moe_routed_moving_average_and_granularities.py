"""Routed calibration of a tiny random Qwen3-MoE (float32 and bfloat16) over batches with left padding, one-token batches, a
batch of padding only (the first) and one whose tokens are all padding but one (experts miss whole batches):

- a moving average (llm-compressor's ``minmax``) on the experts' ``input`` and ``down_proj.input``
  against llm-compressor 0.14's own ``minmax`` observer fed, call by call, what its linearized experts
  compute for each expert: with ``moe_calibrate_all_experts=False`` the routed tokens through
  ``F.linear`` (an expert with no token is fed nothing: its observer skips an empty tensor), with
  ``True`` (``all_experts``) every token; padding left out;
  scales and zero points bit for bit (in bfloat16 in the activations' dtype, as llm-compressor
  computes them: ``from_compressed_tensors(args, observed_dtype=)``) under transformers' ``eager`` and ``grouped_mm`` experts (the
  moving average moves once per call that reaches the expert, never on a call that does not);
- per-channel (``PerAxis(-1)``) and per-tensor states of the same sites, routed and ``all_experts``,
  against each expert's amin/amax over exactly the tokens routed to it (or every token), padding out.
"""

import warnings

import pytest
import torch
from _shared import qwen3_moe_config

import qstats

transformers = pytest.importorskip("transformers")

E = 8
SITES = ("input", "down_proj.input")


@pytest.fixture(autouse=True)
def one_thread():
    """The expected extremes recompute each expert's rows with their own matmuls: on one thread they
    round as the model's forward does; on two, a float32 product of another row count may not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request):
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(qwen3_moe_config(num_experts=E, hidden_size=32, moe_intermediate_size=16,
                                                             head_dim=16)).eval().to(request.param)


def _batches():
    generator = torch.Generator().manual_seed(5)
    batches = []
    for index, length in enumerate((1, 3, 2, 5, 1, 4)):
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, : length - 1] = 0  # left padding: the second row keeps its last token
        if index == 2:  # all padding but one token
            mask[:] = 0
            mask[0, 0] = 1
        if index == 0:  # all padding: no expert observes the first batch
            mask[:] = 0
        batches.append({"input_ids": torch.randint(1, 64, (2, length), generator=generator), "attention_mask": mask})
    return batches


def _calls(model, batches):
    """``[(path, hidden_states, top_k_index, kept tokens)]``: every call of the stacked experts."""
    calls, kept = [], [None]
    hooks = [module.register_forward_pre_hook(
        lambda _, args, kwargs, path=path: calls.append((path, args[0].detach().clone(), args[1].clone(), kept[0])),
        with_kwargs=True) for path, module in model.named_modules() if type(module).__name__ == "Qwen3MoeExperts"]
    try:
        with torch.no_grad():
            for batch in batches:
                kept[0] = batch["attention_mask"].reshape(-1) != 0
                model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def _per_expert_rows(experts, x, index, kept, expert, every=False):
    """``{site: rows}`` the linearized expert ``expert`` computes on in one call: its routed tokens
    (all tokens when ``every``) through ``F.linear``, padding dropped after the matmul."""
    token = torch.arange(x.shape[0]) if every else torch.where(index == expert)[0]
    gate, up = torch.nn.functional.linear(x[token], experts.gate_up_proj[expert]).chunk(2, dim=-1)
    keep = kept[token]
    return {"input": x[token][keep], "down_proj.input": (experts.act_fn(gate) * up)[keep]}


def _calibrate(model, batches, recipe, all_experts=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qstats.UncalibratedWarning)
        return qstats.calibrate(model, batches, recipe, progress=False, all_experts=all_experts,
                                observation_weight=lambda batch: batch["attention_mask"])


@pytest.mark.parametrize("implementation, all_experts", [("eager", False), ("grouped_mm", False), ("eager", True)],
                         ids=["eager-routed", "grouped_mm-routed", "eager-all_experts"])
def test_moving_average_equals_llm_compressor_minmax_per_call(model, implementation, all_experts):
    observers = pytest.importorskip("llmcompressor.observers")
    from compressed_tensors.quantization import QuantizationArgs

    model.set_experts_implementation(implementation)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor", observer="minmax")
    # the scales in the activations' dtype, as llm-compressor computes them (scale_dtype None)
    dtype = model.model.embed_tokens.weight.dtype
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype).replace(on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=SITES, spec=spec,
                                        observer=lambda s: qstats.moving_average_minmax(s, 0.01))])
    batches = _batches()
    qparams = qstats.compute_qparams_tree(_calibrate(model, batches, recipe, all_experts), recipe, model)
    calls = _calls(model, batches)
    checked = 0
    for path in sorted({call[0] for call in calls}):
        experts = model.get_submodule(path)
        reference = {(site, e): observers.Observer.load_from_registry("minmax", base_name="input",
                                                                      args=args.model_copy(deep=True))
                     for site in SITES for e in range(E)}
        fed = dict.fromkeys(reference, False)
        for called, x, index, kept in calls:
            for expert in range(E) if called == path else ():
                for site, rows in _per_expert_rows(experts, x, index, kept, expert, all_experts).items():
                    reference[site, expert](rows)  # an empty tensor is skipped by llm-compressor
                    fed[site, expert] |= rows.numel() > 0
        for (site, expert), observer in reference.items():
            ours = qparams[path][site]
            assert bool(ours.calibrated[expert]) == fed[site, expert], (path, site, expert)
            if not fed[site, expert]:
                assert float(ours.scale[expert]) > 0
                continue
            theirs = observer.get_qparams()
            assert torch.equal(ours.scale[expert].reshape(1), theirs["scale"].reshape(1)), (path, site, expert)
            assert int(ours.zero_point[expert]) == int(theirs["zero_point"]), (path, site, expert)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all_experts"])
@pytest.mark.parametrize("granularity", [qstats.PerTensor(), qstats.PerAxis(-1)], ids=["tensor", "channel"])
def test_expert_activation_extremes_are_each_experts_tokens_only(model, all_experts, granularity):
    model.set_experts_implementation("eager")
    spec = qstats.QuantSpec(dtype="int8", mapping="asymmetric", granularity=granularity, on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("Qwen3MoeExperts", sites=SITES, observer=qstats.minmax, spec=spec)])
    batches = _batches()
    states = _calibrate(model, batches, recipe, all_experts)
    calls = _calls(model, batches)
    reduce_dims = (0,) if isinstance(granularity, qstats.PerAxis) else (0, 1)
    empty = 0
    for path in sorted({call[0] for call in calls}):
        experts = model.get_submodule(path)
        for expert in range(E):
            rows = {site: [] for site in SITES}
            for called, x, index, kept in calls:
                if called == path:
                    for site, part in _per_expert_rows(experts, x, index, kept, expert, all_experts).items():
                        rows[site].append(part)
            for site in SITES:
                state = states[path][site]
                seen = torch.cat(rows[site])
                if not seen.shape[0]:
                    empty += 1
                    assert not bool((state.min_val[expert] <= state.max_val[expert]).any()), (path, site, expert)
                    continue
                for ours, theirs in ((state.min_val[expert], seen.amin(reduce_dims)),
                                     (state.max_val[expert], seen.amax(reduce_dims))):
                    assert torch.equal(ours.reshape(theirs.shape), theirs), (path, site, expert)
    assert not all_experts or empty == 0
