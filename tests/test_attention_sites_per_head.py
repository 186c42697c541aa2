"""One scale (and zero point) per attention head, compressed-tensors' ``strategy: "attn_head"``: the q/k/v
sites see the attention function's ``[batch, heads, tokens, head_dim]`` (`PerHead(1)`), and k_scale,
v_scale (``(kv_heads, 1, 1)``) and their zero points equal llm-compressor's ``oneshot`` bit for bit on
a Llama and a Qwen3 (q/k norms), FP8 and int8 (symmetric and asymmetric), as a kv-cache scheme and as an
attention group; `qstats.fake_quantized` computes the logits of the checkpoint loaded back;
`qstats.calibrate_layerwise` equals `qstats.calibrate`, padding left out of every head."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch

import qstats
from _shared import assert_fake_quantized_logits_equal, assert_site_states_equal, eager_attention_arguments, llm_compressor_oneshot, load_causal_lm

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_attention_sites_oneshot import MODELS, _base, _calibrated, _modifier, _samples  # noqa: E402

HEAD = dict(strategy="attn_head", dynamic=False)
FP8 = dict(num_bits=8, type="float", symmetric=True, **HEAD)
INT8 = dict(num_bits=8, type="int", symmetric=True, **HEAD)
INT8_ASYMMETRIC = dict(num_bits=8, type="int", symmetric=False, **HEAD)
CASES = {"fp8-kv-cache": (FP8, False), "int8-kv-cache": (INT8, False), "int8-asymmetric-kv-cache": (INT8_ASYMMETRIC, False),
         "fp8-attention-group": (FP8, True), "int8-attention-group": (INT8, True),
         "int8-asymmetric-attention-group": (INT8_ASYMMETRIC, True)}


def _quantization_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _exported(model, plan, states, folder: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: every per-head scale is calibrated and exportable
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), folder, plan)
    return load_file(os.path.join(folder, "model.safetensors"))


def _check_query_against_llm_compressor(model, samples, args, tensors: dict) -> None:
    """q_scale (and q_zero_point) equal llm-compressor's own observer of the args fed, batch by batch,
    the queries eager attention receives: oneshot 0.14 leaves them uninitialised (its calibration runs
    eager attention, so compressed-tensors' hooked attention never hands it the query)."""
    from llmcompressor.observers import Observer

    seen = eager_attention_arguments(model, [s[None] for s in samples])
    queries = {path: xs for (path, site), xs in seen.items() if site == "q"}
    assert len(queries) == len(model.model.layers)
    for path, xs in queries.items():
        observer = Observer.load_from_registry("minmax", base_name="q", args=QuantizationArgs(**args))
        for x in xs:
            observer(x)
        reference = observer.get_qparams()
        heads = model.config.num_attention_heads
        assert tuple(tensors[f"{path}.q_scale"].shape) == (heads, 1, 1)
        assert torch.equal(tensors[f"{path}.q_scale"], reference["scale"]), path
        if not args["symmetric"]:
            assert torch.equal(tensors[f"{path}.q_zero_point"], reference["zero_point"].to(torch.int8)), path


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_head_scales_and_zero_points_equal_llm_compressor(tmp_path, family, case):
    args, query = CASES[case]
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _base(base, family)
    samples = _samples()
    llm_compressor_oneshot(load_causal_lm(base), samples, _modifier(args, query), theirs)
    model, plan, states = _calibrated(base, _modifier(args, query), samples)
    our_tensors = _exported(model, plan, states, ours)
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    if args["symmetric"]:  # oneshot also saves zero zero points of symmetric args, which a loaded model does not need
        zero_points = [name for name in their_tensors if name.endswith(("q_zero_point", "k_zero_point", "v_zero_point"))]
        assert all(not their_tensors.pop(name).any() for name in zero_points)
    assert sorted(our_tensors) == sorted(their_tensors)
    kv = [name for name in their_tensors if name.endswith(("k_scale", "v_scale", "k_zero_point", "v_zero_point"))]
    assert len(kv) == (4 if args["symmetric"] else 8)
    kv_heads = model.config.num_key_value_heads
    for name in kv:
        assert tuple(their_tensors[name].shape) == (kv_heads, 1, 1), name
        assert our_tensors[name].dtype == their_tensors[name].dtype, name
        assert torch.equal(our_tensors[name], their_tensors[name]), name
    # every other tensor too, but the query's, which oneshot leaves uninitialised
    differing = [name for name in their_tensors if not torch.equal(our_tensors[name], their_tensors[name])]
    assert all(".q_" in name for name in differing) and (query or not differing)
    our_config, their_config = _quantization_config(ours), _quantization_config(theirs)
    assert our_config["kv_cache_scheme"] == their_config["kv_cache_scheme"]
    if query:
        (our_group,), (their_group,) = our_config["config_groups"].values(), their_config["config_groups"].values()
        assert our_group["input_activations"] == their_group["input_activations"]
        _check_query_against_llm_compressor(model, samples, args, our_tensors)


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("case", ["fp8-kv-cache", "int8-kv-cache", "int8-asymmetric-kv-cache", "fp8-attention-group",
                                  "int8-attention-group"])
def test_fake_quantized_logits_equal_the_checkpoint_loaded_with_compressed_tensors(tmp_path, family, case):
    """compressed-tensors' kv cache (k, v) and hooked attention (q) quantize the loaded checkpoint per
    head; qstats' fake-quantized model computes the same logits (both under sdpa). The kv-cache cases
    load oneshot's checkpoint; the attention groups qstats' (oneshot leaves q_scale uninitialised).
    No asymmetric attention group: compressed-tensors 0.19 loads its q/k/v scales (per tensor too) in
    float16 beside a float32 model (it reads the dtype of the module's first parameter, an int8 zero
    point), and the loaded model's forward fails."""
    args, query = CASES[case]
    base, theirs, ours = (str(tmp_path / name) for name in ("base", "theirs", "ours"))
    _base(base, family)
    samples = _samples()
    model, plan, states = _calibrated(base, _modifier(args, query), samples)  # under eager attention, as oneshot
    model.set_attn_implementation("sdpa")
    qparams = qstats.compute_qparams_tree(states, plan)
    if query:
        qstats.export.compressed_tensors(model, qparams, ours, plan)
    else:
        llm_compressor_oneshot(load_causal_lm(base), samples, _modifier(args, query), theirs)
    loaded = load_causal_lm(ours if query else theirs, attn_implementation="sdpa")
    assert all(tuple(layer.self_attn.k_scale.shape) == (model.config.num_key_value_heads, 1, 1)
               for layer in loaded.model.layers)
    assert (loaded.config._attn_implementation == "ct_hooked_attention") == query
    assert_fake_quantized_logits_equal(model, qparams, plan, loaded, samples[0][None])


def _padded_batches() -> list:
    generator = torch.Generator().manual_seed(3)
    out = []
    for index in range(2):
        ids = torch.randint(1, 64, (2, 6 + index), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, : 2 + index] = 0  # left padding of the second sequence
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _eager_arguments_with_masks(model, batches) -> dict:
    """``{(attention module path, site): [(tensor, attention mask) of each batch]}``: the query, key and
    value eager attention receives over ``batches`` (run with their attention masks), recorded as
    `_shared.eager_attention_arguments` records them, each with its batch's mask."""
    import sys

    modeling = sys.modules[type(model).__module__]
    original = modeling.eager_attention_forward
    paths = {id(module): path for path, module in model.named_modules()}
    out: dict = {}
    mask: list = []

    def recording(attention, query, key, value, *args, **kwargs):
        for site, x in zip("qkv", (query, key, value)):
            out.setdefault((paths[id(attention)], site), []).append((x.detach(), mask[0]))
        return original(attention, query, key, value, *args, **kwargs)

    modeling.eager_attention_forward = recording
    try:
        with torch.no_grad():
            for batch in batches:
                mask[:] = [batch["attention_mask"]]
                model(**batch)
    finally:
        modeling.eager_attention_forward = original
    return out


@pytest.mark.parametrize("family", sorted(MODELS))
def test_layer_by_layer_per_head_states_equal_the_full_model_padding_left_out(tmp_path, family):
    """`calibrate_layerwise` equals `calibrate` for per-head q/k/v, and each head's extremes are those
    of its unpadded tokens of the tensors eager attention receives (recorded by a wrapper of the
    modeling file's function, not by qstats)."""
    static = {**INT8_ASYMMETRIC, "observer": "static_minmax"}
    recipe = qstats.Recipe.from_compressed_tensors({
        "config_groups": {"attention": {"targets": ["re:.*self_attn$"], "input_activations": static}},
        "kv_cache_scheme": static})
    base = str(tmp_path / "base")
    _base(base, family)
    loaded = load_causal_lm(base)
    loaded.set_attn_implementation("eager")  # its attention function is the one recorded below
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(loaded.config).eval()
    batches = _padded_batches()

    def weight(batch):
        return batch["attention_mask"]

    want = qstats.calibrate(loaded, batches, recipe, progress=False, observation_weight=weight)
    got = qstats.calibrate_layerwise(meta, base, batches, recipe, progress=False, observation_weight=weight)
    assert_site_states_equal(got, want)
    # each batch's states merged (static_minmax: exactly) equal both batches', and stack as other states
    plan = recipe.resolve(loaded)
    parts = [qstats.calibrate(loaded, [batch], recipe, progress=False, observation_weight=weight) for batch in batches]
    merged = {path: {site: plan.sites[path][site].observer.merge(parts[0][path][site], parts[1][path][site])
                     for site in entry} for path, entry in want.items()}
    assert_site_states_equal(merged, want)
    assert_site_states_equal(qstats.tree.unstack(qstats.tree.stack(parts))[1], parts[1])
    seen = _eager_arguments_with_masks(loaded, batches)
    assert len(seen) == 3 * len(loaded.model.layers)
    for (path, site), parts in seen.items():
        state = want[path][site]
        heads = parts[0][0].shape[1]
        kept = torch.cat([x.transpose(1, 2)[mask.bool()] for x, mask in parts])  # [tokens, heads, head_dim]
        assert tuple(state.min_val.shape) == (heads,)
        assert torch.equal(state.min_val, kept.amin(dim=(0, 2))), (path, site)
        assert torch.equal(state.max_val, kept.amax(dim=(0, 2))), (path, site)


def test_report_measures_per_head_q_k_v_under_each_heads_scale_padding_left_out():
    """`qstats.report` of per-head sites measures the tensors eager attention receives under each head's
    scale (torch's own per-channel fake quantization along the heads), leaving padding out."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config).eval()
    spec = qstats.QuantSpec("int8", granularity=qstats.PerHead(1))
    recipe = qstats.Recipe([qstats.Rule("re:.*self_attn", sites=("q", "k", "v"), observer=qstats.minmax, spec=spec)])
    batches = _padded_batches()

    def weight(batch):
        return batch["attention_mask"]

    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=weight)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    report = qstats.report(states, qparams, model, recipe, batches, observation_weight=weight)
    rows = {(row.module, row.site): row for row in report.rows}
    seen = _eager_arguments_with_masks(model, batches)
    assert sorted(seen) == sorted(rows)
    for (path, site), parts in seen.items():
        scale = qparams[path][site].scale
        assert tuple(scale.shape) == (parts[0][0].shape[1],)
        signal = noise = 0.0
        for x, mask in parts:
            fq = torch.fake_quantize_per_channel_affine(x, scale, torch.zeros_like(scale, dtype=torch.int32), 1, -128, 127)
            kept, kept_fq = x.transpose(1, 2)[mask.bool()], fq.transpose(1, 2)[mask.bool()]
            signal += float(kept.pow(2).sum())
            noise += float((kept - kept_fq).pow(2).sum())
        assert rows[path, site].sqnr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-4), (path, site)


def test_per_head_q_k_v_of_an_attention_module_without_transformers_config_are_refused_naming_it():
    """An attention module holding no transformers config has its projections' outputs ``[batch,
    tokens, heads * head_dim]`` as q/k/v sites, not split into heads: `PerHead(1)` there would read
    the tokens, so `resolve` refuses it, naming the module (a per-tensor spec resolves)."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)

    model = torch.nn.ModuleDict({"self_attn": Attention()})
    per_head = qstats.QuantSpec("int8", granularity=qstats.PerHead(1))
    rule = qstats.Rule("re:self_attn", sites=("q", "k", "v"), observer=qstats.minmax, spec=per_head)
    with pytest.raises(ValueError, match=r"site 'q' of 'self_attn' \(Attention\) is per head .* no transformers config"):
        qstats.Recipe([rule]).resolve(model)
    per_tensor = qstats.Rule("re:self_attn", sites=("q", "k", "v"), observer=qstats.minmax, spec=qstats.QuantSpec("int8"))
    assert sorted(qstats.Recipe([per_tensor]).resolve(model).sites["self_attn"]) == ["k", "q", "v"]
