"""`Recipe.from_scheme` and `Recipe.from_compressed_tensors` take ``observed_dtype`` by name, as
`Recipe.from_dict` (plain data) does: the same rules as with the torch dtype."""
import pytest
import torch

import qstats


def _rules(recipe) -> list:
    return [(rule.targets, rule.sites, rule.spec) for rule in recipe.rules]


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16)])
def test_observed_dtype_by_name(name, dtype):
    by_name = qstats.Recipe.from_scheme("W8A8", observed_dtype=name)
    assert _rules(by_name) == _rules(qstats.Recipe.from_scheme("W8A8", observed_dtype=dtype))
    assert {rule.spec.compute_dtype for rule in by_name.rules} == {str(dtype).removeprefix("torch.")}
    config = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                                                 "symmetric": True, "strategy": "channel"}}}}
    assert (_rules(qstats.Recipe.from_compressed_tensors(config, observed_dtype=name))
            == _rules(qstats.Recipe.from_compressed_tensors(config, observed_dtype=dtype)))
    assert _rules(qstats.Recipe.from_dict({"scheme": "W8A8", "observed_dtype": name})) == _rules(by_name)


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="observed_dtype"):
        qstats.Recipe.from_scheme("W8A8", observed_dtype="float8")
