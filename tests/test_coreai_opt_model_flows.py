"""`recipe_from_coreai_opt` on a tiny transformer and a tiny CNN against coreai_opt's own prepared
and calibrated model (sites, scales, zero points and outputs), and the parameters of a custom
module coreai_opt quantizes where no recipe site holds them (a warning names them)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qstats
import qstats.coreai_opt

pytest.importorskip("coreai_opt")
from test_coreai_opt_config_recipe import EAGER, _compare, _coreai_opt_calibrated, _data, _spec  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from coreai_opt.quantization import ExecutionMode, ModuleQuantizerConfig, QuantizerConfig
    from coreai_opt.quantization.config.quantization_config import OpQuantizerConfig

OFF = OpQuantizerConfig(op_input_spec=None, op_output_spec=None, op_state_spec=None)


class _TinyTransformer(nn.Module):
    """Embedding, q/k/v/o projections, LayerNorm, an MLP and a head; the attention's matmuls and the
    residual adds are functions (left alone by the configs below)."""

    def __init__(self, width=16, vocab=20):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.norm = nn.LayerNorm(width)
        self.up, self.down, self.head = nn.Linear(width, 32), nn.Linear(32, width), nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        x = self.norm(x + self.o(torch.softmax(scores, -1) @ self.v(x)))
        return self.head(x + self.down(F.gelu(self.up(x))))


def _ids(count=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 20, (2, 6), generator=g) for _ in range(count)]


TRANSFORMER_CONFIGS = {
    "default_without_functional_ops": ModuleQuantizerConfig(op_type_config={"matmul": OFF, "add": OFF}),
    "w4_per_block_a8_uint8": ModuleQuantizerConfig(
        op_state_spec={"weight": _spec(torch.int4, granularity={"type": "per_block", "block_size": 8})},
        op_input_spec={0: _spec(torch.uint8, "asymmetric")}, op_output_spec=None,
        op_type_config={"matmul": OFF, "add": OFF}),
}


@pytest.mark.parametrize("case", list(TRANSFORMER_CONFIGS))
def test_tiny_transformer(case, single_thread_quiet):
    torch.manual_seed(0)
    model = _TinyTransformer().eval()
    ids = _ids()
    config = QuantizerConfig(execution_mode=EAGER, global_config=TRANSFORMER_CONFIGS[case])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        equal, total = _compare(model, config, ids[0], ids[1:])
    assert equal == total > 0
    assert not [w for w in caught if "hold parameters" in str(w.message)]  # LayerNorm: torch.nn's own


class _TinyCNN(nn.Module):
    """Grouped Conv1d and ConvTranspose1d, a depthwise circular-padded Conv2d, a grouped strided
    ConvTranspose2d, a Conv3d, MaxPool2d, AdaptiveAvgPool2d and a Linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.c1t = nn.Conv1d(4, 8, 3, groups=2), nn.ConvTranspose1d(8, 8, 3, groups=4)
        self.c2 = nn.Conv2d(8, 8, 3, groups=8, padding=1, padding_mode="circular")
        self.c2t, self.c3 = nn.ConvTranspose2d(8, 6, 2, stride=2, groups=2), nn.Conv3d(6, 4, 1)
        self.pool, self.gap, self.fc = nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Linear(4, 3)

    def forward(self, x):
        y = torch.relu(self.c1t(torch.relu(self.c1(x))))[:, :, None, :].expand(-1, -1, 4, -1)
        y = self.c3(self.c2t(torch.relu(self.c2(y)))[:, :, None]).squeeze(2)
        return self.fc(self.gap(self.pool(y)).flatten(1))


CNN_SPECS = {  # weight, activation
    "int4_asymmetric_per_channel_fp8_activations": (_spec(torch.int4, "asymmetric", {"type": "per_channel"}),
                                                    _spec(torch.float8_e4m3fn)),
    "e8m0_blocks_of_2_uint4_per_channel_activations": (
        _spec(granularity={"type": "per_block", "block_size": 2}, scale_dtype=torch.float8_e8m0fnu),
        _spec(torch.uint4, "asymmetric", {"type": "per_channel", "axis": 1}, calculator="global_minmax")),
    "fp8_e5m2_per_channel_int4_activations": (_spec(torch.float8_e5m2, granularity={"type": "per_channel"}),
                                              _spec(torch.int4)),
}


@pytest.mark.parametrize("case", list(CNN_SPECS))
def test_tiny_cnn(case, single_thread_quiet):
    """Every conv kind with groups, int8 biases; a depthwise weight (input size 1) its blocks of 2
    do not divide is left float by both."""
    weight, activation = CNN_SPECS[case]
    torch.manual_seed(0)
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_state_spec={"weight": weight, "bias": _spec()}, op_input_spec={0: activation}, op_output_spec={0: activation}))
    equal, total = _compare(_TinyCNN().eval(), config, *_data(4, (8,)))
    assert equal == total > 0


class _Custom(nn.Module):
    """A module outside torch.nn passing its own parameter to F.linear."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.linear(x, self.weight))


class _RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((16,), 1.5))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("state", ["weight", "*"])
def test_a_custom_modules_parameter_coreai_opt_quantizes_is_named_in_a_warning(mode, state, single_thread_quiet):
    """coreai_opt quantizes a parameter a custom module passes to F.linear (its state specs name
    it); a recipe has no site for it: it warned about nothing and left it float."""
    torch.manual_seed(0)
    model = _Custom().eval()
    config = QuantizerConfig(execution_mode=ExecutionMode(mode), global_config=ModuleQuantizerConfig(
        op_state_spec={state: _spec(granularity={"type": "per_channel", "axis": 0})},
        op_input_spec=None, op_output_spec=None))
    _, calculators = _coreai_opt_calibrated(model, config, *_data(16, count=1))
    assert sorted(calculators[""]) == ["weight"]  # coreai_opt quantizes it
    with pytest.warns(UserWarning, match=r"modules '' \(_Custom\) \['weight'\] hold parameters"):
        recipe = qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    assert "" not in recipe.sites(model)


def test_an_rms_norms_weight_coreai_opt_quantizes_through_mul_is_named_in_a_warning(single_thread_quiet):
    """``self.weight * x`` is coreai_opt's registered mul: a ``{"weight": ...}``
    state spec (axis 0) quantizes an RMSNorm's weight; one warning names every such module."""
    torch.manual_seed(0)
    model = nn.Sequential(_RMSNorm(), nn.Linear(16, 16), _RMSNorm(), nn.Linear(16, 4)).eval()
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig.presets.w8(axis=0))
    _, calculators = _coreai_opt_calibrated(model, config, *_data(16, count=1))
    assert {path: sorted(sites) for path, sites in calculators.items()} == {p: ["weight"] for p in "0123"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    messages = [str(w.message) for w in caught if "hold parameters" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(
        "recipe_from_coreai_opt: modules '0' (_RMSNorm) ['weight'], '2' (_RMSNorm) ['weight'] hold parameters")


class _PoolWithIndices(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.pool, self.unpool = nn.Conv2d(2, 4, 1), nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

    def forward(self, x):
        return self.unpool(*self.pool(self.conv(x)))


def test_a_max_pool_returning_indices_is_left_float(single_thread_quiet):
    """nn.MaxPool2d(return_indices=True) calls F.max_pool2d_with_indices, which coreai_opt does not
    register: its prepare leaves the pool's input and output float. The recipe gave the pool input
    and output sites (the output's qparams from the tuple's values), and the outputs differed."""
    torch.manual_seed(0)
    model = _PoolWithIndices().eval()
    config = QuantizerConfig(execution_mode=EAGER)
    _, calculators = _coreai_opt_calibrated(model, config, *_data(2, (4, 4), count=1))
    assert sorted(calculators) == ["conv"]
    equal, total = _compare(model, config, *_data(2, (4, 4)))
    assert equal == total == 2 * 3


def _weight_normed():
    torch.manual_seed(0)
    return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(16, 8)), nn.ReLU(), nn.Linear(8, 4)).eval()


@pytest.mark.parametrize("key", [1, "*"])
def test_a_parametrized_weight_an_input_spec_names_is_refused(key, single_thread_quiet):
    """A weight_norm weight is computed, not a parameter: coreai_opt quantizes it as argument 1 of
    F.linear under an input spec naming it (``"*"``: the default config's), as an activation. The
    recipe had no site for it and said nothing (0.0020 weight scale in coreai_opt, float in qstats)."""
    model = _weight_normed()
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_input_spec={key: _spec()}, op_output_spec=None, op_state_spec=None))
    with pytest.raises(ValueError, match=r"module '0' \(ParametrizedLinear\): its weight is computed by a parametrization"):
        qstats.coreai_opt.recipe_from_coreai_opt(config, model)
    prepared = _coreai_opt_calibrated(model, config, *_data(16, count=1))[0]
    assert hasattr(prepared[0], "linear_quantize_weight")  # coreai_opt's quantizer of that argument


def test_a_parametrized_weight_is_left_float_by_weight_specs_as_in_coreai_opt(single_thread_quiet):
    """Without an input spec naming it, coreai_opt's state specs leave the computed weight float, as
    the recipe does (no parameter of that name)."""
    config = QuantizerConfig(execution_mode=EAGER, global_config=ModuleQuantizerConfig(
        op_state_spec={"weight": _spec(granularity={"type": "per_channel"})},
        op_input_spec={0: _spec(torch.uint8, "asymmetric")}, op_output_spec=None))
    equal, total = _compare(_weight_normed(), config, *_data(16))
    assert equal == total == 2 * 3  # both inputs, the second weight
