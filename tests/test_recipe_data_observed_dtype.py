"""A rule of plain data (YAML) whose spec is compressed-tensors args names its ``observed_dtype``
("bfloat16"), as the scheme form of `Recipe.from_dict` reads it (it was refused: plain data
cannot hold a torch.dtype); its qparams equal llm-compressor's observer on bfloat16 weights."""

import pytest
import torch
import yaml

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402

TEXT = """
rules:
  - targets: Linear
    sites: [weight]
    observer: minmax
    spec:
      compressed_tensors: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 16}
      observed_dtype: {dtype}
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.float16"])
def test_a_data_rule_names_its_observed_dtype_and_equals_llm_compressor(dtype):
    recipe = qstats.Recipe.from_dict(yaml.safe_load(TEXT.replace("{dtype}", dtype)))
    (rule,) = recipe.rules
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to(torch_dtype)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)
    want = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)(weight).get_qparams()
    obs = rule.make_observer()
    got = qstats.compute_qparams(obs.update(obs.init(weight), weight), rule.spec)
    assert want["scale"].dtype == torch_dtype
    assert torch.equal(got.scale.reshape(want["scale"].shape).to(torch_dtype), want["scale"])
    assert torch.equal(got.zero_point.reshape(want["zero_point"].shape).to(want["zero_point"].dtype),
                       want["zero_point"])
