"""Arguments an observer cannot use get a TypeError or ValueError naming the function and the argument.

Every registered observer factory (`qstats.observers.registry`) and `qstats.hessian` runs through the
same checks of ``init`` and ``update``: a non-tensor (None, a list, a float), a bool or complex tensor
raised AttributeError deep inside ``init`` ('NoneType' object has no attribute 'shape'), and ``update``
of the min/max family, histogram and mse read ``x.numel()`` before checking. Integer tensors are
observed as their float values, as torch.ao's MinMaxObserver observes them (its HistogramObserver
raises NotImplementedError for them).
"""

import math
import warnings

import pytest
import torch
from torch.ao.quantization import HistogramObserver, MinMaxObserver

import qstats
from qstats.observers import registry

_SPEC = qstats.QuantSpec(dtype="int8")
_SHAPE = (4, 8)

# the arguments a factory needs beyond the spec (every other registered factory takes the spec alone)
_ARGUMENTS = {
    "fixed_qparams": dict(scale=0.1, zero_point=0),
    "imatrix_mse": dict(weight_shape=_SHAPE),
}


def _own_names() -> set:
    """The names qstats registers (other tests and docs register observers of their own)."""
    return {name for name in registry.registered()
            if getattr(registry.get(name), "__module__", "").startswith("qstats.observers.")}


def _factories():
    factories = {name: (lambda name=name: registry.get(name)(_SPEC, **_ARGUMENTS.get(name, {})))
                 for name in _own_names()}
    factories["hessian"] = lambda: qstats.hessian(_SPEC)  # not registered by name: built by GPTQ rules
    factories["imatrix_mse/importance"] = lambda: qstats.imatrix_mse(
        _SPEC, _SHAPE, qstats.imatrix().update(qstats.imatrix().init(torch.ones(3, 8)), torch.ones(3, 8)))
    return factories


_FACTORIES = _factories()

# the name an observer's errors start with: its own, or the family whose functions it reuses
_FAMILY = {"sigmoid_qparams": "fixed_qparams", "tanh_qparams": "fixed_qparams"}
# the min/max family's init comes from kit.extremes_init, which names the state class where the
# factory passes no name
_STATE = {"minmax": "MinMaxState", "memoryless_minmax": "MemorylessMinMaxState",
          "moving_average_minmax": "MovingAverageMinMaxState"}

_NOT_TENSORS = [(None, "NoneType"), ([1.0, 2.0], "list"), (3.0, "float")]
_NOT_REAL = [torch.ones(_SHAPE, dtype=torch.bool), torch.ones(_SHAPE, dtype=torch.complex64)]


def test_every_registered_factory_is_covered():
    assert len(_own_names()) >= 14 and _own_names() <= set(_FACTORIES)


def _names(key: str, observer) -> tuple:
    return tuple(n for n in (observer.name, _FAMILY.get(key.split("/")[0]), _STATE.get(key)) if n)


def _check_message(message: str, key: str, observer, function: str, got: str) -> None:
    assert any(f"{name}.{function}" in message or (function == "init" and f"init of a {name}" in message)
               for name in _names(key, observer)), message
    assert got in message, message


@pytest.mark.parametrize("key", sorted(_FACTORIES))
@pytest.mark.parametrize("value,got", _NOT_TENSORS, ids=[g for _, g in _NOT_TENSORS])
def test_init_of_a_non_tensor_is_a_type_error_naming_init(key, value, got):
    observer = _FACTORIES[key]()
    with pytest.raises(TypeError) as error:
        observer.init(value)
    _check_message(str(error.value), key, observer, "init", f"expected a tensor, got {got}")


@pytest.mark.parametrize("key", sorted(k for k in _FACTORIES if k not in ("placeholder", "noop")))
@pytest.mark.parametrize("value", _NOT_REAL, ids=["bool", "complex"])
def test_init_of_a_bool_or_complex_tensor_is_refused_as_update_refuses_it(key, value):
    """placeholder and noop observe nothing and count any tensor (torch.ao's PlaceholderObserver
    and NoopObserver take any input): their init, as their update, takes a bool or complex one."""
    observer = _FACTORIES[key]()
    with pytest.raises(TypeError) as error:
        observer.init(value)
    _check_message(str(error.value), key, observer, "init", str(value.dtype))
    with pytest.raises(TypeError, match=str(value.dtype)):
        observer.update(observer.init(torch.randn(_SHAPE)), value)


@pytest.mark.parametrize("key", sorted(_FACTORIES))
@pytest.mark.parametrize("value,got", _NOT_TENSORS, ids=[g for _, g in _NOT_TENSORS])
def test_update_with_a_non_tensor_is_a_type_error_naming_update(key, value, got):
    observer = _FACTORIES[key]()
    state = observer.init(torch.randn(_SHAPE))
    with pytest.raises(TypeError) as error:
        observer.update(state, value)
    _check_message(str(error.value), key, observer, "update", f"expected a tensor, got {got}")


@pytest.mark.parametrize("key", sorted(_FACTORIES))
def test_update_and_merge_of_a_state_that_is_none_name_the_state_type(key):
    observer = _FACTORIES[key]()
    state = observer.init(torch.randn(_SHAPE))
    with pytest.raises(TypeError, match=f"expected a {type(state).__name__}, got NoneType"):
        observer.update(None, torch.randn(_SHAPE))
    with pytest.raises(TypeError, match=f"expected a {type(state).__name__}, got NoneType"):
        observer.merge(None, state)


@pytest.mark.parametrize("key", sorted(_FACTORIES))
def test_an_integer_tensor_is_observed_as_its_float_values(key):
    observer = _FACTORIES[key]()
    x = torch.randint(-50, 50, _SHAPE, generator=torch.Generator().manual_seed(0))
    from_ints = observer.update(observer.init(x), x)
    from_floats = observer.update(observer.init(x.float()), x.float())
    for a, b in zip(from_ints, from_floats):
        assert torch.equal(a, b)


def test_integer_tensors_against_torch_ao():
    """torch.ao's MinMaxObserver casts an integer input to float; its HistogramObserver cannot
    histogram one (NotImplementedError), where qstats' histogram buckets it as float32."""
    x = torch.randint(-50, 50, _SHAPE, generator=torch.Generator().manual_seed(1))
    reference = MinMaxObserver()
    reference(x)
    observer = qstats.minmax(_SPEC)
    state = observer.update(observer.init(x), x)
    assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)
    with pytest.raises(NotImplementedError):
        HistogramObserver()(x)
    histogram = qstats.histogram(_SPEC)
    counted = histogram.update(histogram.init(x), x)
    assert int(counted.counts.sum() + counted.underflow.sum() + counted.overflow.sum()) == x.numel()


# --- histogram: buckets_per_octave and its former name bins ------------------------------------


@pytest.mark.parametrize("buckets_per_octave", [128, 16])
def test_histogram_refuses_buckets_per_octave_and_bins_together(buckets_per_octave):
    """``buckets_per_octave=128, bins=64`` built 64 buckets per octave in silence (128 was taken for
    the default)."""
    with pytest.raises(TypeError, match=rf"not both \(got buckets_per_octave={buckets_per_octave} and bins=64\)"):
        qstats.histogram(_SPEC, buckets_per_octave=buckets_per_octave, bins=64)


def test_histogram_default_and_the_former_name_alone():
    x = torch.randn(16)
    assert qstats.histogram(_SPEC).init(x).counts.shape == (2, 48, 128)
    with pytest.warns(FutureWarning, match="buckets_per_octave"):
        former = qstats.histogram(_SPEC, bins=64)
    assert former.init(x).counts.shape == (2, 48, 64)


# --- hessian and imatrix: the spec's nonfinite policy -------------------------------------------


def _llmcompressor_hessian(x: torch.Tensor, features: int) -> torch.Tensor:
    helpers = pytest.importorskip("llmcompressor.modifiers.gptq.helpers")
    module = torch.nn.Linear(features, 3)
    hessian, _ = helpers.accumulate_hessian(x, module, helpers.make_empty_hessian(module),
                                            torch.zeros((), dtype=torch.int64))
    return hessian


def _with_a_nan_row():
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    x[1, 3, 4] = math.nan
    finite_rows = torch.cat([x[0], x[1, :3], x[1, 4:]])
    return x, finite_rows


def test_hessian_leaves_a_nan_row_out_where_llmcompressors_hessian_turns_nan():
    x, finite_rows = _with_a_nan_row()
    assert torch.isnan(_llmcompressor_hessian(x, 8)).any()  # llm-compressor 0.14: NaN from one row
    observer = qstats.hessian(_SPEC)
    state = observer.update(observer.init(x), x)
    # llm-compressor's sum over the finite rows is 2 * sum x^T x
    torch.testing.assert_close(2 * state.total, _llmcompressor_hessian(finite_rows, 8))
    assert int(state.count) == 9 and int(state.nonfinite) == 1


@pytest.mark.parametrize("factory", [qstats.hessian, qstats.imatrix, registry.get("imatrix")],
                         ids=["hessian", "imatrix", "registered imatrix"])
def test_hessian_and_imatrix_raise_under_nonfinite_raise(factory):
    """``QuantSpec(nonfinite="raise")`` was ignored (the spec was unused; the registry's imatrix
    dropped it): NaN rows were left out in silence."""
    x, _ = _with_a_nan_row()
    observer = factory(qstats.QuantSpec(nonfinite="raise"))
    with pytest.raises(ValueError, match=r"NaN or Inf .* nonfinite='raise'"):
        observer.update(observer.init(x), x)
    weight = torch.ones(2, 5)
    weight[1, 3] = 0  # a masked-out row is not observed, as every observer's weight leaves values out
    state = observer.update(observer.init(x), x, weight)
    assert int(state.count) == 9 and int(state.nonfinite.sum()) == 0


_KEEP_NO_VALUES = ("fixed_qparams", "sigmoid_qparams", "tanh_qparams", "placeholder", "noop")


@pytest.mark.parametrize("key", sorted(_FACTORIES))
def test_every_observer_that_keeps_values_raises_under_nonfinite_raise(key):
    """recording (as hessian and imatrix) left a NaN out in silence under nonfinite="raise"."""
    name = key.split("/")[0]
    spec = qstats.QuantSpec(dtype="int8", nonfinite="raise")
    if key == "imatrix_mse/importance":
        observer = qstats.imatrix_mse(spec, _SHAPE)
    elif key == "hessian":
        observer = qstats.hessian(spec)
    else:
        observer = registry.get(name)(spec, **_ARGUMENTS.get(name, {}))
    x = torch.randn(_SHAPE, generator=torch.Generator().manual_seed(4))
    observer.update(observer.init(x), x)  # finite values: no error
    x[2, 5] = math.inf
    assert not torch.isfinite(x).all()
    if name in _KEEP_NO_VALUES:
        observer.update(observer.init(x), x)
        return
    with pytest.raises(ValueError, match="nonfinite='raise'"):
        observer.update(observer.init(x), x)
    weight = torch.ones(_SHAPE[0])
    weight[2] = 0  # the row holding it is not observed
    observer.update(observer.init(x), x, weight)


@pytest.mark.parametrize("factory", [qstats.hessian, qstats.imatrix, qstats.recording],
                         ids=["hessian", "imatrix", "recording"])
def test_nonfinite_raise_under_vmap_and_compile(factory):
    observer = factory(qstats.QuantSpec(nonfinite="raise"))
    stacked = qstats.stacked_observer(observer, 2)
    xs = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    finite = stacked.update(stacked.init(xs), xs)
    assert finite.count.tolist() == ([40, 40] if factory is qstats.recording else [5, 5])
    xs[1, 0, 0] = math.inf
    with pytest.raises(ValueError, match="nonfinite='raise'"):
        stacked.update(stacked.init(xs), xs)
    x, _ = _with_a_nan_row()
    compiled = torch.compile(observer.update, fullgraph=True)
    with pytest.raises(Exception, match="nonfinite='raise'"):
        compiled(observer.init(x), x)


# --- options a factory or compute_qparams cannot use --------------------------------------------


@pytest.mark.parametrize("option", ["steps", "importance"])
def test_imatrix_mse_refuses_the_mse_options_it_sets(option):
    """``mse() got multiple values for keyword argument 'steps'`` named neither imatrix_mse nor
    what to pass instead."""
    with pytest.raises(TypeError, match=rf"imatrix_mse: {option} is set by imatrix_mse itself"):
        qstats.imatrix_mse(_SPEC, _SHAPE, **{option: 3})


@pytest.mark.parametrize("method,option", [("l2", "percentile"), ("minmax", "percentile"),
                                           ("percentile", "k"), ("entropy", "percentile")])
def test_a_histogram_method_names_the_options_it_takes(method, option):
    observer = qstats.histogram(_SPEC)
    x = torch.randn(64)
    state = observer.update(observer.init(x), x)
    with pytest.raises(TypeError, match=rf"compute_qparams: histogram method '{method}' takes .*got \['{option}'\]"):
        qstats.compute_qparams(state, _SPEC, method=method, **{option: 1})


def test_an_mse_state_names_its_one_option():
    observer = qstats.mse(_SPEC)
    x = torch.randn(64)
    state = observer.update(observer.init(x), x)
    with pytest.raises(TypeError, match=r"an MSEState takes the option patience only, got \['grid'\]"):
        qstats.compute_qparams(state, _SPEC, grid=50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qstats.compute_qparams(state, _SPEC, patience=5)


# --- numpy integers are integers -------------------------------------------------------------------


def _histogram_state(**options):
    observer = qstats.histogram(_SPEC, **options)
    x = torch.randn(256, generator=torch.Generator().manual_seed(5))
    return observer.update(observer.init(x), x)


def _mse_state():
    observer = qstats.mse(_SPEC)
    x = torch.randn(256, generator=torch.Generator().manual_seed(6))
    return observer.update(observer.init(x), x)


_NUMPY_INTEGER_OPTIONS = {
    # each option was refused as "must be an int ..., got np.int64(n)" where a Python int was taken
    "histogram octaves": lambda n: _histogram_state(buckets_per_octave=8, octaves=n),
    "recording capacity": lambda n: qstats.recording(capacity=n).init(torch.ones(3)),
    "mse patience": lambda n: qstats.compute_qparams(_mse_state(), _SPEC, patience=n),
    "moving-average mse patience": lambda n: (lambda o, x: o.update(o.init(x), x))(
        qstats.mse(_SPEC, mode="moving_average", patience=n), torch.randn(64, generator=torch.Generator().manual_seed(7))),
    "entropy num_bits": lambda n: qstats.compute_qparams(_histogram_state(), _SPEC, method="entropy", num_bits=n),
    "histogram mse candidates": lambda n: qstats.compute_qparams(_histogram_state(), _SPEC, method="mse", candidates=n),
}


@pytest.mark.parametrize("option", sorted(_NUMPY_INTEGER_OPTIONS))
def test_a_numpy_integer_option_equals_the_python_int(option):
    np = pytest.importorskip("numpy")
    build = _NUMPY_INTEGER_OPTIONS[option]
    from_numpy, from_int = build(np.int64(6)), build(6)
    for a, b in zip(from_numpy, from_int):
        assert torch.equal(a, b)
