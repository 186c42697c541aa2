"""A dict of QuantizationArgs fields is refused where compressed-tensors 0.19's QuantizationArgs
refuses it, and read as it reads it.

QuantizationArgs validates strategy, dynamic, group_size and actorder together (its
``validate_model_after`` and field validators); a dict handed to ``QuantSpec.from_compressed_tensors``
has not been through them. Each case here is checked against QuantizationArgs itself.
"""

from __future__ import annotations

import warnings

import pytest

import qstats

ct_quantization = pytest.importorskip("compressed_tensors.quantization")
QuantizationArgs = ct_quantization.QuantizationArgs


@pytest.mark.parametrize(
    "fields, field",
    [
        # static token quantization (llm-compressor would observe nothing per token)
        (dict(num_bits=8, strategy="token"), "dynamic"),
        (dict(num_bits=8, type="float", strategy="token", dynamic=False), "dynamic"),
        # dynamic strategies are token, tensor, group and tensor_group only
        (dict(num_bits=8, strategy="channel", dynamic=True), "dynamic"),
        (dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128], dynamic=True), "dynamic"),
        (dict(num_bits=8, strategy="attn_head", dynamic=True), "dynamic"),
        # dynamic='local' is tensor_group's only
        (dict(num_bits=8, strategy="token", dynamic="local"), "dynamic"),
        (dict(num_bits=4, strategy="group", group_size=16, dynamic="local"), "dynamic"),
        (dict(num_bits=8, strategy="tensor", dynamic="LOCAL"), "dynamic"),
        # a string other than 'local' is no DynamicType
        (dict(num_bits=8, strategy="token", dynamic="true"), "dynamic"),
        # group sizes below -1
        (dict(num_bits=8, strategy="channel", group_size=-2), "group_size"),
        (dict(num_bits=8, group_size=-5), "group_size"),
        # activation orderings compressed-tensors removed
        (dict(num_bits=4, strategy="group", group_size=16, actorder=True), "actorder"),
        (dict(num_bits=4, strategy="group", group_size=16, actorder="group"), "actorder"),
        (dict(num_bits=4, strategy="group", group_size=16, actorder="Dynamic"), "actorder"),
    ],
)
def test_dict_fields_quantization_args_refuses_are_refused(fields, field):
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        QuantizationArgs(**fields)
    with pytest.raises(ValueError, match=field):
        qstats.QuantSpec.from_compressed_tensors(dict(fields))


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_bits=8, strategy="token", dynamic=True),
        dict(num_bits=8, strategy="tensor", dynamic=True),
        dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
        dict(num_bits=4, strategy="group", group_size=16, actorder="weight"),
        dict(num_bits=4, strategy="group", group_size=16, actorder=False),
        dict(num_bits=8, strategy="channel", group_size=-1),
        # NVFP4's activations with unrounded group scales (recipe_nvfp4_fp8_mixed.yaml), 'local' in any case
        dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="LOCAL"),
    ],
)
def test_dict_fields_quantization_args_takes_give_its_spec(fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamic=True per tensor warns either way
        assert qstats.QuantSpec.from_compressed_tensors(dict(fields)) == qstats.QuantSpec.from_compressed_tensors(
            QuantizationArgs(**fields))
