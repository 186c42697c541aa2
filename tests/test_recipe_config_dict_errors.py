"""A compressed-tensors quantization config handed to the wrong reader, or a whole ``config.json`` (or
a checkpoint folder) handed to `Recipe.from_compressed_tensors`, is refused saying what to pass (the errors named
'config_groups' as missing, or listed the keys as unknown)."""

import pytest

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

CONFIG = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                                           "symmetric": True, "strategy": "channel"}}},
          "ignore": ["lm_head"]}


def test_the_config_is_compressed_tensors_own_and_reads_with_from_compressed_tensors():
    QuantizationConfig.model_validate(CONFIG)
    assert [rule.sites for rule in qstats.Recipe.from_compressed_tensors(CONFIG).rules] == [("weight",)]


def test_from_dict_of_a_quantization_config_names_from_compressed_tensors():
    with pytest.raises(ValueError, match=r"\['config_groups'\]: a compressed-tensors quantization config .* reads "
                                         r"with Recipe.from_compressed_tensors"):
        qstats.Recipe.from_dict(CONFIG)


def test_a_whole_config_json_says_to_pass_its_quantization_config():
    with pytest.raises(ValueError, match=r"checkpoint's config.json; pass its \['quantization_config'\] dict"):
        qstats.Recipe.from_compressed_tensors({"architectures": ["LlamaForCausalLM"], "quantization_config": CONFIG})
    with pytest.raises(ValueError, match=r"reads with Recipe.from_compressed_tensors"):
        qstats.Recipe.from_dict({"architectures": ["LlamaForCausalLM"], "quantization_config": CONFIG})


def test_a_checkpoint_folder_says_what_to_pass(tmp_path):
    """llm-compressor's reader takes the folder's path for recipe text and says the path does not exist."""
    pytest.importorskip("llmcompressor")
    import json

    from llmcompressor.recipe import Recipe as LLMCompressorRecipe

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": CONFIG}))
    with pytest.raises(ValueError, match="Could not parse recipe"):
        LLMCompressorRecipe.create_instance(str(tmp_path))
    for folder in (str(tmp_path), tmp_path):
        with pytest.raises(ValueError, match=r"is a folder: pass json.load\(open\(<folder>/config.json\)\)"):
            qstats.Recipe.from_compressed_tensors(folder)
