"""The export's ``actorder=``: the column order GPTQ used, written into the weights' args as
llm-compressor's ``oneshot(GPTQModifier(...))`` writes it (the export wrote null for every GPTQ'd
checkpoint, where GPTQModifier writes its default ``"static"``)."""

import json
import os

import pytest
import torch
from _shared import llm_compressor_oneshot

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")

TOKENS = 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama saved to disk, and samples."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    return path, [torch.randint(1, 64, (TOKENS,), generator=generator) for _ in range(4)]


def _quantization_config(folder):
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)["quantization_config"]


def _gptq_export(llama, out, **options):
    """qstats' GPTQ of the Llama layer by layer (actorder "static", GPTQModifier's default) and its export."""
    path, samples = llama
    recipe = qstats.Recipe.from_scheme("W4A16", ignore=["lm_head"])
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path)).eval()
    meta.set_attn_implementation("eager")
    batches = [{"input_ids": s[None]} for s in samples]
    result = qstats.gptq_layerwise(meta, path, batches, recipe, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model.load_state_dict(result.weights, strict=False)
    plan = recipe.resolve(model)
    qparams = qstats.compute_qparams_tree(result.states, plan)
    return qstats.export.compressed_tensors(model, qparams, out, plan, **options)


def test_gptq_checkpoint_config_equals_llm_compressors(llama, tmp_path):
    """The whole quantization_config of a GPTQ'd W4A16 Llama equals oneshot's with actorder="static"."""
    from llmcompressor.modifiers.quantization import GPTQModifier

    theirs, ours = str(tmp_path / "llm_compressor"), str(tmp_path / "qstats")
    path, samples = llama
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    llm_compressor_oneshot(model, samples, GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]), theirs,
                           pipeline="sequential")
    written = _gptq_export(llama, ours, actorder="static")
    assert _quantization_config(theirs)["config_groups"]["group_0"]["weights"]["actorder"] == "static"
    assert written == _quantization_config(ours) == _quantization_config(theirs)


@pytest.mark.parametrize("given, modifier", [(None, None), (False, None), ("static", "static"), ("weight", "weight")])
def test_actorder_is_written_as_gptq_modifier_writes_it(given, modifier):
    """``None`` and ``False`` (compressed-tensors reads False as None) write null; ``"static"`` and its
    alias ``"weight"`` are written as given, as GPTQModifier's resolved config holds them."""
    import tempfile

    from llmcompressor.modifiers.quantization import GPTQModifier

    resolved = GPTQModifier(targets="Linear", scheme="W4A16", actorder=modifier).resolve_quantization_config()
    want = resolved.config_groups["group_0"].weights.model_dump(mode="json")["actorder"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 32)).eval()
    recipe = qstats.Recipe.from_scheme("W4A16")
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [torch.randn(2, 128)], recipe, progress=False),
                                          recipe, model)
    with tempfile.TemporaryDirectory() as folder:
        written = qstats.export.compressed_tensors(model, qparams, folder, recipe, actorder=given)
    assert written["config_groups"]["group_0"]["weights"]["actorder"] == want


@pytest.mark.parametrize("actorder", [True, "group", "Dynamic", "columns", 1])
def test_removed_or_unknown_actorder_is_refused_by_name(actorder, tmp_path):
    """compressed-tensors 0.19 refuses True, "group" and "dynamic" (removed); other values are no ordering."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 32)).eval()
    recipe = qstats.Recipe.from_scheme("W4A16")
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [torch.randn(2, 128)], recipe, progress=False),
                                          recipe, model)
    with pytest.raises(ValueError, match=f"actorder.*{actorder!r}"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), recipe, actorder=actorder)
    assert not os.listdir(tmp_path)  # nothing written
