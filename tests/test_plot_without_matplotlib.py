"""qstats.plot without matplotlib: drawing raises an ImportError that names matplotlib and the extra
that installs it (read from pyproject.toml's optional dependencies); it said "pip install matplotlib"."""

import sys
from pathlib import Path

import pytest
import torch

import qstats

MATPLOTLIB_MODULES = ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg")


def _state():
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.histogram(spec, buckets_per_octave=16, octaves=16)
    x = torch.randn(500, generator=torch.Generator().manual_seed(0))
    return obs.update(obs.init(x), x), spec


def _extra_with_matplotlib() -> str:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    (extra,) = [name for name, needs in project["optional-dependencies"].items() if needs == ["matplotlib"]]
    return extra


def test_drawing_without_matplotlib_names_the_extra(monkeypatch):
    for name in MATPLOTLIB_MODULES:  # None in sys.modules: `import` raises ImportError, as when not installed
        monkeypatch.setitem(sys.modules, name, None)
    state, spec = _state()
    with pytest.raises(ImportError) as raised:
        qstats.plot.histogram(state, qstats.compute_qparams(state, spec), spec)
    message = str(raised.value)
    assert "matplotlib" in message and f"qstats[{_extra_with_matplotlib()}]" in message, message
    assert isinstance(raised.value.__cause__, ImportError)  # the import's own error is kept


def test_drawing_with_matplotlib_returns_a_figure():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    state, spec = _state()
    assert isinstance(qstats.plot.histogram(state, qstats.compute_qparams(state, spec), spec), Figure)
