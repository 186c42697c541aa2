"""Fused NVFP4 global scales (qstats/fused.py) on the edges of the fused groups: ``float_range`` in a
fused group (compute_qparams takes it, the fused amax raised), and a group whose members are one
module under two names (``v_proj = k_proj``), against compressed-tensors' ``generate_gparam`` and
llm-compressor's ``fuse_weight_observers``."""

import warnings

import pytest
import torch

import qstats

observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

warnings.filterwarnings("ignore")


def _states(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(16, 32, generator=g), 3 * torch.randn(8, 32, generator=g)]
    obs = qstats.minmax(spec)
    return weights, [obs.update(obs.init(w), w) for w in weights]


@pytest.mark.parametrize("float_range", [(-0.1, 0.1), (-2.0, 0.5)])
def test_float_range_pins_the_fused_global_scale_as_compressed_tensors(float_range):
    """compute_qparams takes ``float_range`` (coreai_opt's pinned range), but fused_qparams,
    fused_global_scale and compute_qparams_tree (its default ``fuse=True``) raised
    "MinMaxState takes no options, got ['float_range']". Pinned at both ends, every member's range is
    ``float_range``: compressed-tensors' generate_gparam and calculate_qparams of that range."""
    args = NVFP4["weights"]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    _, states = _states(spec)
    lo, hi = float_range
    expected = generate_gparam(torch.tensor([lo]), torch.tensor([hi]))
    assert torch.equal(qstats.fused_global_scale(states, spec, float_range=float_range).reshape(1), expected)
    for state, qparams in zip(states, qstats.fused_qparams(states, spec, float_range=float_range)):
        rows, groups = qparams.scale.shape
        scale, _ = calculate_qparams(torch.full((rows, groups), lo), torch.full((rows, groups), hi), args,
                                     global_scale=expected)
        assert torch.equal(qparams.global_scale.reshape(1), expected)
        assert torch.equal(qparams.scale, scale.float())


def test_float_range_in_a_recipe_fuses_q_k_v():
    """A Rule's ``qparams_kwargs={"float_range": ...}`` on NVFP4 q/k/v: compute_qparams_tree raised
    the TypeError above unless called with ``fuse=False``."""
    args = NVFP4["weights"]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    attention = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, torch.nn.Linear(32, 16, bias=False))
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec,
                                        qparams_kwargs={"float_range": (None, 0.25)})])
    states = qstats.calibrate(attention, [], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, attention)
    # low end observed, high end pinned to 0.25: the group's amax is the largest of those
    lows = torch.stack([getattr(attention, name).weight.min() for name in ("q_proj", "k_proj", "v_proj")])
    expected = generate_gparam(lows.min().reshape(1), torch.tensor([0.25]))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(qparams[name]["weight"].global_scale.reshape(1), expected), name


def test_fused_qparams_refuses_a_global_scale_naming_it():
    """A ``global_scale=`` option went to the range rule: "MinMaxState takes no options"."""
    spec = qstats.preset("nvfp4")
    _, states = _states(spec)
    with pytest.raises(TypeError, match="global_scale is the group's"):
        qstats.fused_qparams(states, spec, global_scale=torch.tensor(1.0))


class _TiedKVAttention(torch.nn.Module):
    """Attention whose values are its keys: ``v_proj`` is the ``k_proj`` module."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_proj = torch.nn.Linear(32, 16, bias=False)
        self.k_proj = torch.nn.Linear(32, 16, bias=False)
        self.v_proj = self.k_proj
        self.q_proj.weight.data = torch.randn(16, 32, generator=g)
        self.k_proj.weight.data = 5 * torch.randn(16, 32, generator=g)

    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x) + self.v_proj(x)


def test_a_member_tied_to_another_counts_once_as_llm_compressor():
    """fused_groups gave ("0.q_proj", "0.k_proj", "0.v_proj") for ``v_proj = k_proj``; "0.v_proj"
    is no path of named_modules, so compute_qparams_tree warned that the group is not observed under
    one spec and left q_proj and k_proj their own global scales. llm-compressor fuses q and k."""
    from llmcompressor.observers.helpers import fuse_weight_observers

    model = torch.nn.Sequential(_TiedKVAttention())
    assert qstats.fused.fused_groups(model) == [("0.q_proj", "0.k_proj")]
    args = NVFP4["weights"]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        states = qstats.calibrate(model, [], recipe, progress=False)
        qparams = qstats.compute_qparams_tree(states, recipe, model)
    for name in ("q_proj", "k_proj"):
        getattr(model[0], name).weight_observer = observers.Observer.load_from_registry(
            "memoryless_minmax", base_name="weight", args=args.model_copy(deep=True))
    fuse_weight_observers(model)
    for name in ("q_proj", "k_proj"):
        module = getattr(model[0], name)
        module.weight_observer(module.weight)
    for name in ("q_proj", "k_proj"):
        reference = getattr(model[0], name).weight_observer.get_qparams()
        ours = qparams[f"0.{name}"]["weight"]
        assert torch.equal(ours.global_scale.reshape(1), reference["global_scale"]), name
        assert torch.equal(ours.scale, reference["scale"].float()), name


@pytest.mark.parametrize("stacked", ["yes", None, 1])
def test_stacked_must_be_a_bool(stacked):
    """``stacked=None`` read a list as not stacked and ``stacked="yes"`` a stacked state as stacked,
    silently (compute_qparams_tree's ``fuse`` is checked the same way)."""
    spec = qstats.preset("nvfp4")
    _, states = _states(spec)
    with pytest.raises(TypeError, match="stacked must be True or False"):
        qstats.fused_qparams(states, spec, stacked=stacked)


def test_a_group_that_is_not_a_sequence_is_named():
    """``fused_global_scale(None, spec)`` raised a bare "'NoneType' object is not iterable"."""
    with pytest.raises(TypeError, match="sequence of states"):
        qstats.fused_global_scale(None, qstats.preset("nvfp4"))
