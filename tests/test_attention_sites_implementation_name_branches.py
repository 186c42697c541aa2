"""Attention modules whose forward branches on the name of their attention implementation
(MiniMax-M3's sparse indexer mask is applied only ``if config._attn_implementation in ("eager",
"sdpa")``): under qstats' counterpart (``"qstats:eager"``) they would compute dense attention, so
`calibrate` would observe keys and values the user's model never produces. Their q sites are
refused, naming the module (their k/v are read at the cache update:
`test_attention_sites_cache_update`); the keys such a model hands its attention function are
recorded here from the modeling file, not through qstats."""

from __future__ import annotations

import importlib

import pytest
import torch

import qstats
from _shared import eager_attention_arguments, tiny_minimax_m3_sparse

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")

FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)


def _modifier():
    from llmcompressor.modifiers.quantization import QuantizationModifier

    # an attention group: q, k and v under its input args
    return QuantizationModifier(config_groups={"attention": {"targets": ["re:.*self_attn$"], "input_activations": FP8}})


def test_the_sparse_mask_changes_the_keys_of_later_layers():
    """The premise: under another implementation name the model skips its sparse mask, and the
    keys its second layer's attention receives change."""
    pytest.importorskip("llmcompressor")
    model = tiny_minimax_m3_sparse()
    batch = torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    sparse = eager_attention_arguments(model, [batch], modeling)[("model.layers.1.self_attn", "k")][0]
    importlib.import_module("qstats._attention_functions")  # registers qstats' counterparts
    model.config._attn_implementation_internal = "qstats:eager"  # its name, as inside calibrate
    dense = eager_attention_arguments(model, [batch], modeling)[("model.layers.1.self_attn", "k")][0]
    assert not torch.equal(sparse, dense)


def test_calibrating_q_k_v_of_a_module_branching_on_the_implementation_name_is_refused_naming_it():
    pytest.importorskip("llmcompressor")
    model = tiny_minimax_m3_sparse()
    plan = qstats.Recipe.from_compressed_tensors(_modifier()).resolve(model)
    batches = [{"input_ids": torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(1))}]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*MiniMaxM3VLAttention.*compares"):
        qstats.calibrate(model, batches, plan, progress=False)
    assert model.config._attn_implementation == "eager"  # the user's setting, back


def test_modules_that_do_not_branch_on_it_are_not_refused():
    """Llama's attention forward reads the implementation's name only to look its function up."""
    from qstats._attention import _compares_implementation

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    attention = transformers.LlamaForCausalLM(config).model.layers[0].self_attn
    assert not _compares_implementation(attention, "eager") and not _compares_implementation(attention, "sdpa")
    assert _compares_implementation(tiny_minimax_m3_sparse().model.layers[0].self_attn, "eager")
