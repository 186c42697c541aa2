"""observer_kwargs of qstats.llmcompressor's drop-in observers, against llm-compressor 0.14's
``mse``: a bad value raises when the observer is made (when ``oneshot`` applies the recipe), not
at the first observation or once calibration ends, and ``qstats_mse`` inputs given llm-compressor's
``averaging_constant`` without ``mode="moving_average"`` are refused instead of accumulating."""

import pytest
import torch
from _shared import bit_equal

pytest.importorskip("llmcompressor")
import qstats.llmcompressor  # noqa: E402,F401  (registers the qstats_* observers)
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from llmcompressor.observers import Observer  # noqa: E402


def _observer(name, base, **observer_kwargs):
    args = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor", observer_kwargs=observer_kwargs)
    return Observer.load_from_registry(name, base_name=base, args=args)


BAD = [
    ("qstats_mse", {"patience": -1}, "patience"),
    ("qstats_mse", {"patience": 2.5}, "patience"),
    ("qstats_mse", {"maxshrink": 2.0}, "maxshrink"),
    ("qstats_mse", {"grid": 0}, "grid"),
    ("qstats_mse", {"norm": float("nan")}, "norm"),
    ("qstats_mse", {"expand": 0.5}, "expand"),
    ("qstats_mse", {"mode": "moving_average", "averaging_constant": 2}, "averaging_constant"),
    ("qstats_minmax", {"averaging_constant": 1.5}, "averaging_constant"),
    ("qstats_histogram", {"buckets_per_octave": 3}, "buckets_per_octave"),
]


@pytest.mark.parametrize("base", ["input", "weight"])
@pytest.mark.parametrize("name,kwargs,field", BAD, ids=lambda v: str(v))
def test_bad_option_values_raise_when_the_observer_is_made(name, kwargs, field, base):
    """Inputs' qparams come after the whole calibration (and GPTQ's weights' after the Hessians):
    an option checked only then lost that work."""
    with pytest.raises(ValueError, match=field):
        _observer(name, base, **kwargs)


def test_qstats_mse_input_averaging_constant_needs_the_moving_average_mode():
    """llm-compressor's ``mse`` averages each batch's chosen range with ``averaging_constant``; the
    same option on ``qstats_mse`` (which accumulates losses unless ``mode="moving_average"``) was
    ignored: other scales than ``mse``'s without a word. With the mode, the scales are ``mse``'s."""
    with pytest.raises(ValueError, match="mode='moving_average'"):
        _observer("qstats_mse", "input", averaging_constant=0.5)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 8, 64, generator=g) * (1 + 3 * (i % 2)) for i in range(6)]
    theirs = _observer("mse", "input", averaging_constant=0.5)
    ours = _observer("qstats_mse", "input", averaging_constant=0.5, mode="moving_average")
    for x in xs:
        theirs(x)
        ours(x)
    want, got = theirs.get_qparams(), ours.get_qparams()
    assert bit_equal(got["scale"], want["scale"]) and bit_equal(got["zero_point"], want["zero_point"])
    # a weight is observed once: the constant changes nothing there, as llm-compressor's memoryless_mse ignores it
    weight = torch.randn(16, 64, generator=g)
    want = _observer("memoryless_mse", "weight", averaging_constant=0.5)(weight).get_qparams()
    got = _observer("qstats_mse", "weight", averaging_constant=0.5)(weight).get_qparams()
    assert bit_equal(got["scale"], want["scale"]) and bit_equal(got["zero_point"], want["zero_point"])


def test_a_histograms_former_bins_option_warns_once():
    """``bins`` (now ``buckets_per_octave``) gives one FutureWarning for the observer, and the
    qparams of ``buckets_per_octave`` with its value."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 8, 64, generator=g) for _ in range(3)]
    with pytest.warns(FutureWarning) as record:
        former = _observer("qstats_histogram", "input", bins=64)
        for x in xs:
            former(x)
        got = former.get_qparams()
    assert len([w for w in record if "buckets_per_octave" in str(w.message)]) == 1
    current = _observer("qstats_histogram", "input", buckets_per_octave=64)
    for x in xs:
        current(x)
    want = current.get_qparams()
    assert bit_equal(got["scale"], want["scale"]) and bit_equal(got["zero_point"], want["zero_point"])


def test_a_config_with_qstats_mse_weights_given_averaging_constant_is_read_as_the_drop_in_reads_it():
    """`Recipe.from_compressed_tensors` of a config the drop-in calibrated (``qstats_mse`` weights with
    ``averaging_constant``, which the drop-in drops on weights) builds the same observer: the scales of
    llm-compressor's ``memoryless_mse``, which ignores the constant."""
    import qstats
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    args = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel", observer="qstats_mse",
                            observer_kwargs={"averaging_constant": 0.5})
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16))
    recipe = qstats.Recipe.from_compressed_tensors(config.model_dump())
    states = qstats.calibrate(model, [torch.randn(2, 64)], recipe, progress=False)
    got = qstats.compute_qparams_tree(states, recipe, model)["0"]["weight"]
    reference = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel")
    want = Observer.load_from_registry("memoryless_mse", base_name="weight", args=reference)(
        model[0].weight.detach()).get_qparams()
    assert bit_equal(got.scale.reshape(want["scale"].shape), want["scale"])
