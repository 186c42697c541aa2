"""Fused scale groups (qstats/fused.py) at their edges: specs without a global scale, stacked groups
under ``on_uncalibrated="raise"``, members that are not states, the groups of transformers' model
families against llm-compressor's ``fuse_weight_observers``, and DeepSeek-V3's fused MLA
projections against llm-compressor's ``oneshot``."""

import os
import warnings

import pytest
import torch

import qstats

observers = pytest.importorskip("llmcompressor.observers")
transformers = pytest.importorskip("transformers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402


def _weights(seed, count=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 32, generator=g) * (i + 1) for i in range(count)]


@pytest.mark.parametrize("fields", [
    dict(num_bits=8, type="float", strategy="tensor"),
    dict(num_bits=8, type="int", strategy="tensor"),
    dict(num_bits=4, type="int", strategy="group", group_size=16),
])
def test_specs_without_a_global_scale_keep_each_members_own_scale_as_llm_compressor(fields):
    """llm-compressor fuses TENSOR_GROUP (NVFP4) observers only: FP8/int8 q/k/v keep their own
    scales. fused_global_scale returned a number for them (amax over an element range, no scale of
    the spec), and fused_qparams computed it for nothing; now it is a ValueError and fused_qparams
    gives each member llm-compressor's own scale."""
    from llmcompressor.observers.helpers import fuse_weight_observers

    args = QuantizationArgs(symmetric=True, **fields)
    weights = _weights(0)
    attention = torch.nn.Module()
    group = []
    for name, w in zip(("q_proj", "k_proj", "v_proj"), weights):
        module = torch.nn.Linear(32, 8, bias=False)
        module.weight.data = w
        module.weight_observer = observers.Observer.load_from_registry(
            "memoryless_minmax", base_name="weight", args=args.model_copy(deep=True))
        setattr(attention, name, module)
        group.append(module.weight_observer)
    fuse_weight_observers(attention)
    assert not any(observer.fusion_handler.is_fused for observer in group)
    for observer, w in zip(group, weights):
        observer(w)
    reference = [observer.get_qparams() for observer in group]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.minmax(spec)
    states = [obs.update(obs.init(w), w) for w in weights]
    with pytest.raises(ValueError, match="two-level"):
        qstats.fused_global_scale(states, spec)
    for qp, ref in zip(qstats.fused_qparams(states, spec), reference):
        assert ref["global_scale"] is None
        assert torch.equal(qp.scale.float(), ref["scale"].float().reshape(qp.scale.shape))


def test_stacked_group_raises_for_an_uncalibrated_expert_under_on_uncalibrated_raise():
    """The list form raised (compute_qparams) for a member that saw no data under
    on_uncalibrated="raise"; the stacked form gave that expert scale 1 and global scale 1 silently."""
    spec = qstats.preset("nvfp4")
    assert spec.on_uncalibrated == "raise"
    obs = qstats.minmax(spec)
    experts = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(1))
    routed = torch.tensor([1.0, 0.0, 1.0]).view(3, 1).expand(3, 8)  # expert 1 saw no data
    stacked = torch.func.vmap(lambda x, w: obs.update(obs.init(x), x, weight=w))(experts, routed)
    expert_1 = type(stacked)(*(field[1] for field in stacked))
    with pytest.raises(ValueError, match="uncalibrated"):  # the same state on its own
        qstats.compute_qparams(expert_1, spec)
    with pytest.raises(ValueError, match="uncalibrated"):
        qstats.fused_qparams([expert_1], spec)
    with pytest.raises(ValueError, match=r"fused_qparams\(stacked=True\).*uncalibrated"):
        qstats.fused_qparams(stacked, spec, stacked=True)
    fallback = spec.replace(on_uncalibrated="fallback")
    assert not qstats.fused_qparams(stacked, fallback, stacked=True).calibrated[1].any()


@pytest.mark.parametrize("member", [None, torch.zeros(8, 32)])
def test_a_member_that_is_not_a_state_is_named(member):
    """[q_state, None] (a member left unquantized) read 'the group mixes state types [..., NoneType]'."""
    spec = qstats.preset("nvfp4")
    obs = qstats.minmax(spec)
    x = torch.randn(8, 32)
    with pytest.raises(TypeError, match=f"member 1 of the group is a {type(member).__name__}, not an observer state"):
        qstats.fused_qparams([obs.update(obs.init(x), x), member], spec)


# fields of tiny models: (model type, config fields)
_FAMILIES = {
    "llama": dict(intermediate_size=32),
    "phi3": dict(intermediate_size=32, pad_token_id=0),  # fused qkv_proj / gate_up_proj Linears: no groups
    "gemma3_text": dict(intermediate_size=32, head_dim=16),
    "qwen2_moe": dict(intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2,
                        num_hidden_layers=2),
    "deepseek_v2_no_q_lora": dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
                                  num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2),
}
_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=32, tie_word_embeddings=False)


def _tiny(family, dtype=torch.float32):
    model_type = "deepseek_v2" if family == "deepseek_v2_no_q_lora" else family
    config = transformers.AutoConfig.for_model(model_type, **{**_SMALL, **_FAMILIES[family]})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_fused_groups_are_llm_compressors(family):
    """The groups of every module, as llm-compressor 0.14's ``fuse_weight_observers`` links NVFP4 weight
    observers on each Linear of the model (MLA's q_a_proj/kv_a_proj_with_mqa; none for Phi-3's fused
    Linears or DeepSeek-V2 without a q LoRA)."""
    from llmcompressor.observers.helpers import fuse_weight_observers

    model = _tiny(family)
    args = NVFP4["weights"]
    path_of = {module: path for path, module in model.named_modules()}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight_observer = observers.Observer.load_from_registry(
                "memoryless_minmax", base_name="weight", args=args.model_copy(deep=True))
    fuse_weight_observers(model)
    theirs = set()
    for path, module in model.named_modules():
        handler = getattr(getattr(module, "weight_observer", None), "fusion_handler", None)
        if handler is not None and handler.is_fused:
            theirs.add(frozenset([path] + [path_of[other.module] for other in handler._group]))
    ours = qstats.fused.fused_groups(model)
    assert {frozenset(group) for group in ours} == theirs
    assert len(ours) == len(theirs)


def test_deepseek_v3_mla_nvfp4_bf16_equals_llm_compressor_oneshot(tmp_path):
    """DeepSeek-V3 with a q LoRA (q_a_proj and kv_a_proj_with_mqa under one global scale, vLLM's
    fused_qkv_a_proj), a dense first layer and stacked experts, in bfloat16: the NVFP4 checkpoint of
    qstats' calibrate / compute_qparams_tree / export is llm-compressor's oneshot's, bit for bit."""
    pytest.importorskip("llmcompressor")
    from _shared import bit_equal, llm_compressor_oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file

    saved, theirs, ours = (str(tmp_path / name) for name in ("float", "theirs", "ours"))
    _tiny("deepseek_v3", torch.bfloat16).save_pretrained(saved)
    ignore = ["lm_head", r"re:.*mlp\.gate$"]
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (12,), generator=generator) for _ in range(2)]

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoModelForCausalLM.from_pretrained(saved, dtype="auto").eval()

    llm_compressor_oneshot(load(), samples, QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore),
                           theirs)
    model = load()
    model.set_attn_implementation("eager")
    experts = next(type(m).__name__ for m in model.modules() if qstats.experts.expert_count(m))
    plan = qstats.Recipe.from_scheme("NVFP4", ignore=ignore, observed_dtype=torch.bfloat16,
                                     experts=experts).resolve(model)
    assert ("model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa") in plan.fused_groups
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = qstats.calibrate(model, [{"input_ids": s[None]} for s in samples], plan, progress=False,
                                  all_experts=True)
        qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(states, plan), ours, plan)
    their_tensors = load_file(os.path.join(theirs, "model.safetensors"))
    our_tensors = load_file(os.path.join(ours, "model.safetensors"))
    assert sorted(our_tensors) == sorted(their_tensors)
    assert [name for name in their_tensors if not bit_equal(our_tensors[name], their_tensors[name])] == []
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.self_attn."
        names = ("q_a_proj", "kv_a_proj_with_mqa")
        q_a, kv_a = (their_tensors[f"{prefix}{name}.weight_global_scale"] for name in names)
        assert torch.equal(q_a, kv_a)


def test_a_group_under_mixed_observers_shares_llm_compressors_global_scale():
    """q/k under memoryless_minmax and v under nvfp4_expanded_mse (one NVFP4 scheme): llm-compressor
    fuses them, each observer giving its own range; compute_qparams_tree kept each its own global
    scale (with a warning), and a qstats recipe mixing observer types raised a TypeError naming no
    group. The group's global scale comes from every member's own range; scales equal llm-compressor's
    `FusionHandler` bit for bit."""
    from llmcompressor.observers import Observer
    from llmcompressor.observers.fusion import FusionHandler

    def args(observer):
        return NVFP4["weights"].model_copy(update={"observer": observer})

    weights = _weights(3)
    weights[2][0, 0] = 30.0  # v holds the peak, which its mse search (from 1.8x the range) moves
    attention = torch.nn.Module()
    for name, weight in zip(("q_proj", "k_proj", "v_proj"), weights):
        linear = torch.nn.Linear(32, 8, bias=False)
        linear.weight.data = weight.clone()
        setattr(attention, name, linear)
    kinds = ["memoryless_minmax", "memoryless_minmax", "nvfp4_expanded_mse"]
    references = [Observer.load_from_registry(kind, base_name="weight", args=args(kind)) for kind in kinds]
    FusionHandler.fuse(list(zip(references, (attention.q_proj, attention.k_proj, attention.v_proj))))
    for reference, weight in zip(references, weights):
        reference(weight)
    expected = [reference.get_qparams() for reference in references]
    config = {"config_groups": {
        "qk": {"targets": ["re:.*[qk]_proj"], "weights": args("memoryless_minmax").model_dump()},
        "v": {"targets": ["re:.*v_proj"], "weights": args("nvfp4_expanded_mse").model_dump()}}}
    recipe = qstats.Recipe.from_compressed_tensors(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "each keeps its own global scale"
        states = qstats.calibrate(attention, [], recipe, progress=False)
        qparams = qstats.compute_qparams_tree(states, recipe, attention)
    for name, want in zip(("q_proj", "k_proj", "v_proj"), expected):
        got = qparams[name]["weight"]
        assert torch.equal(got.global_scale.reshape(1), want["global_scale"].float().reshape(1)), name
        assert torch.equal(got.scale.float(), want["scale"].float().reshape(got.scale.shape)), name


@pytest.mark.parametrize("fuse", ["no", None, [], 1])
def test_fuse_must_be_a_bool(fuse):
    """``fuse="no"`` fused and ``fuse=None`` did not, silently."""
    layer = torch.nn.Linear(32, 8)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=qstats.preset("nvfp4"))])
    states = qstats.calibrate(layer, [], recipe, progress=False)
    with pytest.raises(TypeError, match="fuse must be True or False"):
        qstats.compute_qparams_tree(states, recipe, layer, fuse=fuse)
