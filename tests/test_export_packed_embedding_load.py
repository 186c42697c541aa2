"""Embedding modules in a packed format (``targets=["Linear", "Embedding"]`` under an int4/int8,
NVFP4 or MXFP4 weight scheme): llm-compressor 0.14's ``oneshot`` writes them packed too, but
transformers cannot load such a checkpoint (its ``_init_weights`` reads the embedding's ``weight``,
which compressed-tensors' compressor replaced), so the export warns, naming them and what to do; with
``format="int-quantized"`` the checkpoint loads and computes `qstats.fake_quantized`'s logits."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


def _calibrated(scheme):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    plan = qstats.Recipe.from_scheme(scheme, targets=["Linear", "Embedding"]).resolve(model)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    qparams = qstats.compute_qparams_tree(qstats.calibrate(model, [{"input_ids": ids}], plan, progress=False), plan)
    return model, plan, qparams, ids


def _load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("scheme, advice", [("W8A16", "format='int-quantized'"), ("NVFP4A16", "ignore=")])
def test_a_packed_embedding_warns_as_transformers_cannot_load_it(tmp_path, scheme, advice):
    model, plan, qparams, _ = _calibrated(scheme)
    with pytest.warns(UserWarning, match=rf"\['model.embed_tokens'\] are written .*packed.*{re.escape(advice)}"):
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan)
    with pytest.raises(AttributeError, match="'Embedding' object has no attribute 'weight'"):
        _load(str(tmp_path))


def test_an_unpacked_embedding_loads_and_computes_the_fake_quantized_logits(tmp_path):
    model, plan, qparams, ids = _calibrated("W8A16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning: it loads
        qstats.export.compressed_tensors(model, qparams, str(tmp_path), plan, format="int-quantized")
    loaded = _load(str(tmp_path))
    loaded.set_attn_implementation("eager")
    with torch.no_grad():
        with qstats.fake_quantized(model, qparams, plan):
            ours = model(ids).logits
        theirs = loaded(ids).logits
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
