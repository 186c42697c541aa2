"""Fused scale groups (qstats/fused.py) against llm-compressor's FusionHandler and against the
global scale of the concatenated tensor."""

import warnings

import pytest
import torch

import qstats

warnings.filterwarnings("ignore")

observers = pytest.importorskip("llmcompressor.observers")
from llmcompressor.observers.fusion import FusionHandler  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402


def _weights(seed, shapes=((8, 32), (16, 32), (8, 32)), spreads=(1.0, 3.0, 0.1)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * spread for shape, spread in zip(shapes, spreads)]


def _llmcompressor_fused(weights):
    args = NVFP4["weights"]
    modules = []
    for w in weights:
        module = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        module.weight.data = w
        modules.append(module)
    group = [observers.Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args.model_copy(deep=True)) for _ in weights]
    FusionHandler.fuse(list(zip(group, modules)))
    for observer, w in zip(group, weights):
        observer(w)
    return args, [observer.get_qparams() for observer in group]


@pytest.mark.parametrize("seed", (0, 1))
def test_qkv_group_matches_llmcompressor_fusion_handler(seed):
    weights = _weights(seed)
    args, reference = _llmcompressor_fused(weights)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.minmax(spec)
    states = [obs.update(obs.init(w), w) for w in weights]
    qparams = qstats.fused_qparams(states, spec)
    for w, qp, ref in zip(weights, qparams, reference):
        assert torch.equal(qp.global_scale.reshape(1), ref["global_scale"])
        assert torch.equal(qp.scale, ref["scale"])
        expected = ct_fake_quantize(w, ref["scale"], ref["zero_point"], args, global_scale=ref["global_scale"])
        assert torch.equal(qstats.fake_quantize(w, qp, spec), expected)


@pytest.mark.parametrize("formula", ("amax_over_range", "range_over_amax"))
def test_fused_global_scale_is_that_of_the_concatenated_tensor(formula):
    weights = _weights(2)
    spec = qstats.preset("nvfp4", global_scale_formula=formula)
    obs = qstats.minmax(spec)
    states = [obs.update(obs.init(w), w) for w in weights]
    concatenated = torch.cat(weights)
    whole = qstats.compute_qparams(obs.update(obs.init(concatenated), concatenated), spec)
    assert torch.equal(qstats.fused_global_scale(states, spec), whole.global_scale)
    fused = qstats.fused_qparams(states, spec)
    assert torch.equal(torch.cat([qp.scale for qp in fused]), whole.scale)


def test_stacked_experts_match_loop_and_ignore_uncalibrated_experts():
    g = torch.Generator().manual_seed(3)
    experts = torch.randn(4, 8, 32, generator=g) * torch.tensor([1.0, 2.0, 0.5, 50.0]).view(4, 1, 1)
    spec = qstats.preset("nvfp4", on_uncalibrated="fallback")
    obs = qstats.minmax(spec)
    # expert 3 (the one with the largest weights) received no tokens: weight 0 everywhere
    routed = torch.tensor([1.0, 1.0, 1.0, 0.0]).view(4, 1).expand(4, 8)
    stacked = torch.func.vmap(lambda x, w: obs.update(obs.init(x), x, weight=w))(experts, routed)
    fused = qstats.fused_qparams(stacked, spec, stacked=True)
    seen = experts[:3]
    expected_global = qstats.fused_global_scale(
        [obs.update(obs.init(x), x) for x in seen], spec
    )
    assert torch.equal(fused.global_scale, expected_global.expand(4))
    for i in range(3):
        state_i = type(stacked)(*(field[i] for field in stacked))
        one = qstats.compute_qparams(state_i, spec, global_scale=expected_global)
        assert torch.equal(fused.scale[i], one.scale)
    assert not fused.calibrated[3].any()


def test_stacked_experts_match_llmcompressor():
    weights = _weights(4, shapes=((8, 32),) * 3, spreads=(1.0, 4.0, 0.25))
    args, reference = _llmcompressor_fused(weights)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.minmax(spec)
    stacked_x = torch.stack(weights)
    stacked = torch.func.vmap(lambda x: obs.update(obs.init(x), x))(stacked_x)
    fused = qstats.fused_qparams(stacked, spec, stacked=True)
    for i, ref in enumerate(reference):
        assert torch.equal(fused.global_scale[i].reshape(1), ref["global_scale"])
        assert torch.equal(fused.scale[i], ref["scale"])


def test_bad_groups_raise():
    spec = qstats.preset("nvfp4")
    with pytest.raises(ValueError, match="no states"):
        qstats.fused_global_scale([], spec)
    obs = qstats.minmax(spec)
    x = torch.randn(4, 16)
    other = qstats.moving_average_minmax(spec, 0.1)
    with pytest.raises(TypeError, match="mixes state types"):
        qstats.fused_global_scale([obs.update(obs.init(x), x), other.update(other.init(x), x)], spec)


def test_a_generator_of_states_is_read_once():
    # fused_qparams read its group twice (global scale, then the per-state qparams): a generator
    # was exhausted by the first pass and raised "the group holds no states".
    spec = qstats.preset("nvfp4")
    obs = qstats.minmax(spec)
    weights = [torch.randn(4, 32), 3 * torch.randn(4, 32)]
    fused = qstats.fused_qparams((obs.update(obs.init(w), w) for w in weights), spec)
    both = torch.cat(weights)
    concatenated = qstats.compute_qparams(obs.update(obs.init(both), both), spec)
    assert len(fused) == 2
    for qparams in fused:
        assert torch.equal(qparams.global_scale, concatenated.global_scale)


def test_stacked_needs_one_stacked_state():
    spec = qstats.preset("nvfp4")
    obs = qstats.minmax(spec)
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="stacked=True"):
        qstats.fused_qparams([obs.update(obs.init(x), x)] * 2, spec, stacked=True)


class _KEqVAttention(torch.nn.Module):
    """Gemma 4's full-attention layers with ``attention_k_eq_v``: ``v_proj`` is None (values are
    the keys), q_proj and k_proj remain."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.q_proj = torch.nn.Linear(32, 16, bias=False)
        self.k_proj = torch.nn.Linear(32, 8, bias=False)
        self.v_proj = None
        self.q_proj.weight.data = torch.randn(16, 32, generator=g)
        self.k_proj.weight.data = 5 * torch.randn(8, 32, generator=g)

    def forward(self, x):
        return self.q_proj(x).sum(-1) + self.k_proj(x).sum(-1)


def test_a_none_member_leaves_the_rest_of_the_group_fused():
    """llm-compressor's ``fuse_weight_observers`` fuses the members of a group that a module has as
    attributes, skipping one that is None; qstats' fused_groups dropped the whole group, so q_proj
    and k_proj kept their own global scales."""
    from llmcompressor.observers.helpers import fuse_weight_observers

    model = torch.nn.Sequential(_KEqVAttention())
    assert qstats.fused.fused_groups(model) == [("0.q_proj", "0.k_proj")]
    args = NVFP4["weights"]
    for name in ("q_proj", "k_proj"):
        module = getattr(model[0], name)
        module.weight_observer = observers.Observer.load_from_registry(
            "memoryless_minmax", base_name="weight", args=args.model_copy(deep=True))
    fuse_weight_observers(model)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(2, 32)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for name in ("q_proj", "k_proj"):
        module = getattr(model[0], name)
        module.weight_observer(module.weight)
    for name in ("q_proj", "k_proj"):
        module = getattr(model[0], name)
        ref = module.weight_observer.get_qparams()
        assert torch.equal(qparams[f"0.{name}"]["weight"].global_scale.reshape(1), ref["global_scale"]), name
        assert torch.equal(qparams[f"0.{name}"]["weight"].scale, ref["scale"]), name


def test_a_group_given_as_a_mapping_is_named():
    """A dict of states iterated its keys: the error read 'no range rule for str'."""
    spec = qstats.preset("nvfp4")
    obs = qstats.minmax(spec)
    x = torch.randn(4, 32)
    state = obs.update(obs.init(x), x)
    with pytest.raises(TypeError, match="sequence of states"):
        qstats.fused_qparams({"q": state, "k": state}, spec)
