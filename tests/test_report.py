"""qstats.report: figures against torch's own fake-quant ops and plain tensor arithmetic."""

import csv
import io
import json
import math

import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver

import qstats

WEIGHT_SPEC = qstats.QuantSpec.from_torch_ao(dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)
INPUT_SPEC = qstats.QuantSpec.from_torch_ao(dtype=torch.quint8, qscheme=torch.per_tensor_affine)


def _setup(averaging_constant=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 8, generator=generator) * (1 + 2 * i) for i in range(3)]
    if averaging_constant is None:
        input_rule = qstats.Rule("Linear", sites=("input",), observer=qstats.minmax, spec=INPUT_SPEC)
    else:
        input_rule = qstats.Rule(
            "Linear",
            sites=("input",),
            observer=qstats.moving_average_minmax,
            spec=INPUT_SPEC,
            observer_kwargs={"averaging_constant": averaging_constant},
        )
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC), input_rule])
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    return model, batches, recipe, states, qparams


def _sqnr(x, quantized):
    return 10 * math.log10(float(x.pow(2).sum()) / float((x - quantized).pow(2).sum()))


def test_weight_rows_match_torch_fake_quant():
    model, batches, recipe, states, qparams = _setup()
    rep = qstats.report(states, qparams, model, recipe)
    rows = {(row.module, row.site): row for row in rep.rows}
    for index, name in ((0, "0"), (2, "2")):
        weight = model[index].weight.detach()
        observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        quantized = torch.fake_quantize_per_channel_affine(weight, scale, zero_point.int(), 0, -128, 127)
        codes = torch.round(weight / scale[:, None])
        row = rows[(name, "weight")]
        assert row.sqnr_db == pytest.approx(_sqnr(weight, quantized), rel=1e-6)
        assert row.clipped_fraction == pytest.approx(float(((codes < -128) | (codes > 127)).float().mean()))
        assert row.min == float(weight.min()) and row.max == float(weight.max())
        assert row.mean_scale == pytest.approx(float(scale.mean()), rel=1e-6)
        assert row.coverage == 1.0
        assert row.observer == "minmax"
    # without batches, activation rows have no measured error
    assert rows[("0", "input")].sqnr_db is None and rows[("0", "input")].clipped_fraction is None


def test_activation_rows_measured_on_batches_match_torch():
    model, batches, recipe, states, qparams = _setup(averaging_constant=0.5)
    held_out = [torch.randn(7, 8, generator=torch.Generator().manual_seed(5)) * 4]
    rep = qstats.report(states, qparams, model, recipe, held_out)
    row = next(r for r in rep.rows if (r.module, r.site) == ("0", "input"))
    observer = MovingAverageMinMaxObserver(averaging_constant=0.5, dtype=torch.quint8)
    for batch in batches:
        observer(batch)
    scale, zero_point = observer.calculate_qparams()
    x = held_out[0]
    quantized = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, 255)
    codes = torch.round(x * (1.0 / float(scale))) + int(zero_point)
    clipped = float(((codes < 0) | (codes > 255)).float().mean())
    assert clipped > 0  # the moving average range is narrower than these inputs
    assert row.clipped_fraction == pytest.approx(clipped)
    assert row.sqnr_db == pytest.approx(_sqnr(x, quantized), rel=1e-5)


def test_text_csv_json_and_worst():
    model, batches, recipe, states, qparams = _setup()
    rep = qstats.report(states, qparams, model, recipe, batches[:1])
    text = rep.text()
    for row in rep.rows:
        assert row.module in text
    parsed = list(csv.DictReader(io.StringIO(rep.to_csv())))
    assert len(parsed) == len(rep.rows) == 4
    for line, row in zip(parsed, rep.rows):
        assert line["module"] == row.module and line["site"] == row.site
        assert float(line["sqnr_db"]) == pytest.approx(row.sqnr_db)
    loaded = json.loads(rep.to_json())
    assert [item["site"] for item in loaded] == [row.site for row in rep.rows]
    worst = rep.worst(2)
    measured = sorted(row.sqnr_db for row in rep.rows if row.sqnr_db is not None)
    assert [row.sqnr_db for row in worst] == measured[:2]
    assert f"{worst[0].module} [{worst[0].site}]" in text


def test_report_without_model_and_bad_arguments():
    model, batches, recipe, states, qparams = _setup()
    rep = qstats.report(states, qparams)
    assert all(row.sqnr_db is None for row in rep.rows)
    assert "-" in rep.text()
    assert json.loads(rep.to_json())[0]["sqnr_db"] is None
    with pytest.raises(ValueError, match="both model and recipe"):
        qstats.report(states, qparams, model)
    with pytest.raises(ValueError, match="module '0' site 'input'"):
        qstats.report(states, {"0": {"weight": qparams["0"]["weight"]}, "2": qparams["2"]})


def test_uncovered_coverage_reported():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)])
    x = torch.randn(4, 4)
    x[1] = torch.nan  # one row (a set of qparams) with no finite value
    states = qstats.calibrate(model, [x], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    rep = qstats.report(states, qparams)
    assert rep.rows[0].coverage == 0.75
    reference = MinMaxObserver()
    reference(x[torch.isfinite(x).all(1)])
    assert rep.rows[0].max == float(reference.max_val)


class _Masked(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.proj = torch.nn.Linear(features, 3)

    def forward(self, x, attention_mask):
        return self.proj(x)


def test_report_leaves_padding_out_with_a_float_zero_point():
    """Zero is not representable with a float zero point: padding must not count as noise or clipping."""
    torch.manual_seed(0)
    model = _Masked(4).eval()
    spec = qstats.QuantSpec(
        dtype="uint8", mapping="asymmetric", zero_point_domain="float", granularity=qstats.PerAxis(-1)
    )
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",), spec=spec)])
    x = torch.rand(2, 5, 4) + 1.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    batches = [{"x": x, "attention_mask": mask}]
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=weight)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    row = qstats.report(states, qparams, model=model, recipe=recipe, batches=batches, observation_weight=weight).rows[0]

    qp = qparams["proj"]["input"]
    kept = x[mask.bool()]
    quantized = torch.fake_quantize_per_channel_affine(kept, qp.scale, qp.zero_point, 1, 0, 255)
    expected_sqnr = 10 * math.log10(float(kept.pow(2).sum()) / float((kept - quantized).pow(2).sum()))
    assert row.clipped_fraction == 0.0  # every kept value lies within the calibrated range
    assert row.sqnr_db == pytest.approx(expected_sqnr, rel=1e-5)


def test_worst_prints_a_table():
    """Issue 22, item 10: ``print(report.worst())`` printed a list of dataclass reprs; it is a
    Report (a sequence of its rows) printing as a table, lowest SQNR first."""
    model, batches, recipe, states, qparams = _setup()
    rep = qstats.report(states, qparams, model, recipe, batches[:1])
    worst = rep.worst(2)
    text = str(worst)
    assert "LayerReport(" not in text and "LayerReport(" not in str(rep)
    lines = text.splitlines()
    assert lines[0].split() == ["module", "site", "observer", "experts", "min", "max", "mean_scale",
                                "clipped_fraction", "sqnr_db", "coverage", "nonfinite"]
    assert len(lines) == 2 + 2 and "worst" not in text  # header, rule, two rows
    measured = sorted(row.sqnr_db for row in rep.rows if row.sqnr_db is not None)
    assert [float(line.split()[8]) for line in lines[2:]] == pytest.approx(measured[:2], rel=1e-3)
    assert len(worst) == 2 and list(worst) == list(worst.rows) and worst[0].sqnr_db == measured[0]


def test_nvfp4_mean_scale_is_the_step_in_the_tensors_units():
    """Issue 22, item 10: an NVFP4 row's ``mean_scale`` was the mean fp8 block scale (in units of
    1 / the global scale); it is the mean step, compressed-tensors' block scale divided by its
    global scale (``calculate_qparams`` on each group's range, ``generate_gparam``)."""
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = NVFP4["weights"]
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("weight",), spec=spec)])
    states = qstats.calibrate(model, [], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams, model, recipe).rows
    weight = model[0].weight.detach()
    groups = weight.reshape(8, 4, 16)
    min_val, max_val = groups.amin(-1), groups.amax(-1)
    global_scale = generate_gparam(weight.min(), weight.max())
    scale, _ = calculate_qparams(min_val, max_val, args, global_scale=global_scale)
    expected = float((scale.float() / global_scale.float()).mean())
    assert row.mean_scale == pytest.approx(expected, rel=1e-6)
    assert row.mean_scale == pytest.approx(float(groups.abs().amax(-1).mean()) / 6, rel=0.1)
    # without the recipe the spec is unknown: the QParams' scale field, as documented
    (bare,) = qstats.report(states, qparams).rows
    assert bare.mean_scale == pytest.approx(float(qparams["0"]["weight"].scale.float().mean()))


def _row(module, sqnr_db):
    return qstats.reporting.LayerReport(module, "weight", "minmax", 0, -1.0, 1.0, 0.5, 0.0, sqnr_db, 1.0)


def test_text_prints_negative_infinity_as_such():
    """A row with -inf SQNR (all-zero signal, nonzero noise) printed "inf" in the table: the best
    possible value instead of the worst."""
    rep = qstats.reporting.Report((_row("a", -math.inf), _row("b", math.inf)))
    table = rep.text(worst=0).splitlines()
    assert table[2].split()[8] == "-inf" and table[3].split()[8] == "inf"
    assert float(list(csv.DictReader(io.StringIO(rep.to_csv())))[0]["sqnr_db"]) == -math.inf


def test_worst_puts_nan_first_and_keeps_the_rest_in_order():
    """One NaN SQNR (a NaN in a held-out batch) made sorted() leave the order as it was: worst(2)
    returned a 50 dB row and the NaN row instead of the NaN row and the 10 dB row."""
    rep = qstats.reporting.Report(tuple(_row(str(i), s) for i, s in enumerate([50.0, math.nan, 10.0, 30.0])))
    worst = rep.worst(3)
    assert [row.module for row in worst] == ["1", "2", "3"]


def test_mean_scale_leaves_out_uncalibrated_experts(moe_example):
    """Experts the router never picks hold the fallback scale 1: averaging them in made the mean step
    of the MoE example's expert inputs 0.146 where the calibrated experts' steps average 0.024."""
    _, states, qparams, _ = moe_example.main(batches=1, verbose=False)
    plan = moe_example.RECIPE.resolve(moe_example.build())
    for rep in (qstats.report(states, qparams, recipe=plan), qstats.report(states, qparams)):
        rows = {(row.module, row.site): row for row in rep.rows}
        for path, entry in qparams.items():
            for site in ("input", "down_proj.input"):
                qp = entry[site]
                assert not bool(qp.calibrated.all())  # the example's dead experts
                expected = float(qp.scale[qp.calibrated].mean())
                assert rows[(path, site)].mean_scale == pytest.approx(expected, rel=1e-6)
                assert rows[(path, site)].coverage == float(qp.calibrated.float().mean())
    # a site with no calibrated entry has no step to average
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    spec = qstats.QuantSpec(on_uncalibrated="fallback")
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=spec)])
    states = qstats.calibrate(model, [torch.full((2, 4), math.nan)], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = qstats.report(states, qparams).rows
    assert row.coverage == 0.0 and row.mean_scale is None


def _finite_sqnr(x, quantized):
    keep = torch.isfinite(x)
    return _sqnr(x[keep].double(), quantized[keep].double())


def test_sqnr_and_clipping_leave_non_finite_values_out():
    """An Inf and a NaN in a held-out batch made layer 0's input SQNR NaN (and the Infs counted as
    clipped), an Inf weight made its site's SQNR NaN, while calibration's observers leave such values
    out and count them: the report measures the finite values and counts the rest in ``nonfinite``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4)).eval()
    with torch.no_grad():
        model[2].weight[1, 2] = math.inf
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 8, generator=generator) for _ in range(3)]
    batches[1][2, 3] = math.inf
    recipe = qstats.Recipe(
        [qstats.Rule("Linear", sites=("weight",), spec=WEIGHT_SPEC), qstats.Rule("0", sites=("input",), spec=INPUT_SPEC)]
    )
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    x = torch.randn(7, 8, generator=generator) * 3
    x[0, 0], x[3, 5], x[4, 1] = math.nan, math.inf, -math.inf
    rows = {(r.module, r.site): r for r in qstats.report(states, qparams, model, recipe, [x])}

    observer = MinMaxObserver(dtype=torch.quint8)
    observer(torch.cat([b[torch.isfinite(b)] for b in batches]))
    scale, zero_point = observer.calculate_qparams()
    quantized, in_range = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(
        x, float(scale), int(zero_point), 0, 255
    )
    row = rows[("0", "input")]
    assert row.nonfinite == 3
    assert row.sqnr_db == pytest.approx(_finite_sqnr(x, quantized), rel=1e-6)
    assert 0 < row.clipped_fraction == pytest.approx(float((~in_range[torch.isfinite(x)]).float().mean()))

    weight = model[2].weight.detach()
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    observer(torch.where(torch.isfinite(weight), weight, 0.0))  # torch.ao's range always holds 0
    scale, zero_point = observer.calculate_qparams()
    # torch's kernel also returns which codes fell in range
    quantized, in_range = torch.ops.aten.fake_quantize_per_channel_affine_cachemask(
        weight, scale, zero_point.int(), 0, -128, 127
    )
    row = rows[("2", "weight")]
    assert row.nonfinite == 1
    assert 0 < row.clipped_fraction == pytest.approx(float((~in_range[torch.isfinite(weight)]).float().mean()))
    assert row.sqnr_db == pytest.approx(_finite_sqnr(weight, quantized), rel=1e-6)
    assert rows[("0", "weight")].nonfinite == 0

    # on the calibration batches, the report counts what calibration's observer left out
    (row,) = [r for r in qstats.report(states, qparams, model, recipe, batches) if r.site == "input"]
    assert row.nonfinite == int(states["0"]["input"].nonfinite) == 1 and math.isfinite(row.sqnr_db)
    # a batch with no finite value: nothing to measure, everything counted
    (row,) = [r for r in qstats.report(states, qparams, model, recipe, [torch.full((2, 8), math.nan)])
              if r.site == "input"]
    assert row.sqnr_db is None and row.clipped_fraction is None and row.nonfinite == 16


def test_non_finite_padding_is_not_counted():
    """Non-finite values under the observation weight's zeros are padding: left out, not counted."""
    torch.manual_seed(0)
    model = _Masked(4).eval()
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",), spec=INPUT_SPEC)])
    x = torch.rand(2, 5, 4) + 1.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    x[0, 4, 1], x[1, 2, 0] = math.nan, math.inf  # one in the padding, one kept
    batches = [{"x": x, "attention_mask": mask}]
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=weight)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    row = qstats.report(states, qparams, model=model, recipe=recipe, batches=batches, observation_weight=weight).rows[0]
    kept = x[mask.bool()]
    qp = qparams["proj"]["input"]
    quantized = torch.fake_quantize_per_tensor_affine(kept, float(qp.scale), int(qp.zero_point), 0, 255)
    assert row.nonfinite == int(states["proj"]["input"].nonfinite) == 1
    assert row.sqnr_db == pytest.approx(_finite_sqnr(kept, quantized), rel=1e-6)


def _strict(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_json_is_strict_and_reads_back():
    """to_json wrote the bare tokens NaN and Infinity (Python's json extension): strict parsers
    (JavaScript's JSON.parse, jq) reject them. Non-finite numbers are the strings "Infinity",
    "-Infinity" and "NaN", which float() (and JavaScript's Number) read back."""
    model, batches, recipe, states, qparams = _setup()
    with torch.no_grad():
        model[2].weight.zero_()  # quantized exactly: noise 0, SQNR +inf
    states = qstats.calibrate(model, batches, recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    real = qstats.report(states, qparams, model, recipe, batches[:1])
    assert next(r for r in real if (r.module, r.site) == ("2", "weight")).sqnr_db == math.inf
    synthetic = qstats.reporting.Report((_row("a", -math.inf), _row("b", math.nan), _row("c", None)))
    for rep in (real, synthetic):
        text = rep.to_json()
        loaded = json.loads(text, parse_constant=_strict)
        assert json.dumps(loaded, allow_nan=False)
        for item, row in zip(loaded, rep, strict=True):
            assert list(item) == list(row.as_dict())
            for name, value in row.as_dict().items():
                if value is None or isinstance(value, str):
                    assert item[name] == value
                elif isinstance(value, float) and math.isnan(value):
                    assert item[name] == "NaN" and math.isnan(float(item[name]))
                else:
                    assert float(item[name]) == value
    assert [item["sqnr_db"] for item in json.loads(synthetic.to_json())] == ["-Infinity", "NaN", None]


def test_worst_rejects_a_bad_count_and_slices_are_reports():
    """worst(-1) returned every row but the best (a Python slice) and worst(True) one row; a slice
    of a report was a tuple printing as dataclass reprs."""
    rep = qstats.reporting.Report(tuple(_row(str(i), float(i)) for i in range(4)))
    for count in (-1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="worst: count must be a non-negative int"):
            rep.worst(count)
    with pytest.raises(ValueError, match="count must be a non-negative int"):
        rep.text(worst=-1)
    assert len(rep.worst(0)) == 0 and [row.module for row in rep.worst(10)] == ["0", "1", "2", "3"]
    head = rep[1:3]
    assert isinstance(head, qstats.Report) and list(head) == list(rep.rows[1:3])
    assert "LayerReport(" not in str(head) and str(head).splitlines()[2].split()[0] == "1"


def test_sqnr_of_values_whose_squares_overflow_float32():
    """A finite activation of 1e20 (observers take it in) overflowed the float32 sum of squares:
    the signal energy was inf and the SQNR inf, the best possible figure, for a site whose other
    values all quantize to 0. Such sums are redone in float64."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    recipe = qstats.Recipe([qstats.Rule("Linear", sites=("input",), spec=INPUT_SPEC)])
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    x[2, 2] = 1e20
    states = qstats.calibrate(model, [x], recipe, progress=False)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    (row,) = [r for r in qstats.report(states, qparams, model, recipe, [x]) if r.site == "input"]
    observer = MinMaxObserver(dtype=torch.quint8)
    observer(x)
    scale, zero_point = observer.calculate_qparams()
    quantized = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, 255)
    expected = _sqnr(x.double(), quantized.double())
    assert math.isfinite(expected) and row.sqnr_db == pytest.approx(expected, rel=1e-6)
    assert row.nonfinite == 0


def test_worst_takes_numpy_and_torch_integers_and_refuses_bools_and_floats():
    """worst(np.int64(2)) (a count read from numpy) was refused as "not an int"; any integral
    (operator.index) is a count now, and bools (Python, numpy, torch) and floats are still refused."""
    np = pytest.importorskip("numpy")
    sqnrs = [30.0, 5.0, 20.0, 10.0]
    rep = qstats.reporting.Report(tuple(_row(str(i), s) for i, s in enumerate(sqnrs)))
    lowest_two = [str(i) for i in sorted(range(len(sqnrs)), key=sqnrs.__getitem__)[:2]]  # plain Python
    for count in (np.int64(2), np.uint8(2), np.int32(2), torch.tensor(2)):
        assert [row.module for row in rep.worst(count)] == lowest_two, type(count)
    assert "worst 2 by SQNR" in qstats.reporting.Report(rep.rows, worst_listed=np.int64(2)).text()
    for count in (np.bool_(True), torch.tensor(True), np.float64(2.0), torch.tensor(2.0), np.int64(-1), True):
        with pytest.raises(ValueError, match="worst: count must be a non-negative int"):
            rep.worst(count)


class _Pooled(torch.nn.Module):
    """A pooled [batch, hidden] input whose hidden size equals the padded length of the mask."""

    def __init__(self, features):
        super().__init__()
        self.proj = torch.nn.Linear(features, 3)

    def forward(self, x, attention_mask):
        return self.proj(x[:, 0])


def test_a_mask_shaped_like_a_pooled_input_does_not_mask_its_features():
    """The mask [2, 5] is not a strict prefix of the pooled [2, 5] input: every value is measured
    (it masked features 3 and 4 of the first row as padding)."""
    torch.manual_seed(0)
    model = _Pooled(5).eval()
    recipe = qstats.Recipe([qstats.Rule("proj", sites=("input",))])
    x = torch.randn(2, 5, 5)
    batches = [{"x": x, "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}]
    weight = lambda batch: batch["attention_mask"]  # noqa: E731
    states = qstats.calibrate(model, batches, recipe, progress=False, observation_weight=weight)
    qparams = qstats.compute_qparams_tree(states, recipe, model)
    row = qstats.report(states, qparams, model=model, recipe=recipe, batches=batches, observation_weight=weight).rows[0]
    pooled, qp = x[:, 0], qparams["proj"]["input"]
    quantized = torch.fake_quantize_per_tensor_affine(pooled, float(qp.scale), int(qp.zero_point), -128, 127)
    assert row.sqnr_db == pytest.approx(_sqnr(pooled, quantized), rel=1e-5)
