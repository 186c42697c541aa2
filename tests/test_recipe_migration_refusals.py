"""Recipes a user migrating from llm-compressor 0.14 / compressed-tensors 0.19 may write that those
libraries refuse or cannot run: `Recipe.from_compressed_tensors` refuses them too, naming the problem,
where it read them as another scheme (all Linears for a config group without targets)."""

import pytest

import qstats

quantization = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


@pytest.mark.parametrize("group", [{"weights": W8}, {"targets": None, "weights": W8}])
def test_a_config_group_without_targets_is_refused_as_compressed_tensors_refuses_it(group):
    config = {"config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    with pytest.raises(ValueError, match="targets"):  # pydantic's ValidationError: "Field required"
        QuantizationConfig.model_validate(config)
    with pytest.raises(ValueError, match=r"config_groups\['group_0'\] has no 'targets'"):
        qstats.Recipe.from_compressed_tensors(config)
