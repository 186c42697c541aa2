"""`QuantSpec.from_compressed_tensors` given a dict of QuantizationArgs fields reads each field as
QuantizationArgs (pydantic) parses it, and refuses the dicts QuantizationArgs refuses where the spec
would otherwise drop a field."""

import warnings

import pytest

import qstats

warnings.filterwarnings("ignore")

# fields as hand-written configs give them: QuantizationArgs parses each to the same arguments
PARSED = [
    {"num_bits": 4, "symmetric": "false"},
    {"num_bits": 4, "symmetric": "False", "strategy": "group", "group_size": 32},
    {"num_bits": 8, "symmetric": 0, "strategy": "channel"},
    {"num_bits": 8, "symmetric": "no"},
    {"num_bits": 8, "symmetric": "true"},
    {"num_bits": "4", "symmetric": 1},
    {"num_bits": 4.0, "strategy": "group", "group_size": 64.0},
    {"num_bits": 8, "symmetric": 1.0},
    {"num_bits": 8, "symmetric": 0.0},
    {"num_bits": 8, "symmetric": "TRUE"},
]

# dicts QuantizationArgs refuses, whose group_size, block_structure or num_bits qstats dropped
REFUSED = [
    {"num_bits": 4, "strategy": "channel", "group_size": 128},
    {"num_bits": 4, "strategy": "tensor", "group_size": 128},
    {"num_bits": 8, "type": "float", "strategy": "channel", "block_structure": [128, 128]},
    {"num_bits": 8, "type": "float", "strategy": "tensor", "block_structure": [128, 128]},
    {"num_bits": 4.5},
    {"num_bits": 8, "symmetric": "maybe"},
    {"num_bits": 8, "symmetric": " true"},
    {"num_bits": 8, "symmetric": 2},
    {"num_bits": 8, "symmetric": 0.5},
]


@pytest.mark.parametrize("fields", PARSED, ids=str)
def test_dict_fields_read_as_quantization_args_parses_them(fields):
    from compressed_tensors.quantization import QuantizationArgs

    expected = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**fields))
    assert qstats.QuantSpec.from_compressed_tensors(fields) == expected


@pytest.mark.parametrize("fields", REFUSED, ids=str)
def test_dicts_quantization_args_refuses_are_refused_naming_the_field(fields):
    from compressed_tensors.quantization import QuantizationArgs

    with pytest.raises(ValueError):
        QuantizationArgs(**fields)
    field = next(name for name in ("group_size", "block_structure", "symmetric", "num_bits") if name in fields)
    with pytest.raises(ValueError, match=field):
        qstats.QuantSpec.from_compressed_tensors(fields)
