"""Edges of imatrix / moments / fixed qparams, each against a reference: torch.ao's
FixedQParamsObserver and float-qparams fake-quant kernel, llm-compressor 0.14's imatrix_mse
observer, or an independent float computation."""

import warnings

import numpy as np
import pytest
import torch
from torch.ao.quantization.observer import FixedQParamsObserver

import qstats

warnings.filterwarnings("ignore")


def _float_domain_spec():
    return qstats.QuantSpec(dtype="uint8", mapping="asymmetric", zero_point_domain="float")


@pytest.mark.parametrize("scale, zero_point", [(10.0, 1e38), (1e30, 1e10), (1e30, -1e10)])
def test_a_float_zero_point_whose_codes_dequantize_past_float32_is_refused(scale, zero_point):
    """The farthest-code check measured a float zero point's codes from 0, not from the zero point:
    these constants were accepted and every code dequantized to -3.4e38 (float32's edge)."""
    spec = _float_domain_spec()
    qmin, qmax = spec.qrange
    # independently: a code's value (q - zero_point) * scale is not finite in float32
    ends = (torch.tensor([qmin, qmax], dtype=torch.float32) - zero_point) * torch.tensor(scale, dtype=torch.float32)
    assert not torch.isfinite(ends).all()
    with pytest.raises(ValueError, match="values of the end codes"):
        qstats.fixed_qparams(spec, scale, zero_point)


def test_a_float_zero_point_in_range_still_fake_quantizes_as_torchs_float_qparams_kernel():
    spec = _float_domain_spec()
    obs = qstats.fixed_qparams(spec, 0.5, 3.5)
    x = torch.linspace(-3, 3, 13)
    qp = qstats.compute_qparams(obs.update(obs.init(x), x), spec)
    expected = torch.fake_quantize_per_channel_affine(x[None], torch.tensor([0.5]), torch.tensor([3.5]), 0, 0, 255)[0]
    assert torch.equal(qstats.fake_quantize(x, qp, spec), expected)


@pytest.mark.parametrize("name, kwargs", [
    ("scale", dict(scale="0.5")),
    ("scale", dict(scale=None)),
    ("scale", dict(scale=0.5 + 1j)),
    ("zero_point", dict(scale=0.5, zero_point="3")),
    ("zero_point", dict(scale=0.5, zero_point=2**63)),
    ("zero_point", dict(scale=0.5, zero_point=True)),
], ids=["str-scale", "None-scale", "complex-scale", "str-zero-point", "int-past-int64", "bool-zero-point"])
def test_constants_that_are_not_real_numbers_raise_naming_the_argument(name, kwargs):
    """torch's own errors ("new(): invalid data type 'str'", "Overflow when unpacking long long")
    came out bare, naming neither argument; a bool zero point was taken as 1."""
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    with pytest.raises(TypeError, match=f"fixed_qparams: {name} must be a real number"):
        qstats.fixed_qparams(spec, **kwargs)


def test_a_scale_tensor_with_a_graph_is_held_without_it_as_torch_ao_holds_it():
    """The state kept the caller's autograd graph (scale with a grad_fn); torch.ao's buffer is a
    plain tensor."""
    scale = torch.tensor(0.5, requires_grad=True) * 1.0
    theirs = FixedQParamsObserver(scale=scale, zero_point=3)
    obs = qstats.fixed_qparams(qstats.QuantSpec(dtype="uint8", mapping="asymmetric"), scale, 3)
    state = obs.init(torch.zeros(4))
    assert state.scale.requires_grad == theirs.scale.requires_grad is False
    assert state.scale.grad_fn is None
    assert float(state.scale) == float(theirs.scale) and int(state.zero_point) == int(theirs.zero_point)


@pytest.mark.parametrize("weight_shape", [(16, 64.5), (-1, 64), "ab", (True, 64)],
                         ids=["fraction", "negative", "str", "bool"])
def test_imatrix_mse_refuses_a_weight_shape_that_is_not_non_negative_ints(weight_shape):
    """int() truncated 64.5 to 64 and let -1 through (the importance expanded to any size)."""
    x = torch.randn(4, 64)
    obs = qstats.imatrix()
    state = obs.update(obs.init(x), x)
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    with pytest.raises(ValueError, match="at least two dimensions .*, each a non-negative int"):
        qstats.imatrix_mse(spec, weight_shape, state)
    assert qstats.imatrix_mse(spec, torch.Size([16, 64]), state).name == "imatrix_mse"


def test_a_one_dimensional_input_is_one_token_where_llm_compressor_sums_every_element():
    """The documented difference: llm-compressor's hook reduces a 1-D input with ``sum(dim=[])``
    (every element), so its search is the uniform one; qstats' importance of that input is the
    importance of the same token as a [1, in] batch, which llm-compressor weights by channel."""
    pytest.importorskip("llmcompressor.observers")
    from _shared import llm_compressor_imatrix_mse

    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 16, bias=False)
    token = torch.randn(128) * torch.logspace(-3, 3, 128)
    fields = dict(num_bits=4, type="int", symmetric=False, strategy="channel")
    args, flat_scale, _ = llm_compressor_imatrix_mse(fields, layer, [token], patience=10**6)
    _, row_scale, _ = llm_compressor_imatrix_mse(fields, layer, [token[None]], patience=10**6)
    _, uniform_scale, _ = llm_compressor_imatrix_mse(fields, layer, [], patience=10**6)
    assert torch.equal(flat_scale, uniform_scale) and not torch.equal(row_scale, uniform_scale)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.imatrix()
    state = obs.update(obs.init(token), token)
    torch.testing.assert_close(qstats.importance(state), token.double() ** 2, rtol=0, atol=0)
    w = layer.weight.data
    weighted = qstats.imatrix_mse(spec, w.shape, state)
    qp = qstats.compute_qparams(weighted.update(weighted.init(w), w), spec)
    assert torch.equal(qp.scale, row_scale.reshape(qp.scale.shape))


def _moments_state():
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    obs = qstats.moments(spec)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    return spec, obs, x, obs.update(obs.init(x), x)


@pytest.mark.parametrize("field, change", [
    ("count", lambda t: t.double()),
    ("total", lambda t: t.float()),
    ("lp_order", lambda t: t[:2]),
    ("count", lambda t: t[:2]),
], ids=["float64-count", "float32-total", "short-lp-order", "short-count"])
def test_corrupt_moments_states_raise_naming_the_field(field, change):
    """An update took a float64 count (the state came back float64) and a short lp_order failed
    inside torch ("The size of tensor a (2) must match ..."), as did compute_qparams of a short
    count; imatrix's states were already checked this way."""
    spec, obs, x, state = _moments_state()
    bad = state._replace(**{field: change(getattr(state, field))})
    for call in (lambda: obs.update(bad, x), lambda: obs.merge(state, bad), lambda: qstats.compute_qparams(bad, spec)):
        with pytest.raises(ValueError, match=r"MomentsState(\.| fields do not line up)"):
            call()
    # a good state is untouched by the checks: its statistics are numpy's
    data = x.double().numpy()
    np.testing.assert_allclose(state.mean.numpy(), data.mean(1), rtol=1e-12)
    np.testing.assert_allclose(state.variance.numpy(), data.var(1), rtol=1e-10)


def test_a_torchao_float_zero_point_is_checked_in_the_input_units():
    """torchao's float zero point is a value in the input's units (``(q - mid) * scale + zero_point``):
    constants whose codes dequantize to finite values are accepted (they were refused by the code-unit
    bound), and ones whose ends overflow are refused."""
    quant_primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    spec = qstats.QuantSpec(dtype="uint4", mapping="asymmetric", zero_point_domain="float", convention="torchao")
    for scale, zero_point in ((1e37, 50.0), (2.0, 3e38)):
        ends = quant_primitives._dequantize_affine_tinygemm(
            torch.tensor([[0, 15]], dtype=torch.uint8), (1, 2), torch.tensor([[scale]]), torch.tensor([[zero_point]]),
            torch.uint8, 0, 15)
        assert torch.isfinite(ends).all()
        qp = qstats.compute_qparams(qstats.fixed_qparams(spec, scale, zero_point).init(torch.zeros(4)), spec)
        assert torch.equal(qstats.dequantize(torch.tensor([0, 15], dtype=torch.uint8), qp, spec), ends[0])
    with pytest.raises(ValueError, match="values of the end codes"):
        qstats.fixed_qparams(spec, 1e37, 3.4e38)


def test_qparams_of_an_imatrix_state_name_imatrix_mse_not_a_range_rule_to_register():
    """An imatrix state holds the importance of a layer's input channels, not a range: its qparams
    said "no range rule for IMatrixState; register one with qstats.register_range_rule", where the
    way on is the weight search it feeds (as a hessian state's error names qstats.gptq)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), observer=qstats.imatrix)])
    states = qstats.calibrate(model, [torch.randn(5, 4)], recipe, progress=False)
    with pytest.raises(TypeError, match=r"'0'.*'input'.*IMatrixState has no range.*qstats\.imatrix_mse") as caught:
        qstats.compute_qparams_tree(states, recipe, model)
    assert "register_range_rule" not in str(caught.value)
    with pytest.raises(TypeError, match=r"IMatrixState has no range.*qstats\.imatrix_mse"):
        qstats.compute_qparams(states["0"]["input"], qstats.QuantSpec(dtype="int8"))
