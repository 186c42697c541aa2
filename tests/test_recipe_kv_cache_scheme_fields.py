"""A ``kv_cache_scheme`` with a field compressed-tensors' ``QuantizationArgs`` does not have is
refused naming both the kv_cache_scheme and the field, by `Recipe.from_scheme` and by
`Recipe.from_compressed_tensors` (it raised pydantic's bare error, naming neither the scheme)."""

import pytest

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402

KV = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynmic": False}


def test_compressed_tensors_refuses_the_field():
    with pytest.raises(ValueError, match="dynmic"):
        QuantizationArgs.model_validate(KV)


@pytest.mark.parametrize("build", [
    lambda: qstats.Recipe.from_scheme("W4A16", kv_cache_scheme=KV),
    lambda: qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": KV}),
    lambda: qstats.Recipe.from_dict({"scheme": "W4A16", "kv_cache_scheme": KV}),
])
def test_a_misspelt_kv_cache_scheme_field_is_refused_naming_the_scheme_and_field(build):
    with pytest.raises(ValueError, match=r"(?s)^kv_cache_scheme: .*dynmic"):
        build()


@pytest.mark.parametrize("kv", ["FP8", 8])
def test_a_kv_cache_scheme_that_is_no_args_is_refused_naming_it(kv):
    """A preset name where QuantizationArgs are expected: llm-compressor's QuantizationModifier
    refuses it naming kv_cache_scheme; the recipes named neither (a bare TypeError on the args)."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with pytest.raises(ValueError, match="kv_cache_scheme"):
        QuantizationModifier(scheme="W4A16", kv_cache_scheme=kv)
    for build in (lambda: qstats.Recipe.from_scheme("W4A16", kv_cache_scheme=kv),
                  lambda: qstats.Recipe.from_compressed_tensors({"config_groups": {}, "kv_cache_scheme": kv})):
        with pytest.raises(TypeError, match=r"^kv_cache_scheme: .*QuantizationArgs"):
            build()
