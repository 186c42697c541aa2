"""NVFP4's ``dynamic="local"`` args (per-group scales at run time under a calibrated global scale) on
the q, k and v of attention: llm-compressor 0.14's calibration refuses them, and compressed-tensors'
checkpoints hold q/k/v scales per tensor or per head. `Recipe.from_scheme` refuses such a
``kv_cache_scheme`` and `Recipe.resolve` an attention group that narrowly matches an attention module
under them, naming it; the recipe calibrated them and the export refused them only afterwards."""

import pytest
import torch

import qstats

transformers = pytest.importorskip("transformers")
pytest.importorskip("llmcompressor")
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

LOCAL = PRESET_SCHEMES["NVFP4"]["input_activations"]


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("site", ["q", "k", "v"])
def test_llm_compressor_refuses_them_on_attention(site):
    theirs = Observer.load_from_registry("static_minmax", base_name=site, args=LOCAL.model_copy(deep=True))
    with pytest.raises(ValueError, match="Group quantization cannot be applied to attention"):
        theirs(torch.randn(1, 4, 8, 16))  # [batch, heads, tokens, head_dim]


def test_a_kv_cache_scheme_of_them_is_refused_naming_it(llama):
    for read in (lambda: qstats.Recipe.from_scheme("W8A16", kv_cache_scheme=LOCAL.model_dump()),
                 lambda: qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": LOCAL}),
                 lambda: qstats.Recipe.from_dict({"scheme": "W8A16", "kv_cache_scheme": LOCAL.model_dump()})):
        with pytest.raises(ValueError, match=r"the kv_cache_scheme: tensor_group args with dynamic='local'"):
            read()


def test_an_attention_group_of_them_is_refused_where_it_takes_an_attention_module(llama):
    group = {"input_activations": LOCAL.model_dump()}
    attention = qstats.Recipe.from_compressed_tensors({"config_groups": {"a": {"targets": ["re:.*self_attn$"], **group}}})
    with pytest.raises(ValueError, match=r"attention module 'model\.layers\.0\.self_attn'.*dynamic='local'"):
        attention.resolve(llama)
    # the same args on Linear inputs alone, and NVFP4 itself, still read
    linears = qstats.Recipe.from_compressed_tensors({"config_groups": {"a": {"targets": ["re:.*proj"], **group}}})
    assert set(linears.resolve(llama).sites["model.layers.0.self_attn.q_proj"]) == {"input"}
    assert set(qstats.Recipe.from_scheme("NVFP4").resolve(llama).sites["model.layers.0.mlp.down_proj"]) == {
        "weight", "input"}
