"""Options of a ``qstats_histogram`` drop-in's range search (``observer_kwargs`` that go to
``compute_qparams``): a bad value raises when the observer is made, as ``oneshot`` applies the
recipe, not once calibration ends; good values give the pure histogram's qparams."""

import pytest
import torch
from _shared import bit_equal

import qstats

pytest.importorskip("llmcompressor")
import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402


def _args(symmetric=False, **observer_kwargs):
    return QuantizationArgs(num_bits=8, symmetric=symmetric, strategy="tensor", observer_kwargs=observer_kwargs)


BAD = [
    ({"method": "percentile", "percentile": 120}, False, "percentile"),
    ({"method": "percentile", "percentile": 40}, False, "percentile"),  # asymmetric: the 60th and 40th
    ({"method": "percentile", "percentile": 0}, True, "percentile"),
    ({"method": "mse", "candidates": 0}, False, "candidates"),
    ({"method": "mse", "per_octave": -1}, True, "per_octave"),
    ({"method": "entropy", "start_bin": 0}, True, "start_bin"),
    ({"method": "entropy", "stride": 0}, True, "stride"),
    ({"method": "entropy", "num_bits": 0}, True, "num_bits"),
]


@pytest.mark.parametrize("base", ["input", "weight"])
@pytest.mark.parametrize("kwargs,symmetric,field", BAD, ids=lambda v: str(v))
def test_bad_search_option_values_raise_when_the_observer_is_made(kwargs, symmetric, field, base):
    """An input's qparams come after the whole calibration: a search option checked only then
    (``percentile=120``) lost that calibration."""
    with pytest.raises(ValueError, match=field) as raised:
        Observer.load_from_registry("qstats_histogram", base_name=base, args=_args(symmetric, **kwargs))
    assert "QstatsHistogramObserver" in str(raised.value)


@pytest.mark.parametrize("kwargs", [{"method": "percentile", "percentile": 99.0}, {"method": "mse", "candidates": 16},
                                    {"method": "entropy", "start_bin": 64}], ids=lambda v: v["method"])
def test_good_search_options_give_the_pure_histograms_qparams(kwargs):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 8, 64, generator=g) * (i + 1) for i in range(4)]
    args = _args(True, **kwargs)
    observer = Observer.load_from_registry("qstats_histogram", base_name="input", args=args.model_copy(deep=True))
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.histogram(spec)
    state = obs.init(xs[0])
    for x in xs:
        observer(x)
        state = obs.update(state, x)
    want = qstats.compute_qparams(state, spec, **kwargs)
    got = observer.get_qparams()
    assert bit_equal(got["scale"], want.scale.reshape(1)) and bit_equal(got["zero_point"], want.zero_point.reshape(1).to(torch.int8))
