"""``all_experts``, ``all_reduce`` and ``progress`` of `calibrate_layerwise`, `gptq_layerwise` and
`compressed_tensors_layerwise` are True or False, as `calibrate` takes them: a string ("no") would
switch the option on."""

import pytest
import torch

import qstats

RECIPE = qstats.Recipe([qstats.Rule("Linear", sites=("weight",))])


def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])).eval()


@pytest.mark.parametrize("name", ["all_experts", "all_reduce"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_calibrate_layerwise_flags_that_are_not_bools_raise_naming_them(name, value):
    with pytest.raises(TypeError, match=rf"calibrate_layerwise: {name} must be True or False, got {value!r}"):
        qstats.calibrate_layerwise(_meta_model(), "no_checkpoint_needed", [torch.zeros(1, 2)], RECIPE,
                                   progress=False, **{name: value})


@pytest.mark.parametrize("name", ["all_experts", "all_reduce"])
def test_gptq_layerwise_flags_that_are_not_bools_raise_naming_them(name):
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int4"))])
    with pytest.raises(TypeError, match=rf"gptq_layerwise: {name} must be True or False, got 'no'"):
        qstats.gptq_layerwise(_meta_model(), "no_checkpoint_needed", [torch.zeros(1, 2)], recipe,
                              progress=False, **{name: "no"})


def test_calibrate_takes_all_experts_the_same_way():
    with pytest.raises(TypeError, match=r"calibrate: all_experts must be True or False, got 'no'"):
        qstats.calibrate(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], RECIPE, progress=False, all_experts="no")


@pytest.mark.parametrize("value", ["no", 0, None])
def test_progress_that_is_not_a_bool_raises_naming_it_as_calibrate(value, tmp_path):
    with pytest.raises(TypeError, match=rf"calibrate: progress must be True or False, got {value!r}"):
        qstats.calibrate(torch.nn.Linear(2, 2), [torch.zeros(1, 2)], RECIPE, progress=value)
    with pytest.raises(TypeError, match=rf"calibrate_layerwise: progress must be True or False, got {value!r}"):
        qstats.calibrate_layerwise(_meta_model(), "no_checkpoint_needed", [torch.zeros(1, 2)], RECIPE, progress=value)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=qstats.QuantSpec(dtype="int4"))])
    with pytest.raises(TypeError, match=rf"gptq_layerwise: progress must be True or False, got {value!r}"):
        qstats.gptq_layerwise(_meta_model(), "no_checkpoint_needed", [torch.zeros(1, 2)], recipe, progress=value)
    with pytest.raises(TypeError, match=rf"compressed_tensors_layerwise: progress must be True or False, got {value!r}"):
        qstats.export.compressed_tensors_layerwise(_meta_model(), str(tmp_path), {}, str(tmp_path / "out"), RECIPE,
                                                   progress=value)
