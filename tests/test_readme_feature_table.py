"""The README's feature table, row by row, against the reference libraries it describes.

Each test reads one cell of the table and checks it against the library itself (torchao 0.18,
ModelOpt 0.47, llm-compressor 0.14): a cell that says a library has a feature names something the
library ships, and a cell that says how it merges across ranks matches the reduce ops it declares.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
COLUMNS = ("torch.ao", "llm-compressor", "ModelOpt", "torchao")


def _row(feature: str) -> dict[str, str]:
    """The cells of the feature table's row that starts with ``feature``, by library."""
    for line in README.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0] == feature:
            return dict(zip(COLUMNS, cells[1:5]))
    raise AssertionError(f"README.md has no feature row {feature!r}")


def _module(name: str):
    return pytest.importorskip(name)


def test_torchao_observer_rows_name_torchao_observers():
    """torchao ships torch.ao's observers for PT2E and an MSE line search: its cells are not '-'."""
    pt2e = _module("torchao.quantization.pt2e.observer")
    for name in ("MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver",
                 "HistogramObserver", "FixedQParamsObserver", "PlaceholderObserver", "NoopObserver",
                 "RecordingObserver"):
        assert hasattr(pt2e, name), name
    assert hasattr(_module("torchao.quantization.observer"), "AffineQuantizedMSEObserver")
    for feature in ("min/max, moving average, per-channel observers", "histogram range search",
                    "MSE shrink-grid search", "fixed / placeholder / noop / recording"):
        assert _row(feature)["torchao"] != "-", feature


def test_modelopt_formats_gptq_and_layerwise_cells():
    """ModelOpt's presets cover int8, int4, fp8, MX and NVFP4, and it runs GPTQ and a layer-by-layer
    calibration: the table's ModelOpt cells say so."""
    config = _module("modelopt.torch.quantization.config")
    for preset in ("INT8_DEFAULT_CFG", "INT4_AWQ_CFG", "FP8_DEFAULT_CFG", "MXFP8_DEFAULT_CFG",
                   "MXFP4_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"):
        assert hasattr(config, preset), preset
    formats = _row("int 1-16 bit, fp8, fp6, fp4, MX, NVFP4")["ModelOpt"]
    assert all(word in formats for word in ("int8", "int4", "fp8", "MX", "NVFP4")), formats
    model_calib = _module("modelopt.torch.quantization.model_calib")
    assert callable(model_calib.gptq) and callable(model_calib.layerwise_calibrate)
    assert "GPTQ" in _row("GPTQ, Hessians")["ModelOpt"]
    assert _row("models larger than memory")["ModelOpt"] != "-"


def test_modelopt_histograms_are_per_tensor_and_not_refused_across_ranks():
    """ModelOpt's histogram calibrator refuses an axis (per tensor only); across ranks it syncs amax by
    max and leaves histograms unsynchronised (a warning), which is not a refusal."""
    histogram = _module("modelopt.torch.quantization.calib.histogram")
    with pytest.raises(NotImplementedError):
        histogram.HistogramCalibrator(8, 0, False)
    assert "per tensor" in _row("histogram range search")["ModelOpt"]
    cell = _row("exact merge across ranks")["ModelOpt"]
    assert "refuse" not in cell and "max" in cell, cell


def test_llm_compressor_rank_merges_are_its_declared_reduce_ops():
    """llm-compressor all-reduces static min/max by MIN/MAX, imatrix by SUM, and averages the moving
    min/max and MSE observers: the table's cell names the exact ones and the averages."""
    observers = _module("llmcompressor.observers")
    dist = importlib.import_module("torch.distributed")
    registry = observers.Observer

    def ops(name):
        return set(registry.get_value_from_registry(name)._act_sync_dict.values())

    assert ops("static_minmax") == {dist.ReduceOp.MIN, dist.ReduceOp.MAX}
    assert ops("imatrix_mse") == {dist.ReduceOp.SUM}
    assert ops("minmax") == ops("mse") == {dist.ReduceOp.AVG}
    cell = _row("exact merge across ranks")["llm-compressor"]
    assert "min/max" in cell and "imatrix" in cell and "average" in cell, cell
