"""qstats.gptq against llm-compressor 0.14's quantize_weight on half-precision (bf16/fp16) weights
whose specs compute in the observed dtype (``from_compressed_tensors(args, observed_dtype=...)``),
for element formats qstats scales itself (MXFP4). llm-compressor's working weight is float32, and
compressed-tensors divides it by the bf16/fp16 scale in float32 (type promotion)."""

from __future__ import annotations

import pytest
import torch

import qstats
from qstats.gptq_quantize import gptq
from qstats.observers.hessian import gptq_hessian, hessian

llmc_gptq = pytest.importorskip("llmcompressor.modifiers.gptq.gptq_quantize")
llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402


def _data(dtype, seed=0, out=32, columns=256, rows=200):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, columns, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, columns, generator=gen) * torch.linspace(0.05, 2.0, columns)
    x = x + 0.5 * (torch.randn(rows, 8, generator=gen) @ torch.randn(8, columns, generator=gen))
    x[:, [0, 5, 31]] = 0.0  # dead columns
    return weight, hessian().update(hessian().init(x), x)


def _llm_compressor_and_ours(weight, state, args, spec):
    """llm-compressor's min/max qparams of ``weight`` and its ``quantize_weight`` under them, and
    qstats' min/max qparams of the same weight under ``spec``."""
    obs = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                                     args=args.model_copy(deep=True))
    obs(weight)
    found = obs.get_qparams()
    want, _, _ = llmc_gptq.quantize_weight(weight.clone()[None], gptq_hessian(state)[None], found["scale"][None],
                                           found["zero_point"][None], None, args)
    minmax = qstats.minmax(spec)
    return found, want, qstats.compute_qparams(minmax.update(minmax.init(weight), weight), spec)


@pytest.mark.parametrize("actorder", [None, "weight"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_half_precision_weight_equals_llm_compressor(dtype, actorder):
    """Before the fix the running float32 column was rounded to bf16 before its division by the
    e8m0 scale: 2.50018 became 2.5, a tie rounded to 2 where compressed-tensors gives 3 (~10-20%
    of the codes differed)."""
    args = preset_name_to_scheme("MXFP4", ["Linear"]).weights.model_copy(update={"actorder": actorder})
    weight, state = _data(dtype)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    found, want, qparams = _llm_compressor_and_ours(weight, state, args, spec)
    assert torch.equal(qparams.scale, found["scale"].float())  # the same scales: the difference is GPTQ's
    got, codes, _ = gptq(weight, state, spec, actorder=actorder and "static", qparams=qparams)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want[0])
    assert torch.equal(codes, qstats.quantize(want[0], qparams, spec))


def test_per_axis_minus_two_is_per_row_as_llm_compressor_channel():
    """PerAxis(-2) on an [out, in] weight is one set per output row, PerAxis(0): it was refused
    ("granularity PerAxis(axis=-2) is not supported")."""
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel", actorder="weight")
    weight, state = _data(torch.float32, seed=3)
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(granularity=qstats.PerAxis(-2))
    found, want, qparams = _llm_compressor_and_ours(weight, state, args, spec)
    got, _, _ = gptq(weight, state, spec, actorder="static", qparams=qparams)
    assert torch.equal(got, want[0])


@pytest.mark.parametrize("scheme", ["MXFP4A16", "MXFP8A16"])
def test_bf16_mx_first_layer_equals_llm_compressor_oneshot(scheme, tmp_path, single_thread_quiet):
    """`gptq_layerwise` of a bfloat16 Qwen3-MoE (observed_dtype bf16, eager attention) against
    llm-compressor's ``oneshot`` with a ``GPTQModifier``: the first layer's codes (inputs independent
    of GPTQ) equal its own but for float rounding of the Hessian sums."""
    import warnings

    transformers = pytest.importorskip("transformers")
    from test_gptq_layerwise_formats import IGNORE, _batches, _first_layer, _meta, _quantized, _same_codes, _theirs
    from _shared import qwen3_moe_config

    config = qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                              head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    path = str(tmp_path / "bf16")
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 64, (16,), generator=generator) for _ in range(2)]
    theirs = _theirs(path, samples, scheme, "basic", str(tmp_path / "theirs"))
    recipe = qstats.Recipe.from_scheme(scheme, ignore=IGNORE, experts="Qwen3MoeExperts", observed_dtype=torch.bfloat16)
    meta = _meta(path)
    meta.set_attn_implementation("eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = qstats.gptq_layerwise(meta, path, _batches(samples), recipe, progress=False, all_experts=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(model)
    out = str(tmp_path / "ours")
    qstats.export.compressed_tensors(model, qstats.compute_qparams_tree(result.states, plan), out, plan)
    from _shared import checkpoint_tensors

    assert _same_codes(checkpoint_tensors(out), theirs, _first_layer(_quantized(theirs))) >= 0.999
