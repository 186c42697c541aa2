"""`qstats.gptq_layerwise` against llm-compressor 0.14's ``oneshot`` with a ``GPTQModifier``
(checkpoints compared code by code), and against the same steps written as a loop over the
loaded model (`qstats.calibrate` + `qstats.gptq`, one layer after the other)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import qstats
from _llmc_hessian import llm_compressor_hessian
from _oneshot import saved_random_model, token_samples
from _packed import packed_codes
from _shared import fork_ranks, gloo_group, llm_compressor_oneshot, qwen3_moe_config, word_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("llmcompressor")
from safetensors.torch import load_file  # noqa: E402

TOKENS = 16
MOE_IGNORE = ["lm_head", "re:.*mlp.gate$"]


@pytest.fixture(scope="module")
def samples():
    return token_samples(8, TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return saved_random_model(tmp_path_factory, "gptq_llama", transformers.LlamaForCausalLM, config)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    config = qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                              head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    return saved_random_model(tmp_path_factory, "gptq_qwen3_moe", transformers.Qwen3MoeForCausalLM, config)


def _batches(samples):
    return [{"input_ids": s[None], "attention_mask": torch.ones(1, TOKENS, dtype=torch.long)} for s in samples]


def _oneshot_gptq(path, samples, out, pipeline, ignore, scheme="W4A16"):
    """llm-compressor's GPTQ (its defaults: actorder static, block 128, dampening 0.01)."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme=scheme, ignore=ignore), out, pipeline)
    return load_file(f"{out}/model.safetensors")


def _ours(path, samples, out, recipe, **options):
    """gptq_layerwise on the model built on meta (eager attention, as llm-compressor calibrates), then
    the export of the loaded model with its weights."""
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    meta.set_attn_implementation("eager")
    result = qstats.gptq_layerwise(meta, path, _batches(samples), recipe, progress=False, **options)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    missing = set(result.weights) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), out, plan)
    return result, load_file(f"{out}/model.safetensors")


def _same_codes(ours, theirs, names):
    same = sum(int((packed_codes(ours, name) == packed_codes(theirs, name)).sum()) for name in names)
    return same / sum(packed_codes(theirs, name).numel() for name in names)


def _packed(tensors):
    return sorted(name[: -len(".weight_packed")] for name in tensors if name.endswith(".weight_packed"))


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_llama_w4a16_equals_llm_compressor_sequential_gptq(llama, samples, tmp_path, scheme):
    """Sequential GPTQ: each layer's Hessians come from the outputs of the GPTQ'd layers before it.
    Every tensor of the checkpoint is llm-compressor's, bit for bit: `gptq_layerwise` sums the
    Hessians as its ``accumulate_hessian`` does (rows times sqrt(2), then their product); summed as
    ``x^T x`` their 1e-7 rounding flipped codes, carried through the layers (W4A16_ASYM: 81% of the
    last down_proj's codes)."""
    theirs = _oneshot_gptq(llama, samples, str(tmp_path / "theirs"), "sequential", ["lm_head"], scheme)
    result, ours = _ours(llama, samples, str(tmp_path / "ours"), qstats.Recipe.from_scheme(scheme, ignore=["lm_head"]))
    names = _packed(theirs)
    assert len(names) == 14 and _packed(ours) == names
    assert len(result.weights) == 14
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_a_gptq_modifier_read_as_a_recipe_with_its_options_passed_equals_its_oneshot(llama, samples, tmp_path):
    """A migration: the recipe read from the GPTQModifier itself (an mse weight observer, groups of 32),
    its algorithm options (block_size 32, dampening_frac 0.05, actorder "weight") passed to
    `gptq_layerwise` by hand, as the warning says: every tensor of the checkpoint is oneshot's (with
    the Hessians summed as ``x^T x``, before 2fd5b9b, the first layer's down_proj already differed)."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
               "observer": "mse"}

    def modifier():
        return GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"],
                            block_size=32, dampening_frac=0.05, actorder="weight")

    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    llm_compressor_oneshot(model, samples, modifier(), str(tmp_path / "theirs"), "sequential")
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    with pytest.warns(UserWarning, match="algorithm options"):
        recipe = qstats.Recipe.from_compressed_tensors(modifier())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, ours = _ours(llama, samples, str(tmp_path / "ours"), recipe, block_size=32, dampening=0.05,
                        actorder="weight")
    assert sorted(ours) == sorted(theirs) and len(_packed(theirs)) == 14
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_padded_batches_equal_llm_compressor_which_keeps_the_padding_rows(llama, tmp_path):
    """Batches of two sequences padded to one length (one batch padded on the right, one on the
    left): llm-compressor's ``accumulate_hessian`` takes no mask and sums the padding rows too, as
    `gptq_layerwise` does without ``observation_weight``: every tensor of the checkpoint is oneshot's.
    With ``observation_weight=attention_mask`` the padding rows are left out and the codes differ."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from torch.utils.data import DataLoader

    generator = torch.Generator().manual_seed(3)
    batches = []
    for lengths, left in (((16, 11), False), ((14, 9), True)):
        ids, mask = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long)
        for row, length in enumerate(lengths):
            kept = slice(16 - length, 16) if left else slice(0, length)
            ids[row, kept], mask[row, kept] = torch.randint(1, 64, (length,), generator=generator), 1
        batches.append({"input_ids": ids, "attention_mask": mask})
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oneshot(model=model, dataset=DataLoader(batches, batch_size=None), processor=word_tokenizer(),
                recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]), pipeline="sequential",
                num_calibration_samples=4, shuffle_calibration_samples=False)
        model.save_pretrained(str(tmp_path / "theirs"), save_compressed=True)
    theirs = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"])
    config = transformers.AutoConfig.from_pretrained(llama)
    results = []
    for observation_weight in (None, lambda batch: batch["attention_mask"]):
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config).eval()
        meta.set_attn_implementation("eager")
        results.append(qstats.gptq_layerwise(meta, llama, batches, recipe, progress=False,
                                             observation_weight=observation_weight))
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    model.load_state_dict(results[0].weights, strict=False)
    plan = recipe.resolve(model)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(results[0].states, plan),
                                     str(tmp_path / "ours"), plan)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert any(not torch.equal(results[1].weights[name], weight) for name, weight in results[0].weights.items())


@pytest.mark.parametrize("scheme, codes", [("FP8_DYNAMIC", "weight"), ("NVFP4A16", "weight_packed")])
def test_float_weight_formats_equal_llm_compressor_sequential_gptq(llama, samples, tmp_path, scheme, codes):
    """llm-compressor GPTQs float weight formats too (FP8 per channel, NVFP4 with its fused global
    scales), propagating with quantization disabled (FP8_DYNAMIC's inputs stay float): every scale
    and code equal. NVFP4's coarse grid makes GPTQ of the second layer chaotic (qstats against itself
    with dampening 0.0100001 keeps 80% of down_proj's packed bytes): with its Hessians summed as
    ``x^T x``, not as llm-compressor sums them, 78% of them were llm-compressor's."""
    theirs = _oneshot_gptq(llama, samples, str(tmp_path / "theirs"), "sequential", ["lm_head"], scheme)
    result, ours = _ours(llama, samples, str(tmp_path / "ours"), qstats.Recipe.from_scheme(scheme, ignore=["lm_head"]))
    assert len(result.weights) == 14 and sorted(ours) == sorted(theirs)
    names = sorted(name[: -len(".weight_scale")] for name in theirs if name.endswith(".weight_scale"))
    assert len(names) == 14
    same = total = 0
    for name in theirs:
        if name in {f"{quantized}.{codes}" for quantized in names}:
            equal = ours[name].view(torch.uint8) == theirs[name].view(torch.uint8)
            same, total = same + int(equal.sum()), total + equal.numel()
        else:
            assert torch.equal(ours[name], theirs[name]), name
    assert same == total
    rtn = load_file(_ours_rtn(llama, samples, str(tmp_path / "rtn"), scheme))
    assert any(not torch.equal(rtn[f"{name}.{codes}"], theirs[f"{name}.{codes}"]) for name in names)  # not RTN


def _ours_rtn(path, samples, out, scheme):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    plan = qstats.Recipe.from_scheme(scheme, ignore=["lm_head"]).resolve(model)
    states = qstats.calibrate(model, _batches(samples[:1]), plan, progress=False)
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), out, plan)
    return f"{out}/model.safetensors"


def _loop_gptq(path, samples, recipe):
    """The same algorithm as a plain loop over the loaded model: per layer, the Hessians of its
    quantized weights (`qstats.calibrate` of the whole model), then `qstats.gptq` of each weight,
    each Hessian divided by llm-compressor's sample count (one per batch: every batch is one
    sequence, and every expert sees each batch's tokens as one 2-D input), on llm-compressor's Hessian
    sums (`llm_compressor_hessian`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model.set_attn_implementation("eager")
    plan = recipe.resolve(model)
    weights = {}
    for index in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        hessian_rules = [
            qstats.Rule((prefix + "self_attn.q_proj", prefix + "self_attn.k_proj", prefix + "self_attn.v_proj",
                         prefix + "self_attn.o_proj"), sites=("input",), observer=llm_compressor_hessian),
            qstats.Rule(prefix + "mlp.experts", sites=("gate_up_proj.input", "down_proj.input"),
                        observer=llm_compressor_hessian),
        ]
        with torch.no_grad():
            hessians = qstats.calibrate(model, _batches(samples), qstats.Recipe(hessian_rules), progress=False,
                                        all_experts=True)
            states = qstats.calibrate(model, _batches(samples[:1]), plan, progress=False)
        qparams = qstats.compute_qparams_tree(states, plan)
        for path_, sites in hessians.items():
            for hessian_site, state in sites.items():
                site = "weight" if hessian_site == "input" else hessian_site[: -len(".input")]
                module = plan.modules[path_]
                state = state._replace(total=state.total / 2, count=torch.full_like(state.count, len(samples)))
                quantized, _, _ = qstats.gptq(getattr(module, site), state, plan.site(path_, site).spec,
                                              qparams=qparams[path_][site], actorder="static")
                with torch.no_grad():
                    getattr(module, site).copy_(quantized)
                weights[f"{path_}.{site}"] = quantized
    return weights


def test_moe_experts_equal_llm_compressor_in_the_first_layer_and_a_plain_loop_in_all(moe, samples, tmp_path):
    """Qwen3-MoE with stacked experts (their Hessians per expert over all tokens, llm-compressor's
    ``moe_calibrate_all_experts``). The first layer's inputs do not depend on GPTQ: there every
    code equals llm-compressor's (basic pipeline, linearized experts). Every layer's weights equal
    the plain loop's bit for bit."""
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=MOE_IGNORE, experts="Qwen3MoeExperts")
    result, ours = _ours(moe, samples[:4], str(tmp_path / "ours"), recipe, all_experts=True)
    assert "model.layers.1.mlp.experts.gate_up_proj" in result.weights
    theirs = _oneshot_gptq(moe, samples[:4], str(tmp_path / "theirs"), "basic", MOE_IGNORE)
    names = _packed(theirs)
    assert _packed(ours) == names
    first_layer = [name for name in names if name.startswith("model.layers.0.")]
    assert len(first_layer) == 4 + 3 * 4
    assert _same_codes(ours, theirs, first_layer) == 1.0
    loop = _loop_gptq(moe, samples[:4], recipe)
    assert sorted(loop) == sorted(result.weights)
    for name, weight in loop.items():
        assert torch.equal(result.weights[name], weight), name
    config = transformers.AutoConfig.from_pretrained(moe)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    meta.set_attn_implementation("eager")
    chunked = qstats.gptq_layerwise(meta, moe, _batches(samples[:4]), recipe, progress=False, all_experts=True,
                                    experts_at_once=3, device="cpu")  # experts 0-2, then 3; every move
    assert all(torch.equal(chunked.weights[name], weight) for name, weight in result.weights.items())


def test_llm_compressor_sequential_pipeline_attends_both_ways_on_qwen3_moe(moe, samples, tmp_path):
    """docs/differences.md: on Qwen3-MoE (transformers 5), llm-compressor 0.14's sequential pipeline
    computes attention without the causal mask when the attention mask is all ones: its first
    o_proj equals GPTQ with the Hessian of bidirectional attention, not that of the model's."""
    theirs = _oneshot_gptq(moe, samples[:4], str(tmp_path / "theirs"), "sequential", MOE_IGNORE)
    model = transformers.AutoModelForCausalLM.from_pretrained(moe).eval()
    model.set_attn_implementation("eager")
    o_proj = "model.layers.0.self_attn.o_proj"
    spec = qstats.Recipe.from_scheme("W4A16").rules[0].spec
    weight = model.get_submodule(o_proj).weight.detach()
    observer = qstats.minmax(spec)
    qparams = qstats.compute_qparams(observer.update(observer.init(weight), weight), spec)
    recipe = qstats.Recipe([qstats.Rule(o_proj, sites=("input",), observer=qstats.hessian)])

    def codes(mask):
        batches = [{"input_ids": s[None], "attention_mask": mask} for s in samples[:4]]
        with torch.no_grad():
            state = qstats.calibrate(model, batches, recipe, progress=False)[o_proj]["input"]
        return qstats.gptq(weight, state, spec, qparams=qparams, actorder="static")[1]

    causal = codes(torch.ones(1, TOKENS, dtype=torch.long))
    both_ways = codes(torch.ones(1, 1, TOKENS, TOKENS, dtype=torch.bool))
    assert torch.equal(both_ways, packed_codes(theirs, o_proj))
    assert not torch.equal(causal, packed_codes(theirs, o_proj))


def test_a_recipe_without_linear_weights_and_a_bad_chunk_are_refused(llama, samples):
    config = transformers.AutoConfig.from_pretrained(llama)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    inputs_only = qstats.Recipe([qstats.Rule("Linear", sites=("input",))])
    with pytest.raises(ValueError, match="no Linear weight or stacked-experts parameter"):
        qstats.gptq_layerwise(meta, llama, _batches(samples[:1]), inputs_only, progress=False)
    with pytest.raises(ValueError, match="experts_at_once"):
        qstats.gptq_layerwise(meta, llama, _batches(samples[:1]), qstats.Recipe.from_scheme("W4A16"), progress=False,
                              experts_at_once=0)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(32, 32)
        self.unused = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.used(x)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(32, 32)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_weights_without_a_hessian_are_named_and_left_to_rounding(tmp_path):
    """A Linear never called (no Hessian, as an expert without tokens in llm-compressor) is not
    GPTQ'd; a warning names it; the others are GPTQ'd, equal to `qstats.gptq` on the Hessian of
    their inputs divided by their 4 samples: the one outside the decoder layers (``head``) on the
    last layer's outputs with its float weights (llm-compressor's last subgraph)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = _Net().eval()
    save_file(net.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        meta = _Net().eval()
    spec = qstats.QuantSpec.from_compressed_tensors({"num_bits": 4, "type": "int", "symmetric": True,
                                                     "strategy": "group", "group_size": 16})
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    x = torch.randn(4, 8, 32)
    with pytest.warns(qstats.UncalibratedWarning) as caught:
        result = qstats.gptq_layerwise(meta, str(tmp_path), [x], recipe, progress=False)
    messages = " ".join(str(w.message) for w in caught)
    assert "layers.0.unused.weight" in messages and "layers.1.unused.weight" in messages
    assert "head.weight" not in messages
    assert sorted(result.weights) == ["head.weight", "layers.0.used.weight", "layers.1.used.weight"]

    def gptq_of(weight, inputs):
        state = qstats.hessian().update(qstats.hessian().init(inputs), inputs)
        state = state._replace(count=torch.tensor(inputs.shape[0]))  # llm-compressor's samples, not the rows
        qparams = qstats.compute_qparams(qstats.minmax(spec).update(qstats.minmax(spec).init(weight), weight), spec)
        return qstats.gptq(weight.detach(), state, spec, qparams=qparams, actorder="static")[0]

    expected = gptq_of(net.layers[0].used.weight, x)
    assert torch.equal(result.weights["layers.0.used.weight"], expected)
    with torch.no_grad():
        last_outputs = net.layers[1].used(torch.nn.functional.linear(x, expected, net.layers[0].used.bias))
    assert torch.equal(result.weights["head.weight"], gptq_of(net.head.weight, last_outputs))
    with pytest.raises(ValueError, match="weights_dir"):
        qstats.gptq_layerwise(meta, str(tmp_path), [x], recipe, progress=False, weights_dir=str(tmp_path))


def _gptq_rank(rank: int, port: int, directory: str, weights_dir: str, batches: list) -> None:
    with gloo_group(rank, port):
        with torch.device("meta"):
            meta = _Net().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qstats.gptq_layerwise(meta, directory, batches[rank::2], _net_recipe(), progress=False, all_reduce=True,
                                  weights_dir=weights_dir)


def _net_recipe():
    spec = qstats.QuantSpec.from_compressed_tensors({"num_bits": 4, "type": "int", "symmetric": True,
                                                     "strategy": "group", "group_size": 16})
    return qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])


def test_two_ranks_merge_their_hessians_and_one_writes_the_weights(tmp_path):
    """Each rank observes half the batches; the Hessians are summed across ranks before GPTQ, so the
    weights written (by rank 0 alone) are those of one process over every batch, up to the float
    rounding of the sums' order."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    save_file(_Net().state_dict(), str(tmp_path / "model.safetensors"))
    batches = [torch.randn(2, 8, 32) for _ in range(4)]
    weights_dir = str(tmp_path / "weights")
    assert fork_ranks(_gptq_rank, str(tmp_path), weights_dir, batches) == [0, 0]
    with torch.device("meta"):
        meta = _Net().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = qstats.gptq_layerwise(meta, str(tmp_path), batches, _net_recipe(), progress=False)
    written = {}
    for name in os.listdir(weights_dir):
        if name.endswith(".safetensors"):
            written.update(load_file(os.path.join(weights_dir, name)))
    assert sorted(written) == sorted(one.weights)
    for name, weight in one.weights.items():
        assert (written[name] == weight).float().mean() >= 0.99, name


def test_a_recipe_observing_the_hessian_site_observes_it_in_a_second_pass(llama, samples):
    """W8A8 observes every Linear's input, the site the Hessians need too: both are observed, in two
    passes. The first layer's states are observed before any GPTQ, so they equal calibrate_layerwise's."""
    config = transformers.AutoConfig.from_pretrained(llama)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = qstats.Recipe.from_scheme("W8A8", ignore=["lm_head"])
    result = qstats.gptq_layerwise(meta, llama, _batches(samples[:3]), recipe, progress=False)
    assert len(result.weights) == 14
    float_states = qstats.calibrate_layerwise(meta, llama, _batches(samples[:3]), recipe, progress=False)
    first = [path for path in float_states if path.startswith("model.layers.0.")]
    assert len(first) == 7
    for path in first:
        for site in ("input", "weight"):
            assert all(torch.equal(a, b) for a, b in zip(result.states[path][site], float_states[path][site]))


def _shared_gptq_rank(rank: int, port: int, moe: str, samples: list, out: str, fail_rank=None) -> None:
    """One rank of `test_two_ranks_share_the_gptq_work`: half the batches; saves its weights and
    the experts it GPTQ'd (counted by wrapping the GPTQ it calls, which raises on ``fail_rank``)."""
    import sys

    module = sys.modules["qstats.layerwise_gptq"]
    done = []

    def counted(weight, *args, **kwargs):
        done.append(weight.shape[0] if weight.ndim == 3 else 1)
        if rank == fail_rank:
            raise ValueError("this rank's GPTQ failed")
        return real(weight, *args, **kwargs)

    real, module.gptq_unwarned = module.gptq_unwarned, counted
    with gloo_group(rank, port):
        config = transformers.AutoConfig.from_pretrained(moe)
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(config).eval()
        recipe = qstats.Recipe.from_scheme("W4A16", ignore=MOE_IGNORE, experts="Qwen3MoeExperts")
        try:
            result = qstats.gptq_layerwise(meta, moe, _batches(samples[rank::2]), recipe, progress=False,
                                           all_experts=True, experts_at_once=1, all_reduce=True)
        except Exception as error:  # what each rank raised, for the test; then the rank fails
            with open(os.path.join(out, f"rank{rank}.err"), "w") as file:
                file.write(f"{type(error).__name__}: {error}")
            raise
        torch.save({"weights": result.weights, "done": sum(done)}, os.path.join(out, f"rank{rank}.pt"))


def test_two_ranks_share_the_gptq_work(moe, samples, tmp_path):
    """Under ``all_reduce`` each weight (each expert, with ``experts_at_once=1``) is GPTQ'd by one
    rank and broadcast: the two ranks hold bit-identical weights, each rank did part of the work
    and together all of it once, and the weights are those of one process over every batch (up to
    the float rounding of the Hessian sums' order)."""
    assert fork_ranks(_shared_gptq_rank, moe, samples[:4], str(tmp_path), timeout=300) == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert sorted(ranks[0]["weights"]) == sorted(ranks[1]["weights"])
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name
    config = transformers.AutoConfig.from_pretrained(moe)
    per_layer = 4 + 2 * config.num_experts  # q, k, v, o; gate_up and down of each expert
    assert ranks[0]["done"] + ranks[1]["done"] == per_layer * config.num_hidden_layers
    assert min(ranks[0]["done"], ranks[1]["done"]) >= per_layer * config.num_hidden_layers // 3
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=MOE_IGNORE, experts="Qwen3MoeExperts")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = qstats.gptq_layerwise(meta, moe, _batches(samples[:4]), recipe, progress=False, all_experts=True)
    for name, weight in one.weights.items():
        assert (ranks[0]["weights"][name] == weight).float().mean() >= 0.99, name


def test_a_rank_whose_gptq_fails_makes_every_rank_raise(moe, samples, tmp_path):
    """GPTQ raising on one rank (its share of the work) raises on both, instead of the other
    waiting for its broadcasts."""
    assert fork_ranks(_shared_gptq_rank, moe, samples[:4], str(tmp_path), 1, timeout=120) == [1, 1]
    errors = [(tmp_path / f"rank{rank}.err").read_text() for rank in range(2)]
    assert errors[1] == "ValueError: this rank's GPTQ failed", errors
    assert errors[0].startswith("RuntimeError: another rank failed"), errors


def test_each_hessian_is_released_once_its_weight_is_done(moe, samples, monkeypatch):
    """When GPTQ starts on a weight, the Hessians of the weights done before it are gone (so a
    layer's working memory holds one job's Hessian less at a time, not all of them to the end)."""
    import sys
    import weakref

    module = sys.modules["qstats.layerwise_gptq"]
    original, refs, alive_at_start = module._gptq_part, [], []

    def tracking(job, take, options):
        total = job.hessian.total
        if not refs or refs[-1]() is not total:  # a new job: count the earlier jobs' Hessians still alive
            alive_at_start.append(sum(ref() is not None for ref in refs))
            refs.append(weakref.ref(total))
        return original(job, take, options)

    monkeypatch.setattr(module, "_gptq_part", tracking)
    config = transformers.AutoConfig.from_pretrained(moe)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=MOE_IGNORE, experts="Qwen3MoeExperts")
    qstats.gptq_layerwise(meta, moe, _batches(samples[:2]), recipe, progress=False, all_experts=True,
                          experts_at_once=1)
    assert len(alive_at_start) == 2 * (4 + 2)  # per layer: q, k, v, o, gate_up, down
    assert alive_at_start == [0] * len(alive_at_start), alive_at_start


def test_a_failed_run_leaves_no_weights_in_weights_dir(tmp_path, monkeypatch):
    """GPTQ failing in the second layer left the first layer's shard in weights_dir, where a rerun
    was then refused ("already holds safetensors files")."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(_Net().state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        meta = _Net().eval()
    real, calls = qstats.layerwise_gptq.gptq_unwarned, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("GPTQ failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(qstats.layerwise_gptq, "gptq_unwarned", failing)
    weights_dir = tmp_path / "weights"
    batches = [torch.randn(2, 8, 32)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="GPTQ failed"):
            qstats.gptq_layerwise(meta, str(tmp_path), batches, _net_recipe(), progress=False, weights_dir=weights_dir)
        assert len(calls) == 2 and [name for name in os.listdir(weights_dir) if name.endswith(".safetensors")] == []
        monkeypatch.setattr(qstats.layerwise_gptq, "gptq_unwarned", real)
        result = qstats.gptq_layerwise(meta, str(tmp_path), batches, _net_recipe(), progress=False,
                                       weights_dir=weights_dir)  # fmt: skip
    assert result.weights == str(weights_dir)
