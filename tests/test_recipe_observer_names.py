"""Observer names as llm-compressor's registry reads them: case, ``-`` and ``_`` alike (its
docstring's own example is ``observer={"weights": "MSE", "input": "MSE"}``). The rule
`Recipe.from_scheme` makes for such a name gives the qparams of the observer llm-compressor
attaches for it (``initialize_observer``), on data."""

import warnings

import pytest
import torch

import qstats

pytest.importorskip("llmcompressor")
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from llmcompressor.modifiers.quantization.calibration import initialize_observer  # noqa: E402

import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers in llm-compressor)

_KEYS = {"weight": "weights", "input": "input_activations"}


def _llm_compressors_qparams(args, site, batches):
    """The qparams of the observer llm-compressor attaches to a Linear for ``args`` at ``site``."""
    linear = torch.nn.Linear(64, 32)
    linear.quantization_scheme = QuantizationScheme(targets=["Linear"], **{_KEYS[site]: args.model_copy(deep=True)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        initialize_observer(linear, base_name=site)
    observer = getattr(linear, f"{site}_observer")
    for x in batches:
        observer(x)
    return observer.get_qparams()


def _qstats_qparams(args, site, batches):
    (rule,) = qstats.Recipe.from_scheme({_KEYS[site]: args}).rules
    obs = rule.make_observer()
    state = obs.init(batches[0])
    for x in batches:
        state = obs.update(state, x)
    return qstats.compute_qparams(state, rule.spec, **dict(rule.qparams_kwargs))


def _batches(site):
    g = torch.Generator().manual_seed(0)
    if site == "weight":
        w = torch.randn(32, 64, generator=g)
        w[3, 5] = 9.0  # an outlier the mse search clips
        return [w]
    batches = []
    for i in range(3):
        x = torch.randn(2, 8, 64, generator=g) * (1 + 2 * i) + 0.5
        x[0, 0, i] = 25.0 * (i + 1)
        batches.append(x)
    return batches


@pytest.mark.parametrize("site, name", [
    ("weight", "MSE"), ("weight", "Memoryless-MSE"), ("weight", "MinMax"), ("weight", "static-minmax"),
    ("weight", "NVFP4-Expanded-MSE"),
    ("input", "MSE"), ("input", "memoryless-mse"), ("input", "MinMax"), ("input", "Static_MinMax"),
    ("input", "MEMORYLESS-MINMAX"), ("input", "QStats-MinMax"), ("weight", "qstats-mse"),
])
def test_observer_names_spelt_as_llm_compressors_registry_reads_them(site, name):
    symmetric = site == "weight"
    args = QuantizationArgs(num_bits=4 if site == "weight" else 8, symmetric=symmetric,
                            strategy="channel" if site == "weight" else "tensor", observer=name,
                            observer_kwargs={"averaging_constant": 0.2} if site == "input" else {})
    batches = _batches(site)
    want = _llm_compressors_qparams(args, site, batches)
    got = _qstats_qparams(args, site, batches)
    assert torch.equal(got.scale.reshape(want["scale"].shape).to(want["scale"].dtype), want["scale"])
    zero_point = want["zero_point"]
    assert torch.equal(got.zero_point.reshape(zero_point.shape).to(zero_point.dtype), zero_point)


def test_an_unknown_observer_name_is_refused_naming_it_as_written():
    args = QuantizationArgs(num_bits=8, strategy="tensor", observer="Histo-Gram")
    with pytest.raises(ValueError, match=r"activation observer 'Histo-Gram': no qstats equivalent"):
        qstats.Recipe.from_scheme({"input_activations": args})
    with pytest.raises(ValueError, match=r"weights observer 'Histo-Gram': no qstats equivalent"):
        qstats.Recipe.from_scheme({"weights": args})
