"""coreai_opt granularities given as dicts (as in a YAML or JSON config) to `QuantSpec.from_coreai_opt`:
what coreai_opt's ``QuantizationSpec`` refuses (a per-block granularity without ``block_size``, a
misspelled or extra key, a per-tensor axis, a block size or axis that is no integer) is refused with a ValueError naming it, instead of
becoming another granularity (``block_size`` 4.5 was read as 4); coreai_opt's own dicts
(``model_dump``) and the integral floats and digit strings its integer fields take are its qparams.

Reference: Apple coreai_opt 0.4.0's ``QuantizationGranularity`` models (``extra="forbid"``) and
``get_block_size``.
"""

import warnings

import pytest
import torch

import qstats
import qstats.coreai_opt

warnings.filterwarnings("ignore")

spec_lib = pytest.importorskip("coreai_opt.quantization.spec.spec")
from coreai_opt.config.spec import CompressionTargetTensor  # noqa: E402
from coreai_opt.quantization.spec.factory import QuantizationComponentFactory  # noqa: E402

QuantizationSpec = spec_lib.QuantizationSpec
SHAPE = (4, 16)


@pytest.mark.parametrize("granularity,message", [
    ({"type": "per_block", "axis": 1}, "per_block granularity needs block_size"),
    ({"type": "per_block", "axis": 1, "blocksize": 8}, r"\['blocksize'\]"),
    ({"type": "per_block", "axis": 1, "block_size": 8, "group": 2}, r"\['group'\]"),
    ({"type": "per_channel", "axis": 0, "block_size": 8}, r"\['block_size'\]"),
    ({"type": "per_tensor", "axis": 0}, "per_tensor granularity takes no axis"),
    ({"type": "per_block", "axis": 1, "block_size": 4.5}, "block_size must be an integer, got 4.5"),
    ({"type": "per_block", "block_size": (2, 7.5)}, "block_size must be an integer, got 7.5"),
    ({"type": "per_block", "axis": 0.5, "block_size": 8}, "axis must be an integer, got 0.5"),
    ({"type": "per_channel", "axis": "first"}, "axis must be an integer, got 'first'"),
], ids=str)
def test_a_granularity_coreai_opt_refuses_is_refused_naming_it(granularity, message):
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        QuantizationSpec(granularity=granularity)
    with pytest.raises(ValueError, match=message):
        qstats.QuantSpec.from_coreai_opt(granularity=granularity, shape=SHAPE)
    with pytest.raises(ValueError, match=message):
        qstats.coreai_opt.block_size(granularity, SHAPE)


@pytest.mark.parametrize("granularity", [
    {"type": "per_tensor"}, {"type": "per_tensor", "axis": None}, {"type": "per_channel", "axis": 1},
    {"type": "per_block", "axis": 1, "block_size": 8}, {"type": "per_block", "block_size": [2, 8]},
    {"type": "per_block", "axis": None, "block_size": (2, -1)},
    # what coreai_opt's (pydantic's) integer fields take as integers
    {"type": "per_block", "axis": 1, "block_size": 8.0}, {"type": "per_block", "axis": "1", "block_size": "8"},
    {"type": "per_block", "block_size": (2.0, -1)}, {"type": "per_channel", "axis": 1.0},
    {"type": "per_channel", "axis": "-1"},
], ids=str)
def test_coreai_opts_own_dicts_are_its_qparams(granularity):
    coreai_spec = QuantizationSpec(granularity=granularity, qparam_calculator_cls="static")
    w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    scale, _, minval = QuantizationComponentFactory.create_qparams_calculator(coreai_spec, CompressionTargetTensor.WEIGHT)(w)
    for given in (granularity, coreai_spec.granularity.model_dump(), coreai_spec.granularity):
        spec = qstats.QuantSpec.from_coreai_opt(granularity=given, shape=SHAPE)
        obs = qstats.memoryless_minmax(spec)
        qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
        assert torch.equal(qp.scale.reshape(scale.shape), scale) and torch.equal(qp.minval.reshape(minval.shape), minval)
