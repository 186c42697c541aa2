"""qstats.report and qstats.plot at their edges: bf16/fp16 models measured as compressed-tensors
computes them, sites no batch reached, bad qparams, and the plotted clipping range against
torchao's and compressed-tensors' own dequantization."""

import math

import pytest
import torch
from _shared import left_padded_qwen2_moe

import qstats

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp  # noqa: E402


def _sqnr(x, quantized, keep=None):
    x, noise = x.double(), (x.double() - quantized.double())
    if keep is not None:
        x, noise = x[keep], noise[keep]
    return 10 * math.log10(float(x.pow(2).sum()) / float(noise.pow(2).sum()))


def _w8a8(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(dtype).eval()
    batches = [torch.randn(3, 5, 128).to(dtype) * (i + 1) for i in range(2)]
    recipe = qstats.Recipe.from_scheme("W8A8", observed_dtype=dtype)
    states = qstats.calibrate(model, batches, recipe, progress=False)
    return model, recipe, states, qstats.compute_qparams_tree(states, recipe, model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_are_measured_as_the_model_computes_them(dtype):
    """compressed-tensors fake-quantizes a bf16 weight in bf16: its values round to bf16, which
    costs 1.4 dB at int8 (the report measured a float32 copy: 47.34 dB against 45.90)."""
    model, recipe, states, qparams = _w8a8(dtype)
    rows = {(row.module, row.site): row for row in qstats.report(states, qparams, model, recipe)}
    args = preset_name_to_scheme("W8A8", ["Linear"]).weights
    for index in (0, 2):
        weight, qp = model[index].weight.detach(), qparams[str(index)]["weight"]
        scale = qp.scale.to(dtype)[:, None]
        reference = ct_fake_quantize(weight, scale, qp.zero_point[:, None], args)
        codes = torch.round(weight / scale)
        row = rows[(str(index), "weight")]
        assert row.sqnr_db == pytest.approx(_sqnr(weight, reference), rel=1e-6)
        assert row.clipped_fraction == pytest.approx(float(((codes < -128) | (codes > 127)).float().mean()))


def test_half_precision_dynamic_inputs_with_padding_match_compressed_tensors():
    """Per-token inputs scaled at run time in bf16, padding left out: SQNR and clipped fraction
    as compressed-tensors' dynamic scales and fake quantization give them (in bf16)."""
    model, recipe, states, qparams = _w8a8(torch.bfloat16)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    held_out = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3)).bfloat16() * 3
    rep = qstats.report(states, qparams, model, recipe, [held_out], observation_weight=lambda batch: mask)
    rows = {(row.module, row.site): row for row in rep}
    seen = {}
    handles = [model[i].register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0])) for i in (0, 2)]
    with torch.no_grad():
        model(held_out)
    for handle in handles:
        handle.remove()
    args = preset_name_to_scheme("W8A8", ["Linear"]).input_activations
    for index in (0, 2):
        x = seen[index]
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, model[index])
        reference = ct_fake_quantize(x, scale, zero_point, args)
        keep = mask.bool()[:, :, None].expand(x.shape)
        codes = torch.round((x / scale).float())
        clipped = float(((codes < -128) | (codes > 127))[keep].float().mean())
        row = rows[(str(index), "input")]
        assert row.sqnr_db == pytest.approx(_sqnr(x, reference, keep), rel=1e-6)
        assert row.clipped_fraction == pytest.approx(clipped, abs=1e-9)
        assert row.nonfinite == 0


def test_a_site_no_batch_reaches_has_no_nonfinite_count():
    """Every measured field of a site the batches never reach is None (nonfinite was 0)."""

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wide, self.narrow = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.wide(x) if x.shape[0] > 2 else self.narrow(x)

    torch.manual_seed(0)
    model = Branch().eval()
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)])
    states = qstats.calibrate(model, [torch.randn(4, 8), torch.randn(1, 8)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    rows = {row.module: row for row in qstats.report(states, qparams, model, recipe, [torch.randn(4, 8)])}
    assert rows["narrow"].sqnr_db is None and rows["narrow"].clipped_fraction is None
    assert rows["narrow"].nonfinite is None
    assert rows["wide"].nonfinite == 0 and rows["wide"].sqnr_db is not None
    assert ",," in qstats.report(states, qparams, model, recipe, [torch.randn(4, 8)]).to_csv().splitlines()[2]


def test_report_refuses_missing_and_wrong_qparams_by_name():
    """A None entry of a static site and the states tree passed as qparams were AttributeErrors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input", "weight"), spec=qstats.QuantSpec())])
    states = qstats.calibrate(model, [torch.randn(4, 8)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    for site in ("input", "weight"):
        with pytest.raises(ValueError, match=f"qparams\\['0'\\]\\['{site}'\\] is None"):
            qstats.report(states, {"0": {**qparams["0"], site: None}}, model, recipe, [torch.randn(2, 8)])
    with pytest.raises(TypeError, match="not QParams"):
        qstats.report(states, states, model, recipe)
    with pytest.raises(TypeError, match="not QParams"):
        qstats.report(states, states)
    # an activation site left unmeasured (no batches), or a site without model and recipe: no scale
    rows = qstats.report(states, {"0": {**qparams["0"], "input": None}}, model, recipe)
    assert next(row for row in rows if row.site == "input").mean_scale is None
    row = next(row for row in qstats.report(states, {"0": {**qparams["0"], "weight": None}}) if row.site == "weight")
    assert row.mean_scale is None and row.coverage is None


def _histogram(spec, x):
    observer = qstats.histogram(spec, buckets_per_octave=16, octaves=16)
    return observer.update(observer.init(x), x)


def _lines(figure):
    return [line.get_xdata()[0] for line in figure.axes[0].get_lines()]


def test_plot_of_a_float_zero_point_draws_torchaos_dequantized_ends():
    """torchao's float zero point (tinygemm) dequantizes as ``(q - mid) * scale + zero_point``:
    codes 0 and 15 land on the data's extremes, not at ``(q - zero_point) * scale``."""
    pytest.importorskip("matplotlib")
    quant_primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    mapping, domain = quant_primitives.MappingType.ASYMMETRIC, quant_primitives.ZeroPointDomain.FLOAT
    torch.manual_seed(0)
    x = torch.randn(1, 64) * 2 + 1
    spec = qstats.QuantSpec.from_torchao(
        torch.uint8, mapping_type=mapping, block_size=(1, 64), shape=(1, 64), zero_point_domain=domain,
        quant_min=0, quant_max=15, preserve_zero=False, zero_point_dtype=torch.float32,
    )
    state = _histogram(spec, x)
    qparams = qstats.compute_qparams(state, spec)  # the l2 search's range (it clips the tails)
    ends = quant_primitives._dequantize_affine_tinygemm(
        torch.tensor([[0, 15]], dtype=torch.uint8), (1, 2), qparams.scale.reshape(1, 1),
        qparams.zero_point.reshape(1, 1), torch.uint8, 0, 15,
    )
    assert _lines(qstats.plot.histogram(state, qparams, spec)) == pytest.approx(ends[0].tolist(), rel=1e-6)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "group"])
def test_plot_of_a_bf16_spec_draws_compressed_tensors_ends(strategy):
    """The ends are the values compressed-tensors gives codes qmin and qmax in bf16 (rounded there)."""
    pytest.importorskip("matplotlib")
    kind = dict(num_bits=8, type="float") if strategy == "tensor" else dict(num_bits=4, type="int")
    args = QuantizationArgs(strategy=strategy, symmetric=strategy != "group",
                            group_size=32 if strategy == "group" else None, **kind)
    spec = qstats.QuantSpec.from_compressed_tensors(args).replace(compute_dtype="bfloat16")
    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 3).bfloat16()
    state = _histogram(spec, x)
    qparams = qstats.compute_qparams(state, spec)
    index = {"tensor": None, "channel": 1, "group": (1, 1)}[strategy]
    scale, zero_point = qparams.scale.bfloat16(), qparams.zero_point
    if scale.dim() == 1:
        scale, zero_point = scale[:, None], zero_point[:, None]
    extremes = torch.full((4, 64), 1e4, dtype=torch.bfloat16)
    extremes[:, 1::2] = -1e4
    clipped = ct_fake_quantize(extremes, scale, zero_point, args)
    clipped = {"tensor": clipped, "channel": clipped[1], "group": clipped[1, 32:]}[strategy]
    drawn = _lines(qstats.plot.histogram(state, qparams, spec, index=index))
    assert drawn == [float(clipped.min()), float(clipped.max())]


def test_plot_refuses_a_bad_index_and_bad_qparams_by_name():
    """Out-of-range and non-integer indices, None entries, the state as qparams and qparams of
    another shape were bare IndexErrors, AttributeErrors and TypeErrors from deep inside."""
    pytest.importorskip("matplotlib")
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    state = _histogram(spec, torch.randn(3, 300))
    qparams = qstats.compute_qparams(state, spec)
    for index in (5, -4, 1.0, True, (1, 0)):
        with pytest.raises(ValueError, match="index"):
            qstats.plot.histogram(state, qparams, spec, index=index)
    assert qstats.plot.histogram(state, qparams, spec, index=torch.tensor(-1)) is not None
    with pytest.raises(TypeError, match="'a' is a NoneType, not QParams"):
        qstats.plot.histogram(state, {"a": None}, spec, index=0)
    with pytest.raises(TypeError, match="got HistogramState"):
        qstats.plot.histogram(state, state, spec, index=0)
    whole = _histogram(qstats.QuantSpec(), torch.randn(300))
    with pytest.raises(ValueError, match=r"scale shape \(3,\).*do not fit the state.s histograms of shape \(\)"):
        qstats.plot.histogram(whole, qparams, qstats.QuantSpec())


def test_plot_of_torch_ao_float_qparams_draws_torchs_fake_quantized_ends():
    """torch.ao's ``per_channel_affine_float_qparams``: the ends are exactly the float32 values
    torch's fake-quant op clamps to (they were formed in float64)."""
    pytest.importorskip("matplotlib")
    spec = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0)
    torch.manual_seed(0)
    state = _histogram(spec, torch.randn(3, 200) * 2 + 1)
    qparams = qstats.compute_qparams(state, spec)
    extremes = torch.tensor([[1e4, -1e4]]).expand(3, 2)
    clipped = torch.fake_quantize_per_channel_affine(extremes, qparams.scale, qparams.zero_point, 0, 0, 255)
    for channel in range(3):
        drawn = _lines(qstats.plot.histogram(state, qparams, spec, index=channel))
        assert drawn == [float(clipped[channel].min()), float(clipped[channel].max())]


def test_padding_is_left_out_of_tokens_flattened_to_rows():
    """Qwen2-MoE's shared expert takes ``hidden_states.view(-1, hidden)``: the ``(batch, tokens)``
    observation weight fitted no ``[batch * tokens, hidden]`` input, so `report` measured its left
    padding (calibrate leaves it out). Against the SQNR of the unpadded rows, fake-quantized by
    torch under the same qparams, from plain hooks."""
    model, batch, mask = left_padded_qwen2_moe(layers=1)
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric")
    recipe = qstats.Recipe([qstats.Rule("re:.*shared_expert.down_proj", sites=("input",), spec=spec)])
    weight = lambda b: b["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, [batch], recipe, progress=False, observation_weight=weight)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams, model, recipe, [batch], observation_weight=weight).rows
    seen = []
    site = model.model.layers[0].mlp.shared_expert.down_proj
    handle = site.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    (x,) = seen
    assert x.ndim == 2  # [batch * tokens, hidden]
    x = x[mask.reshape(-1) != 0]
    qp = qparams[row.module]["input"]
    quantized = torch.fake_quantize_per_tensor_affine(x, float(qp.scale), int(qp.zero_point), 0, 255)
    assert math.isclose(row.sqnr_db, _sqnr(x, quantized), rel_tol=1e-5)
