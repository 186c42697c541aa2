"""Report.text: a fraction just under 1 is not printed as 1. Coverage 1 - 1/20000 (one uncalibrated
channel of a per-channel input of 20 000 channels) printed "1", the value of a fully calibrated site,
and the row's coverage was float32's mean of the flags (0.99994999 for 19 999 / 20 000)."""

import torch

import qstats
from qstats.reporting import COLUMNS, LayerReport, Report


def _cells(report: Report, column: str) -> list:
    header, _, *rows = report.text(worst=0).splitlines()
    at = COLUMNS.index(column)
    return [row.split()[at] for row in rows]


def test_coverage_just_under_one_is_not_printed_as_one():
    channels = 20_000
    spec = qstats.QuantSpec(dtype="uint8", mapping="asymmetric", granularity=qstats.PerAxis(-1),
                            on_uncalibrated="fallback")
    obs = qstats.minmax(spec)
    x = torch.randn(8, channels, generator=torch.Generator().manual_seed(0))
    x[:, 123] = float("nan")  # a channel that saw no finite value: uncalibrated
    state = obs.update(obs.init(x), x)
    qparams = qstats.compute_qparams(state, spec)
    report = qstats.report({"layer": {"input": state}}, {"layer": {"input": qparams}})
    want = (channels - 1) / channels  # independent: one channel of 20 000 uncalibrated
    assert report[0].coverage == want  # counted in float64: float32's mean gave 0.99994999
    (cell,) = _cells(report, "coverage")
    assert cell != "1" and float(cell) == want


def test_exact_and_other_values_keep_four_significant_digits():
    row = LayerReport(module="m", site="weight", observer="minmax", experts=0, min=-1.0, max=2.0,
                      mean_scale=0.0123456, clipped_fraction=0.99994, sqnr_db=float("inf"), coverage=1.0,
                      nonfinite=0)
    report = Report((row,))
    assert _cells(report, "coverage") == ["1"]
    assert _cells(report, "mean_scale") == ["0.01235"]
    assert _cells(report, "sqnr_db") == ["inf"]
    assert _cells(report, "clipped_fraction") == ["0.9999"]  # rounds to 4 digits below 1: kept
