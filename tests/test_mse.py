"""qstats.mse against llm-compressor's memoryless_mse and mse observers (the real library)."""

import functools
import itertools

import pytest
import torch

import qstats

llmc_observers = pytest.importorskip("llmcompressor.observers")
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402


def _llmc(args, base_name, xs):
    observer = llmc_observers.Observer.load_from_registry(args.observer, base_name=base_name, args=args)
    for x in xs:
        observer(x)
    qp = observer.get_qparams()
    return qp["scale"], qp["zero_point"]


WEIGHT_ARGS = [
    dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
    dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    dict(num_bits=8, type="int", symmetric=True, strategy="tensor"),
    dict(num_bits=3, type="int", symmetric=False, strategy="channel"),
]


@pytest.mark.parametrize("fields", WEIGHT_ARGS, ids=lambda f: f"{f['strategy']}-int{f['num_bits']}-{'sym' if f['symmetric'] else 'asym'}")
def test_one_batch_equals_memoryless_mse_without_early_stopping(fields):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g) * torch.rand(24, 1, generator=g) * 3
    w[3, 5] = 9.0  # an outlier
    args = QuantizationArgs(**fields, observer="memoryless_mse", observer_kwargs={"patience": 10**6})
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    scale, zero_point = _llmc(args, "weight", [w])
    obs = qstats.mse(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
    assert torch.equal(qp.scale, scale.reshape(qp.scale.shape))
    assert torch.equal(qp.zero_point.to(zero_point.dtype), zero_point.reshape(qp.zero_point.shape))


@pytest.mark.parametrize("fields", WEIGHT_ARGS[:2], ids=["channel", "group"])
def test_patience_reproduces_llm_compressor_early_stopping(fields):
    # patience 0: llm-compressor stops at the first step that improves nothing, as with 1
    for seed, patience in itertools.product(range(4), (0, 1, 3, 5)):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(16, 64, generator=g)
        args = QuantizationArgs(**fields, observer="memoryless_mse", observer_kwargs={"patience": patience, "grid": 50, "maxshrink": 0.5})
        spec = qstats.QuantSpec.from_compressed_tensors(args)
        scale, _ = _llmc(args, "weight", [w])
        obs = qstats.mse(spec, grid=50, maxshrink=0.5)
        qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec, patience=patience)
        assert torch.equal(qp.scale, scale.reshape(qp.scale.shape)), (seed, patience)


def test_streaming_with_a_reference_equals_one_search_over_all_data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=g) * 2
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="tensor", observer="memoryless_mse",
                            observer_kwargs={"patience": 10**6})
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    scale, _ = _llmc(args, "weight", [x])
    minmax = qstats.minmax(spec)
    reference = minmax.update(minmax.init(x), x)  # pass 1: the range (e.g. synced across ranks)
    obs = qstats.mse(spec, reference=reference)
    assert obs.exact
    shards = [obs.update(obs.init(x), part) for part in x.split([5, 20, 39])]
    merged = obs.merge(obs.merge(shards[2], shards[0]), shards[1])
    qp = qstats.compute_qparams(merged, spec)
    assert torch.equal(qp.scale, scale.reshape(()))
    with pytest.raises(ValueError, match="reference range holds NaN"):  # it read as "no reference"
        qstats.mse(spec, reference=(torch.tensor(float("nan")), torch.tensor(float("nan")))).init(x)


def test_accumulated_choice_differs_from_averaging_and_is_better_on_all_data():
    # two batches of different scales: the argmin over all data beats llm-compressor's average
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4096, generator=g), torch.randn(4096, generator=g) * 4]
    xs[0][0] = 12.0
    spec = qstats.QuantSpec(dtype="int4")
    full = torch.cat(xs)
    minmax = qstats.minmax(spec)
    reference = minmax.update(minmax.init(full), full)
    accumulate = qstats.mse(spec, reference=reference, maxshrink=0.8, grid=100)
    state = accumulate.init(full)
    for x in xs:
        state = accumulate.update(state, x)
    average = qstats.mse(spec, mode="moving_average", averaging_constant=0.5, maxshrink=0.8, grid=100, patience=None)
    avg_state = average.init(full)
    for x in xs:
        avg_state = average.update(avg_state, x)

    def error(qp):
        return float(((qstats.fake_quantize(full, qp, spec) - full).abs() ** 2.4).sum())

    assert error(qstats.compute_qparams(state, spec)) <= error(qstats.compute_qparams(avg_state, spec))


def test_moving_average_mode_reproduces_llm_compressor_mse():
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 16, 32, generator=g) * (1 + i) for i in range(3)]
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor", observer="mse",
                            observer_kwargs={"averaging_constant": 0.25})
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    scale, zero_point = _llmc(args, "input", xs)
    obs = qstats.mse(spec, mode="moving_average", averaging_constant=0.25)
    state = obs.init(xs[0])
    for x in xs:
        state = obs.update(state, x)
    qp = qstats.compute_qparams(state, spec)
    assert torch.allclose(qp.scale, scale.reshape(()), rtol=1e-6)
    assert int(qp.zero_point) == int(zero_point.reshape(()))


def test_sqnr_matches_llm_compressor_within_one_percent():
    g = torch.Generator().manual_seed(5)
    w = torch.distributions.StudentT(4.0).sample((32, 128))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel", observer="memoryless_mse")
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    scale, _ = _llmc(args, "weight", [w])
    obs = qstats.mse(spec)
    ours = qstats.compute_qparams(obs.update(obs.init(w), w), spec, patience=5)
    reference = qstats.QParams(scale.reshape(-1), torch.zeros(32, dtype=torch.int32), torch.ones(()), torch.ones(32, dtype=torch.bool))

    def sqnr(qp):
        error = qstats.fake_quantize(w, qp, spec) - w
        return float(10 * torch.log10((w**2).sum() / (error**2).sum()))

    del g
    assert abs(sqnr(ours) - sqnr(reference)) <= 0.01 * abs(sqnr(reference))


def test_masked_values_do_not_count():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(10, 8, generator=g)
    keep = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 0, 1])
    spec = qstats.QuantSpec(dtype="int4")
    obs = qstats.mse(spec)
    masked = obs.update(obs.init(x), x, keep)
    subset = obs.update(obs.init(x), x[keep != 0])
    assert torch.equal(masked.min_val, subset.min_val) and torch.equal(masked.max_val, subset.max_val)
    assert torch.allclose(masked.loss, subset.loss, rtol=1e-6)


def test_bad_input():
    spec = qstats.QuantSpec(dtype="int4")
    with pytest.raises(ValueError, match="maxshrink"):
        qstats.mse(spec, maxshrink=1.5)
    with pytest.raises(ValueError, match="candidate"):
        qstats.mse(spec, maxshrink=0.001, grid=10)
    with pytest.raises(ValueError, match="mode"):
        qstats.mse(spec, mode="ema")
    for expand in (0.5, float("inf"), float("nan")):  # an infinite expand gave 1e36 scales
        with pytest.raises(ValueError, match="expand"):
            qstats.mse(spec, expand=expand)
    with pytest.raises(ValueError, match="reference"):
        qstats.mse(qstats.QuantSpec(granularity=qstats.PerAxis(0)), reference=(torch.zeros(3), torch.ones(3))).init(torch.ones(4, 2))
    obs = qstats.mse(spec)
    state = obs.update(obs.init(torch.ones(4)), torch.ones(4))
    with pytest.raises(ValueError, match="patience"):
        qstats.compute_qparams(state, spec, patience=-1)


def test_float_zero_point_search_ignores_nonfinite_values():
    """NaN/Inf are left out of the statistics: with a float zero point their stand-in zeros do
    not quantize exactly, and their error used to move the choice."""
    spec = qstats.QuantSpec(dtype="uint4", mapping="asymmetric", zero_point_domain="float")
    obs = qstats.mse(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1000, generator=g) * 3 + 0.37
    dirty = torch.cat([x, torch.full((500,), float("nan")), torch.full((3,), float("inf"))])
    clean_state, dirty_state = obs.update(obs.init(x), x), obs.update(obs.init(dirty), dirty)
    # the same errors, summed in another order (float32 partial sums)
    torch.testing.assert_close(dirty_state.loss, clean_state.loss, rtol=1e-6, atol=0.0)
    a, b = qstats.compute_qparams(clean_state, spec), qstats.compute_qparams(dirty_state, spec)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


@pytest.mark.parametrize("magnitude", [1e10, 1e16, 1e20, 1e30])
def test_search_does_not_depend_on_the_data_magnitude(magnitude):
    """The choice is scale-invariant; |d| ** 2.4 overflowed float32 from about 1e16 on, every loss
    became Inf and the search kept the first (min/max) candidate. Such chunks now form their
    errors in float64."""
    spec = qstats.QuantSpec(dtype="int4")
    obs = qstats.mse(spec)
    base = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    reference = qstats.compute_qparams(obs.update(obs.init(base), base), spec).scale
    x = base * magnitude
    state = obs.update(obs.init(x), x)
    assert torch.isfinite(state.loss).all()
    torch.testing.assert_close(qstats.compute_qparams(state, spec).scale / magnitude, reference, rtol=1e-6, atol=0.0)


def test_stacked_search_equals_a_loop_over_experts_with_and_without_overflow():
    """One vmapped update of 3 experts (one with data past float32's error range, one masked out
    in part) equals the per-expert updates: each slice takes its own float32 or float64 errors."""
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    obs = qstats.mse(spec)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 64, generator=generator) * torch.tensor([1.0, 1e20, 0.01]).reshape(3, 1, 1)
    mask = torch.rand(3, 4, 64, generator=generator) > 0.3
    stacked = qstats.stacked_observer(obs, 3)
    state = stacked.update(stacked.init(x), x, mask)
    for e in range(3):
        alone = obs.update(obs.init(x[e]), x[e], mask[e])
        assert torch.equal(state.loss[e], alone.loss), e
    assert torch.isfinite(state.loss).all()


LOW_PRECISION_ARGS = [
    dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
    dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fields", LOW_PRECISION_ARGS, ids=["channel-int4", "group-int4-asym", "channel-fp8"])
def test_bf16_and_fp16_weights_give_memoryless_mse_choice_bit_for_bit(fields, dtype):
    """llm-compressor scores candidates with compressed-tensors' fake quantization in the weight's
    dtype and forms |q - w| ** norm in it; the search used to compute the codes and errors of
    bf16/fp16 weights in float32 and chose another scale for some channels."""
    args = QuantizationArgs(**fields, observer="memoryless_mse", observer_kwargs={"patience": 10**6})
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.mse(spec)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(16, 64, generator=g) * torch.rand(16, 1, generator=g) * 3).to(dtype)
        scale, zero_point = _llmc(args, "weight", [w])
        qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
        assert torch.equal(qp.scale.float(), scale.float().reshape(qp.scale.shape)), seed
        assert torch.equal(qp.zero_point.float(), zero_point.float().reshape(qp.zero_point.shape)), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_moving_average_mode_on_bf16_and_fp16_inputs_reproduces_llm_compressor_mse(dtype):
    """llm-compressor keeps a bf16/fp16 input's ranges and their moving average in that dtype."""
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor", observer="mse",
                            observer_kwargs={"averaging_constant": 0.25})
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.mse(spec, mode="moving_average", averaging_constant=0.25)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        xs = [(torch.randn(2, 16, 32, generator=g) * (1 + i)).to(dtype) for i in range(3)]
        scale, zero_point = _llmc(args, "input", xs)
        state = obs.init(xs[0])
        for x in xs:
            state = obs.update(state, x)
        qp = qstats.compute_qparams(state, spec)
        assert torch.equal(qp.scale.float(), scale.float().reshape(())), seed
        assert int(qp.zero_point) == int(zero_point.reshape(())), seed


def test_moving_average_update_compiles_without_graph_breaks():
    """A per-tensor search picks a 0-dim index: ``table[best]`` read it on the host and
    ``torch.compile(update, fullgraph=True)`` raised; the compiled update equals eager."""
    spec = qstats.QuantSpec(dtype="int4")
    obs = qstats.mse(spec, grid=10, mode="moving_average", averaging_constant=0.5)
    compiled = torch.compile(obs.update, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(7)
    eager = got = obs.init(torch.zeros(6, 8))
    for _ in range(2):
        x = torch.randn(6, 8, generator=g)
        got, eager = compiled(got, x), obs.update(eager, x)
        for name, a, b in zip(eager._fields, got, eager):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", ["accumulate", "moving_average"])
def test_compiled_update_takes_batches_of_every_length_in_one_graph(mode):
    """The chunking of the candidate losses read the input's sizes in Python: a compiled update
    recompiled for every sequence length and failed at torch.compile's limit of 8 with fullgraph."""
    obs = qstats.mse(qstats.QuantSpec(dtype="int8"), grid=10, mode=mode)
    torch._dynamo.reset()
    compiled = torch.compile(obs.update, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    eager = got = obs.init(torch.zeros(2, 3, 16))
    for length in range(3, 14):
        x = torch.randn(2, length, 16, generator=g)
        got, eager = compiled(got, x), obs.update(eager, x)
    for name, a, b in zip(eager._fields, got, eager):
        assert torch.allclose(a, b, rtol=1e-12, atol=0) if a.is_floating_point() else torch.equal(a, b), name


@pytest.mark.parametrize("patience", [1, 5, None])
def test_patience_given_to_an_accumulating_search_raises(patience):
    """In mode="accumulate" the search runs in compute_qparams, which takes ``patience``; the
    factory used to accept it and ignore it (another answer than the one asked for)."""
    spec = qstats.QuantSpec(dtype="int4", mapping="symmetric")
    with pytest.raises(ValueError, match=r"compute_qparams\(state, spec, patience="):
        qstats.mse(spec, patience=patience)
    qstats.mse(spec, mode="moving_average", patience=patience)  # where it applies


@pytest.mark.parametrize("patience", [-3, 2.5, True, "3"])
def test_invalid_patience_raises_naming_it(patience):
    """A patience that is not a non-negative int is refused by the moving-average factory and by
    compute_qparams (it was read as 1, or failed at the first update)."""
    spec = qstats.QuantSpec(dtype="int4", mapping="symmetric")
    with pytest.raises(ValueError, match="patience must be a non-negative int"):
        qstats.mse(spec, mode="moving_average", patience=patience)
    obs = qstats.mse(spec)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="patience must be a non-negative int"):
        qstats.compute_qparams(obs.update(obs.init(x), x), spec, patience=patience)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_compute_specs_declare_no_exact_merge(dtype):
    """A compressed-tensors spec computing in bf16/fp16 rounds each update's error sums to that
    dtype (llm-compressor's arithmetic for one batch), so a search over merged batches depends on
    the split (seed 13: another choice of scale): ``exact`` is False there, True in float32."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="tensor", observer="memoryless_mse")
    minmax = qstats.minmax(qstats.QuantSpec.from_compressed_tensors(args))
    w32 = torch.randn(8, 64, generator=torch.Generator().manual_seed(13))
    reference = minmax.update(minmax.init(w32), w32)
    assert qstats.mse(qstats.QuantSpec.from_compressed_tensors(args), reference=reference).exact
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.mse(spec, reference=reference)
    assert not obs.exact
    w = w32.to(dtype)
    whole = obs.update(obs.init(w), w)
    merged = functools.reduce(obs.merge, [obs.update(obs.init(w), row) for row in w.split(1)])
    assert not torch.allclose(whole.loss, merged.loss, rtol=1e-5, atol=0)  # the law exact would promise


def test_a_state_of_other_settings_is_refused_naming_both_shapes():
    """A state of an mse observer with another grid broke update with a raw broadcasting error."""
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    wide, narrow = qstats.mse(spec, grid=100), qstats.mse(spec, grid=20)
    x = torch.randn(4, 8)
    state = wide.update(wide.init(x), x)
    with pytest.raises(ValueError, match=r"shape \(4, 20\).*searches 4 candidates"):
        narrow.update(state, x)


def test_a_resumed_state_of_other_settings_names_the_module_and_site():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    spec = qstats.QuantSpec(granularity=qstats.PerAxis(0))
    batches = [torch.randn(3, 8)]

    def recipe(grid):
        return qstats.Recipe([qstats.Rule("Linear", spec=spec, sites=("weight",), observer=qstats.mse,
                                          observer_kwargs={"grid": grid})])

    states = qstats.calibrate(model, batches, recipe(100))
    with pytest.raises(ValueError, match=r"'0'.*weight|weight.*'0'"):
        qstats.calibrate(model, batches, recipe(20), states=states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_expand_on_bf16_and_fp16_inputs_reproduces_llm_compressor(dtype):
    """llm-compressor forms ``amin(x) * expand`` in a bf16/fp16 input's dtype; the search expanded
    the range in float32, so with an ``expand`` that is not a power of two (1.3, 1.8) it searched
    other candidates and chose other scales for up to a third of the channels (memoryless_mse) and
    another moving average (mse: bf16 seeds 0 and 1)."""
    for fields in (dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
                   dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16)):
        spec = qstats.QuantSpec.from_compressed_tensors(QuantizationArgs(**fields), observed_dtype=dtype)
        for expand in (1.3, 1.8):
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(32, 64, generator=g) * torch.rand(32, 1, generator=g) * 3).to(dtype)
            args = QuantizationArgs(**fields, observer="memoryless_mse",
                                    observer_kwargs={"patience": 10**6, "expand": expand})
            scale, zero_point = _llmc(args, "weight", [w])
            obs = qstats.mse(spec, expand=expand)
            qp = qstats.compute_qparams(obs.update(obs.init(w), w), spec)
            assert torch.equal(qp.scale.float(), scale.float().reshape(qp.scale.shape)), (fields, expand)
            assert torch.equal(qp.zero_point.float(), zero_point.float().reshape(qp.zero_point.shape)), (fields, expand)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor", observer="mse",
                            observer_kwargs={"averaging_constant": 0.25, "expand": 1.3})
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=dtype)
    obs = qstats.mse(spec, mode="moving_average", averaging_constant=0.25, expand=1.3)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        xs = [(torch.randn(2, 8, 64, generator=g) * (i + 1)).to(dtype) for i in range(3)]
        scale, _ = _llmc(args, "input", xs)
        state = obs.init(xs[0])
        for x in xs:
            state = obs.update(state, x)
        assert torch.equal(qstats.compute_qparams(state, spec).scale.float(), scale.float().reshape(())), seed


@pytest.mark.parametrize("constant", (0, 0.01, 1), ids=lambda c: f"c={c}")
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_moving_average_mode_takes_averaging_constants_zero_to_one_as_llm_compressor(strategy, constant):
    """llm-compressor's ``mse`` takes ``averaging_constant=0`` (the first batch's search stays):
    qstats takes it too (it used to raise) and equals it bit for bit after every batch."""
    from llmcompressor.observers.helpers import flatten_for_calibration

    args = QuantizationArgs(num_bits=8, type="int", symmetric=strategy == "channel", strategy=strategy, observer="mse",
                            observer_kwargs={"averaging_constant": constant})
    base = "input" if strategy == "tensor" else "weight"
    reference = llmc_observers.Observer.load_from_registry("mse", base_name=base, args=args)
    spec = qstats.QuantSpec.from_compressed_tensors(args)
    obs = qstats.mse(spec, mode="moving_average", averaging_constant=constant)
    g = torch.Generator().manual_seed(11)
    shape = (2, 16, 32) if base == "input" else (8, 32)
    state = None
    for index, scale in enumerate((1.0, 4.0, 0.25, 2.0)):
        x = torch.randn(shape, generator=g) * scale
        reference.update_statistics_from_observed(flatten_for_calibration(x, base, args))
        state = obs.update(obs.init(x) if state is None else state, x)
        assert torch.equal(state.min_val, reference.min_vals.float().reshape(state.min_val.shape)), index
        assert torch.equal(state.max_val, reference.max_vals.float().reshape(state.max_val.shape)), index
        if index == 0:
            first = state
    if constant == 0:
        assert torch.equal(state.min_val, first.min_val) and torch.equal(state.max_val, first.max_val)
    want = reference.get_qparams()
    qp = qstats.compute_qparams(state, spec)
    assert torch.equal(qp.scale.reshape(-1), want["scale"].float().reshape(-1))
    assert torch.equal(qp.zero_point.reshape(-1).float(), want["zero_point"].float().reshape(-1))


@pytest.mark.parametrize("bad", (-0.01, 1.5, float("nan"), True, False, "0.1"), ids=repr)
def test_moving_average_mode_refuses_averaging_constants_outside_zero_to_one(bad):
    with pytest.raises(ValueError, match="mse: averaging_constant must be a number in \\[0, 1\\]"):
        qstats.mse(qstats.QuantSpec(dtype="int4"), mode="moving_average", averaging_constant=bad)


def test_inputs_that_require_grad_give_the_state_of_their_detached_values():
    """Statistics carry no autograd graph: an importance, reference or input that requires grad
    gives the state (and scales) of its detached values, no field requiring grad."""
    torch.manual_seed(0)
    spec = qstats.QuantSpec(dtype="int4", granularity=qstats.PerAxis(0))
    x = torch.randn(8, 32)
    importance = torch.rand(32)
    reference = (x.amin(dim=1), x.amax(dim=1))
    plain = qstats.mse(spec, importance=importance, reference=reference)
    graded = qstats.mse(spec, importance=importance.clone().requires_grad_(),
                        reference=tuple(t.clone().requires_grad_() for t in reference))
    expected = plain.update(plain.init(x), x)
    got = graded.update(graded.init(x), x.clone().requires_grad_())
    for name, a, b in zip(expected._fields, expected, got):
        assert not b.requires_grad, name
        assert torch.equal(a, b), name
    assert torch.equal(qstats.compute_qparams(got, spec).scale, qstats.compute_qparams(expected, spec).scale)


def test_options_given_to_compute_qparams_of_a_moving_average_state_name_the_factory():
    """llm-compressor's ``mse`` takes ``patience`` in ``observer_kwargs``; qstats' moving average
    takes it in the factory (the search runs per batch), and compute_qparams says so."""
    spec = qstats.QuantSpec(dtype="int8")
    obs = qstats.mse(spec, mode="moving_average", patience=3)
    x = torch.randn(4, 16)
    state = obs.update(obs.init(x), x)
    with pytest.raises(TypeError, match=r"mode='moving_average'.*patience="):
        qstats.compute_qparams(state, spec, patience=3)
