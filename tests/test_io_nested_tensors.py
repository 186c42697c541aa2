"""qstats.save of a nested tensor (``torch.nested.nested_tensor``, strided layout, as torch.save keeps it):
a safetensors file holds dense tensors only, so save refuses it with a TypeError naming its path in the
tree, as it refuses a sparse tensor, before anything is written. It raised torch's own RuntimeError from
inside the writer ("nested reshape cannot change or infer the implicit batch dimension"), naming no leaf."""

import warnings

import pytest
import torch

import qstats


def _nested(layout):
    with warnings.catch_warnings():  # torch warns that nested tensors are a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=layout)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_tensor_is_refused_naming_its_path(tmp_path, layout):
    nested = _nested(layout)
    # the reference: torch.save keeps it, safetensors cannot hold a tensor of uneven rows
    torch.save({"layer": {"input": nested}}, tmp_path / "torch.pt")
    path = tmp_path / "nested.safetensors"
    with pytest.raises(TypeError, match=r"layer/input.*nested"):
        qstats.save(path, {"layer": {"input": nested}, "other": torch.ones(2)})
    assert not path.exists()
