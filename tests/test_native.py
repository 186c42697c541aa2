"""The one-pass native row extremes (`qstats._native.row_extremes`) against ATen's amin/amax, and
the min/max observers on tensors large enough to take it against an independent computation
(torch.ao's observers where the data is finite; masked ATen reductions where it is not)."""

import contextlib
import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.ao.quantization import PerChannelMinMaxObserver

from _shared import bit_equal, record_taken

import qstats
from qstats import _native, _qparams, _reductions


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` for the block (the kernel splits rows over it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


pytestmark = pytest.mark.skipif(not _native._kernel(), reason="no C++ compiler: the native kernel is not built")

@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the calls that reach the kernel, ``("row", taken)`` for the reduction and
    ``("update", taken)`` for the fused min/max update (taken: not None), so that the observer
    tests know which path they tested."""
    calls = []
    row, update = _native.row_extremes, _native.update_extremes

    def counting_row(view):
        out = row(view)
        calls.append(("row", out is not None))
        return out

    def counting_update(*args, **kwargs):
        out = update(*args, **kwargs)
        calls.append(("update", out is not None))
        return out

    monkeypatch.setattr(_reductions, "row_extremes", counting_row)
    monkeypatch.setattr(_native, "update_extremes", counting_update)
    return calls


@pytest.fixture(params=[1, 2], ids=["8-streams-prefetch", "2-streams"])
def read_mode(request):
    """Each way the kernel reads rows (the processor picks one; both must give the same results):
    QS_STREAMS streams asking 1 KB ahead, or two streams with the hardware prefetchers alone."""
    set_mode = _native._kernel()[5]
    assert set_mode(request.param) == request.param
    try:
        yield request.param
    finally:
        set_mode(0)


def test_the_read_mode_follows_the_processor():
    vendor = ""
    if os.path.exists("/proc/cpuinfo"):
        vendor = next((line for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
    if "AuthenticAMD" not in vendor and "GenuineIntel" not in vendor:
        pytest.skip("neither an AMD nor an Intel x86 processor")
    assert _native._kernel()[5](0) == (2 if "AuthenticAMD" in vendor else 1)


LENGTHS = [16, 17, 31, 32, 33, 47, 48, 64, 100, 256, 1000]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _view(rows, length, generator, dtype=torch.float32):
    # more than _MIN_NUMEL values, so that the kernel applies
    rows = max(rows, -(-_native._MIN_NUMEL // length))
    return (torch.randn(1, rows, length, generator=generator) * 5).to(dtype).contiguous()


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_extremes_equal_aten(length, threads, dtype, read_mode):
    g = torch.Generator().manual_seed(length)
    view = _view(7, length, g, dtype)
    with torch_threads(threads):
        lo, hi, finite = _native.row_extremes(view)
    assert finite and lo.dtype == hi.dtype == torch.float32
    assert torch.equal(lo, view[0].amin(-1).float()) and torch.equal(hi, view[0].amax(-1).float())


@pytest.mark.parametrize("length", [16, 33, 256])
@pytest.mark.parametrize("where", ["first", "body", "tail", "last"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_nonfinite_value_is_flagged(length, where, value, dtype, read_mode):
    g = torch.Generator().manual_seed(1)
    view = _view(3, length, g, dtype)
    row = view.shape[1] // 2
    column = {"first": 0, "body": length // 2, "tail": length - 1, "last": length - 1}[where]
    if where == "last":
        row = view.shape[1] - 1
    view[0, row, column] = value
    lo, hi, finite = _native.row_extremes(view)
    assert not finite
    others = torch.ones(view.shape[1], dtype=torch.bool)
    others[row] = False
    # every other row is still exact
    assert torch.equal(lo[others], view[0, others].amin(-1).float())
    assert torch.equal(hi[others], view[0, others].amax(-1).float())


def test_an_overflowing_range_is_flagged(read_mode):
    view = torch.zeros(1, 4096, 32)
    view[0, 5, 3], view[0, 5, 4] = -3e38, 3e38
    assert _native.row_extremes(view)[2] is False


@pytest.mark.parametrize("rows", [4096 + 13, 8 * 17 + 5], ids=["many rows", "few rows"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_beside_the_streams_equal_aten(rows, threads, read_mode):
    """Row counts that the threads' streams do not divide: the rows left over after the streams
    take the one-row path; every row is exact and a non-finite value in any of them is flagged."""
    g = torch.Generator().manual_seed(rows)
    view = _view(rows, 48, g)
    with torch_threads(threads):
        lo, hi, finite = _native.row_extremes(view)
        assert finite
        assert torch.equal(lo, view[0].amin(-1)) and torch.equal(hi, view[0].amax(-1))
        for row in (0, rows // 2, rows - 1, rows - 2):
            dirty = view.clone()
            dirty[0, row, 40] = float("nan")
            assert _native.row_extremes(dirty)[2] is False, row


def _x86_vector_widths():
    """Flag sets that build the kernel for the narrower vector widths an x86 machine with
    AVX-512 also runs (AVX2: 8 lanes and 4 streams; baseline SSE2: 4 lanes), where it has them."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    widths = [pytest.param(("-fopenmp",), id="baseline")]
    if " avx2" in flags:
        widths.append(pytest.param(("-march=native", "-mno-avx512f", "-fopenmp"), id="avx2"))
    return widths


@pytest.mark.parametrize("flags", _x86_vector_widths())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_narrower_vector_widths_equal_aten(flags, dtype, tmp_path):
    """The kernel as built on a machine without this one's widest vectors (each width has its own
    lanes, lane reduction and stream count): exact extremes, flags for non-finite values."""
    built = _native._compile_and_load(str(tmp_path), flag_sets=(flags,))
    if not built:
        pytest.skip(f"the compiler does not take {flags}")
    extremes = built[0]
    if dtype == torch.float32:
        _assert_half_precision_scales(built[2])
    g = torch.Generator().manual_seed(3)
    for length, mode in itertools.product((16, 17, 33, 256, 1000), (1, 2)):  # both ways of reading
        assert built[5](mode) == mode
        view = _view(4096 // length + 9, length, g, dtype)
        rows = view.shape[1]
        for threads in (1, 2):
            lo, hi = torch.empty(rows), torch.empty(rows)
            bad = extremes(view.data_ptr(), _native._KINDS[dtype], rows, length, lo.data_ptr(), hi.data_ptr(), threads)
            assert bad == 0
            assert torch.equal(lo, view[0].amin(-1).float()) and torch.equal(hi, view[0].amax(-1).float())
        for column in (0, length // 2, length - 1):
            dirty = view.clone()
            dirty[0, rows - 1, column] = float("nan")
            lo, hi = torch.empty(rows), torch.empty(rows)
            assert extremes(dirty.data_ptr(), _native._KINDS[dtype], rows, length, lo.data_ptr(), hi.data_ptr(), 1) == 1


def test_cxx_may_carry_arguments(monkeypatch, tmp_path):
    """``$CXX`` as a command with arguments (``ccache g++``, ``g++ -m64``): split as a shell
    would, and its arguments reach the compiler (a flag it rejects fails that build); a ``$CXX``
    that is not a command is skipped."""
    import shutil

    compiler = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("CXX", f"{compiler} -DQSTATS_FROM_CXX=1")
    first = _native._compilers()[0]
    assert first == [shutil.which(compiler), "-DQSTATS_FROM_CXX=1"]
    monkeypatch.setattr(_native, "_compilers", lambda: [first])
    (tmp_path / "good").mkdir()
    assert _native._compile_and_load(str(tmp_path / "good"))
    bad = [shutil.which(compiler), "--no-such-option-for-qstats"]
    monkeypatch.setattr(_native, "_compilers", lambda: [bad])
    (tmp_path / "bad").mkdir()
    assert _native._compile_and_load(str(tmp_path / "bad")) is False
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "'unbalanced")
    assert all(command[0] != "'unbalanced" for command in _native._compilers())


@pytest.mark.parametrize("compiler", ["clang++"])
def test_another_compiler_builds_the_same_kernel(compiler, monkeypatch, tmp_path):
    """The kernel built by another C++ compiler (``$CXX``; clang takes ``-fopenmp`` only with its
    own OpenMP library, so without it the build falls back to one thread): every entry point
    against ATen and torch.ao."""
    import shutil

    if not shutil.which(compiler):
        pytest.skip(f"no {compiler} on this machine")
    monkeypatch.setenv("CXX", compiler)
    assert _native._compilers()[0] == [shutil.which(compiler)]  # $CXX comes first
    monkeypatch.setattr(_native, "_compilers", lambda: [[shutil.which(compiler)]])  # and no other
    built = _native._compile_and_load(str(tmp_path))
    assert built, f"{compiler} did not build the kernel"
    extremes, update, scales, whole, whole_extremes, read_mode = built
    g = torch.Generator().manual_seed(4)
    for dtype, mode in itertools.product(DTYPES, (1, 2)):  # both ways of reading rows
        assert read_mode(mode) == mode
        for length in (16, 33, 256):
            view = _view(4096 // length + 9, length, g, dtype)
            rows = view.shape[1]
            lo, hi = torch.empty(rows), torch.empty(rows)
            assert extremes(view.data_ptr(), _native._KINDS[dtype], rows, length, lo.data_ptr(), hi.data_ptr(), 2) == 0
            assert torch.equal(lo, view[0].amin(-1).float()) and torch.equal(hi, view[0].amax(-1).float())
            # merged into a state: the state's extremes where they are wider, counts added
            state = (lo - 1.0, hi * 0.5, torch.full((rows,), 7), torch.full((rows,), 2))
            out = (torch.empty(rows), torch.empty(rows), torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64))
            ptrs = [t.data_ptr() for t in (*state, *out)]
            no_scales = (0.0, 0.0, 0.0, 0, 0, None, None, 0, 0, None, None, 0)
            assert update(view.data_ptr(), _native._KINDS[dtype], rows, length, *ptrs, rows, 2, *no_scales) == 0
            assert torch.equal(out[0], state[0]) and torch.equal(out[1], torch.maximum(hi, state[1]))
            assert torch.equal(out[2], state[2] + length) and torch.equal(out[3], state[3])
            # no state (memoryless): the rows' own extremes and counts
            forget = (None,) * 4 + tuple(ptrs[4:])
            assert update(view.data_ptr(), _native._KINDS[dtype], rows, length, *forget, rows, 2, *no_scales) == 0
            assert torch.equal(out[0], lo) and torch.equal(out[1], hi)
            assert (out[2] == length).all() and not out[3].any()
            # with the merged ranges' symmetric scales (int8 per channel), against torch.ao's
            mapped = (torch.empty(rows), torch.empty(rows, dtype=torch.int32), torch.empty(rows, dtype=torch.bool))
            ones = torch.zeros(2)
            eps = float(torch.finfo(torch.float32).eps)
            numbers = (127.5, eps, 3.0e38, 1, 0, *(t.data_ptr() for t in mapped[:2]), 0, 0, mapped[2].data_ptr(), ones.data_ptr(), 2)
            assert update(view.data_ptr(), _native._KINDS[dtype], rows, length, *ptrs, rows, 2, *numbers) == 0
            reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            reference.min_val, reference.max_val = out[0].clone(), out[1].clone()
            assert torch.equal(mapped[0], reference.calculate_qparams()[0])
            assert not mapped[1].any() and mapped[2].all() and torch.equal(ones, torch.ones(2))
            # the whole tensor at once
            fields = (torch.tensor(float("inf")), torch.tensor(float("-inf")), torch.tensor(0), torch.tensor(0))
            outs = (torch.empty(()), torch.empty(()), torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64))
            n = view.numel()
            assert whole(view.data_ptr(), _native._KINDS[dtype], n, *(t.data_ptr() for t in (*fields, *outs)), 1) == 0
            assert float(outs[0]) == float(view.amin()) and float(outs[1]) == float(view.amax()) and int(outs[2]) == n
            assert whole_extremes(view.data_ptr(), _native._KINDS[dtype], n, 2, outs[0].data_ptr(), outs[1].data_ptr()) == 0
            assert float(outs[0]) == float(view.amin()) and float(outs[1]) == float(view.amax())
    # the symmetric scales of a range against torch.ao
    x = torch.randn(64, 300, generator=g)
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    observer(x)
    lo, hi = x.amin(-1), x.amax(-1)
    scale, zero_point, calibrated = torch.empty(64), torch.empty(64, dtype=torch.int32), torch.empty(64, dtype=torch.bool)
    eps = float(torch.finfo(torch.float32).eps)
    args = (lo.data_ptr(), hi.data_ptr(), None, 0, 64, 127.5, eps, 3.0e38, 1, 0, scale.data_ptr(), zero_point.data_ptr(), 0, 0)
    ones = torch.zeros(3)
    assert scales(*args, calibrated.data_ptr(), ones.data_ptr(), 3) == 0
    assert torch.equal(scale, observer.calculate_qparams()[0]) and not zero_point.any() and calibrated.all()
    assert torch.equal(ones, torch.ones(3))
    _assert_half_precision_scales(scales)


def _assert_half_precision_scales(scales):
    """The symmetric scales entry point of a built kernel, computing in bfloat16 and float16 as
    compressed-tensors does for half weights, against the general path (ATen's arithmetic in
    that dtype) over every float32 exponent, float16's largest values and its ties."""
    g = torch.Generator().manual_seed(5)
    exponent = torch.randint(-149, 127, (4096,), generator=g).float()
    peaks = ((torch.rand(4096, generator=g) + 1) * torch.pow(2.0, exponent)).clamp(max=1.7e38)
    peaks = torch.cat([peaks, torch.tensor([0.0, 65504.0, 65519.0, 65520.0, 1e5, 2.0**-25, 2.0**-24 * 1.5])])
    lo, hi = -peaks * 0.5, peaks
    for compute in ("bfloat16", "float16"):
        spec = qstats.QuantSpec(dtype="int8", mapping="symmetric", convention="compressed_tensors", compute_dtype=compute)
        numbers = _qparams._symmetric_plan(spec).native
        scale, zero_point = torch.empty(len(lo)), torch.empty(len(lo), dtype=torch.int32)
        calibrated, ones = torch.empty(len(lo), dtype=torch.bool), torch.empty(())
        head = (lo.data_ptr(), hi.data_ptr(), None, 0, len(lo), *numbers[:3], int(numbers[5]), numbers[6])
        tail = (scale.data_ptr(), zero_point.data_ptr(), 0, 0, calibrated.data_ptr(), ones.data_ptr(), 1)
        assert scales(*head, *tail) == 0
        expected = _qparams._general_qparams(lo, hi, spec, None, None, False)
        assert torch.equal(scale, expected.scale), compute
        assert torch.equal(zero_point, expected.zero_point) and calibrated.all()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(1, 4096, 64, dtype=torch.float64),  # another dtype
        lambda: torch.randn(1, 4096, 64).to(torch.float8_e4m3fn),  # another dtype
        lambda: torch.randn(1, 64, 4096).transpose(1, 2),  # not contiguous
        lambda: torch.randn(2, 4096, 64),  # more than one observation
        lambda: torch.randn(1, 65536, 8),  # a group below 16
        lambda: torch.randn(1, 64, 64),  # too small to pay for the call
    ],
    ids=["float64", "float8", "transposed", "observations", "short group", "small"],
)
def test_inapplicable_views_are_left_to_aten(make):
    assert _native.row_extremes(make()) is None


TORCH_AO = {
    "per channel symmetric": (torch.qint8, torch.per_channel_symmetric),
    "per channel affine": (torch.quint8, torch.per_channel_affine),
}


@pytest.mark.parametrize("name", TORCH_AO)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("input_dtype", DTYPES, ids=str)
def test_large_per_channel_update_matches_torch_ao(name, threads, input_dtype, kernel_calls):
    """A weight large enough for the kernel, observed twice: min/max and qparams bit-exact with
    torch.ao's PerChannelMinMaxObserver (given the float32 weight: bfloat16 and float16 widen
    exactly)."""
    dtype, qscheme = TORCH_AO[name]
    spec = qstats.QuantSpec.from_torch_ao(dtype, qscheme)
    g = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(2, 1024, 300, generator=g) * torch.rand(1024, 1, generator=g) * 4).to(input_dtype)
    reference = PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, qscheme=qscheme)
    with torch_threads(threads):
        obs = qstats.minmax(spec)
        state = obs.update(obs.update(obs.init(w1), w1), w2)
    assert kernel_calls == [("update", True)] * 2
    reference(w1.float())
    reference(w2.float())
    assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)
    assert torch.equal(state.count, torch.full((1024,), 600, dtype=torch.int64))
    scale, zero_point = reference.calculate_qparams()
    qparams = qstats.compute_qparams(state, spec)
    assert torch.equal(qparams.scale, scale) and torch.equal(qparams.zero_point.to(zero_point.dtype), zero_point)


@pytest.mark.parametrize("granularity", [qstats.PerAxis(0), qstats.PerGroup(128), qstats.PerToken()], ids=repr)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_large_update_with_nonfinite_values_ignores_and_counts_them(granularity, value, kernel_calls):
    """NaN/Inf in a large tensor (the kernel flags it, the full path runs): extremes of the finite
    values and the counts, against masked ATen reductions."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 1024, generator=g)
    x[7, 100] = value
    x[300, 1023] = -value
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))
    state = obs.update(obs.init(x), x)
    assert kernel_calls == [("update", False), ("row", True)]  # flagged twice, then the full path
    group = 1024 if not isinstance(granularity, qstats.PerGroup) else 128
    rows = x.reshape(-1, group)
    finite = torch.isfinite(rows)
    assert torch.equal(state.min_val.reshape(-1), torch.where(finite, rows, torch.inf).amin(-1))
    assert torch.equal(state.max_val.reshape(-1), torch.where(finite, rows, -torch.inf).amax(-1))
    assert torch.equal(state.count.reshape(-1), finite.sum(-1))
    assert torch.equal(state.nonfinite.reshape(-1), (~finite).sum(-1))


def test_stacked_experts_vmap_equals_torch_ao_per_expert(kernel_calls):
    """64 experts under vmap (the kernel reduces the whole stack in one call) against torch.ao's
    observer on each expert."""
    g = torch.Generator().manual_seed(5)
    experts = torch.randn(8, 256, 128, generator=g)
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
    obs = qstats.minmax(spec)
    scales = torch.vmap(lambda w: qstats.compute_qparams(obs.update(obs.init(w), w), spec).scale)(experts)
    assert kernel_calls == [("update", True)]  # one fused call for the whole stack
    for i, w in enumerate(experts):
        reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        reference(w)
        assert torch.equal(scales[i], reference.calculate_qparams()[0])


def test_the_environment_switch_turns_the_kernel_off():
    code = "from qstats import _native; import torch; print(_native.row_extremes(torch.randn(1, 4096, 64)))"
    env = dict(os.environ, QSTATS_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None"


def _extremes_in_child(view, queue):
    lo, hi, finite = _native.row_extremes(view)
    queue.put((finite, lo.tolist() == [min(row) for row in view[0].tolist()]))  # no torch threads here


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_computes_without_the_parents_thread_pool():
    """GNU OpenMP's thread pool does not survive a fork: a child that reuses it hangs. After the
    parent used it, a forked child takes one thread and finishes."""
    import multiprocessing

    with torch_threads(2):
        view = torch.rand(1, 4096, 256) * 2 - 1
        assert _native.row_extremes(view)[2]  # the parent's pool is in use
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_extremes_in_child, args=(view, queue))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
        assert not alive, "the forked child hung"
        assert queue.get(timeout=5) == (True, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("length", [16, 17], ids=["vector", "scalar tail"])
def test_every_half_precision_value_widens_exactly(dtype, length):
    """Rows of ``length`` copies of each finite 16-bit pattern (subnormals and signed zeros
    included): the kernel's min is torch's float32 conversion of that value, bit for bit."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[torch.isfinite(values)]
    view = values.repeat(2).repeat_interleave(length).reshape(1, -1, length).contiguous()
    lo, hi, finite = _native.row_extremes(view)
    assert finite
    expected = view[0, :, 0].float().view(torch.int32)
    assert torch.equal(lo.view(torch.int32), expected) and torch.equal(hi.view(torch.int32), expected)


def _fields_bit_equal(a, b):
    assert type(a) is type(b)
    for name, left, right in zip(a._fields, a, b):
        assert bit_equal(left, right), name


@pytest.mark.parametrize("stacked", [False, True], ids=["plain", "stacked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "granularity", [qstats.PerAxis(0), qstats.PerGroup(32), qstats.PerToken(), qstats.PerTensor()], ids=repr
)
def test_fused_update_equals_the_full_path(stacked, dtype, granularity, kernel_calls, monkeypatch):
    """The fused update (reduction, merge and counts in one pass) against the path every other
    input takes, bit for bit (signed zeros included), over three updates from init: data with
    zeros, a batch inside the running range (ties with the state), one outside it."""
    g = torch.Generator().manual_seed(6)
    shape = (4, 256, 96) if stacked else (256, 384)
    batches = [torch.randn(shape, generator=g).round() * 0.0, torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)]
    batches[0][..., ::2] = -0.0
    batches = [b.to(dtype) for b in batches]
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))
    if stacked:
        obs = qstats.stacked_observer(obs, 4)

    def run():
        state = obs.init(batches[0])
        for batch in batches:
            state = obs.update(state, batch)
        return state

    fused = run()
    assert kernel_calls == [("update", True)] * 3
    monkeypatch.setattr(_native, "update_extremes", lambda *args, **kwargs: None)
    _fields_bit_equal(fused, run())


@pytest.mark.parametrize(
    "size", [1 << 16, 4096 * 20 + 5, 4096 * 20 + 100, 1 << 20], ids=["rows", "short rest", "vector rest", "large"]
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_per_tensor_update_equals_torch_ao(size, threads, dtype, kernel_calls, monkeypatch):
    """A per-tensor update in one native pass (rows of the row pass, then the rest, then the
    rows' extremes) against torch.ao's MinMaxObserver and the full path, bit for bit; a
    non-finite value anywhere sends the batch down the full path, which counts it."""
    from torch.ao.quantization import MinMaxObserver

    g = torch.Generator().manual_seed(size)
    batches = [(torch.randn(size, generator=g) * scale).to(dtype) for scale in (1.0, 3.0, 0.5)]
    obs = qstats.minmax(qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_tensor_symmetric))
    reference = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    with torch_threads(threads):
        state = obs.init(batches[0])
        for batch in batches:
            state = obs.update(state, batch)
            reference(batch.float())
        assert kernel_calls == [("update", True)] * 3
        assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)
        assert int(state.count) == 3 * size and int(state.nonfinite) == 0
        assert torch.equal(qstats.compute_qparams(state, obs.spec).scale.reshape(1), reference.calculate_qparams()[0])
        for where in (0, size // 2, size - 1):
            dirty = batches[1].clone()
            dirty[where] = float("nan")
            kernel_calls.clear()
            new = obs.update(state, dirty)
            assert kernel_calls[0] == ("update", False)
            assert int(new.nonfinite) == 1 and int(new.count) == 4 * size - 1
            assert torch.equal(new.max_val, state.max_val)
        with monkeypatch.context() as m:
            m.setattr(_native, "update_extremes", lambda *args, **kwargs: None)
            full = obs.init(batches[0])
            for batch in batches:
                full = obs.update(full, batch)
        _fields_bit_equal(state, full)


def test_fused_update_leaves_other_states_to_the_full_path(kernel_calls):
    """A state with float64 extremes and int32 counts (not what init gives) is not the kernel's:
    the full path, with the dtypes it gives such a state."""
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    x = torch.randn(512, 256)
    state = obs.init(x)
    odd = type(state)(state.min_val.double(), state.max_val.double(), state.count.int(), state.nonfinite.int())
    new = obs.update(odd, x)
    assert kernel_calls == [("update", False), ("row", True)]
    assert new.min_val.dtype == torch.float64 and torch.equal(new.min_val, x.double().amin(-1))
    assert torch.equal(new.count, torch.full((512,), 256))


def test_fused_update_shares_no_memory_and_raises_on_nonfinite_when_asked():
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), nonfinite="raise"))
    x = torch.randn(512, 256)
    old = obs.init(x)
    new = obs.update(old, x)
    assert not {t.untyped_storage().data_ptr() for t in old} & {t.untyped_storage().data_ptr() for t in new}
    x[3, 4] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        obs.update(new, x)


def _minmax_per_channel():
    return qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))


def test_another_default_device_does_not_reach_the_kernel_outputs():
    """Outputs are allocated from the input (a default device of meta or cuda used to give the
    kernel pointers it cannot write: a segmentation fault)."""
    obs = _minmax_per_channel()
    x = torch.randn(1024, 256)
    state = obs.init(x)
    with torch.device("meta"):  # as torch.set_default_device("meta"), without a mode left behind
        new = obs.update(state, x)
        lo, hi, finite = torch.ops.qstats.row_extremes(x.reshape(1, 1024, 256))
    assert new.min_val.device.type == "cpu" and torch.equal(new.min_val, x.amin(-1))
    assert finite.device.type == "cpu" and bool(finite) and torch.equal(hi, x.amax(-1))


def test_functionalized_and_transformed_states_take_the_full_path():
    """State fields under functionalize, vmap or forward AD are not plain memory: the full path
    (which carries their wrappers and tangents), with the same values."""
    import torch.autograd.forward_ad as fwAD

    obs = _minmax_per_channel()
    x = torch.randn(1024, 256)
    state = obs.init(x)
    low = torch.full((1024,), -100.0)
    got = torch.func.functionalize(lambda m: obs.update(state._replace(min_val=m), x).min_val)(low)
    assert torch.equal(got, low)
    stacked = type(state)(*(torch.stack([f, f]) for f in state))
    batched = torch.vmap(lambda s: obs.update(s, x))(stacked)
    assert torch.equal(batched.max_val, torch.stack([x.amax(-1)] * 2))
    with fwAD.dual_level():
        dual = fwAD.make_dual(low, torch.ones(1024))
        tangent = fwAD.unpack_dual(obs.update(state._replace(min_val=dual), x).min_val).tangent
    assert tangent is not None and torch.equal(tangent, torch.ones(1024))


def test_a_negative_view_is_read_with_its_sign():
    x = torch.randn(1024, 256)
    negated = x._neg_view()
    obs = _minmax_per_channel()
    state = obs.update(obs.init(negated), negated)
    assert torch.equal(state.max_val, (-x).amax(-1)) and torch.equal(state.min_val, (-x).amin(-1))


def test_opposite_zeros_tie_as_torch_minimum_does():
    """State extremes +0.0 and a batch whose extremes are -0.0 (and the other way round): the
    batch's zero, as torch.minimum/maximum's vector body and so the full path here, bit for bit."""
    obs = _minmax_per_channel()
    zeros = torch.zeros(512, 64)
    state = obs.update(obs.init(zeros), zeros)
    negative = torch.full((512, 64), -0.0)
    fused = obs.update(state, negative)
    full = obs.update(state, negative, torch.ones(512, 64))  # weighted: the full path
    assert bit_equal(fused.min_val, full.min_val) and bit_equal(fused.max_val, full.max_val)
    assert bool(torch.signbit(fused.min_val).all())


def test_a_parameter_takes_the_fused_update(kernel_calls):
    weight = torch.nn.Parameter(torch.randn(1024, 256))
    obs = _minmax_per_channel()
    state = obs.update(obs.init(weight), weight)
    assert kernel_calls == [("update", True)]
    assert torch.equal(state.max_val, weight.detach().amax(-1))


def test_no_temporary_directory_means_no_kernel(monkeypatch):
    def unwritable(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setenv("QSTATS_NATIVE_CACHE", "0")  # and no kept build
    monkeypatch.setattr(_native.tempfile, "mkdtemp", unwritable)
    assert _native._build() is False


_CACHE_PROBE = r'''
import json, os, time
import torch
from qstats import _native
start = time.perf_counter()
built = _native._kernel()
seconds = time.perf_counter() - start
view = torch.randn(1, 64, 300)
lo, hi = torch.empty(64), torch.empty(64)
bad = built[0](view.data_ptr(), 0, 64, 300, lo.data_ptr(), hi.data_ptr(), 1) if built else -1
print(json.dumps({"built": bool(built), "seconds": seconds, "bad": bad,
                  "equal": bool(built) and torch.equal(lo, view[0].amin(-1)) and torch.equal(hi, view[0].amax(-1))}))
'''


def _probe(env):
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _native.available(), reason="no C++ compiler: the native kernel is not built")
def test_a_kept_build_serves_later_processes(tmp_path):
    """The first process builds the kernel and keeps it in the cache directory; a later one
    loads it without calling the compiler (``$CXX``, a wrapper that logs each call) and computes
    the same extremes. A build that does not load (a corrupt file) is replaced by a fresh one."""
    import shutil

    compiler = next((shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho call >> "{log}"\nexec "{compiler}" "$@"\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    env = dict(os.environ, QSTATS_CACHE_DIR=str(cache), CXX=str(wrapper))
    env.pop("QSTATS_NATIVE_CACHE", None)
    first = _probe(env)
    assert first["built"] and first["equal"], first
    calls = log.read_text().count("call")
    assert calls >= 1
    (kept,) = list(cache.glob("native-*.so"))
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    second = _probe(env)
    assert second["built"] and second["equal"], second
    assert log.read_text().count("call") == calls  # loaded, not built
    assert _probe(dict(env, QSTATS_NATIVE_CACHE="0"))["built"]  # without the cache: built again
    assert log.read_text().count("call") > calls
    kept.write_bytes(b"not a shared library")
    third = _probe(env)
    assert third["built"] and third["equal"], third
    assert kept.read_bytes()[:4] == b"\x7fELF"  # rebuilt and kept again


def test_the_cache_is_skipped_where_others_may_write(tmp_path, monkeypatch):
    """A cache directory that another user could change is no place to load code from: writable
    by others or by its group, or under a directory others may write (not sticky): no kept build
    is read or written there (each process builds its own). A symbolic link is followed once and
    the directory it leads to is checked and used (not the link, which its owner could move)."""
    import sys

    if not hasattr(os, "getuid"):
        pytest.skip("no user ids on this system")
    compiler = [[sys.executable]]  # a file that exists everywhere: only the directory decides
    monkeypatch.delenv("QSTATS_NATIVE_CACHE", raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("QSTATS_CACHE_DIR", str(shared))
    for mode in (0o777, 0o770, 0o720):
        shared.chmod(mode)
        assert _native._cache_file(compiler) is None, oct(mode)
    shared.chmod(0o700)
    resolved = os.path.realpath(shared)
    assert _native._cache_file(compiler).startswith(resolved + os.sep)
    link = tmp_path / "link"
    link.symlink_to(shared)
    for spelled in (str(link), str(link) + "/"):
        monkeypatch.setenv("QSTATS_CACHE_DIR", spelled)
        assert _native._cache_file(compiler).startswith(resolved + os.sep)  # the place, not the link
        shared.chmod(0o777)
        assert _native._cache_file(compiler) is None, spelled
        shared.chmod(0o700)
    open_parent = tmp_path / "open"
    (open_parent / "cache").mkdir(parents=True, mode=0o700)
    open_parent.chmod(0o777)  # others could rename "cache" away and put their own in its place
    monkeypatch.setenv("QSTATS_CACHE_DIR", str(open_parent / "cache"))
    assert _native._cache_file(compiler) is None
    open_parent.chmod(0o1777)  # sticky, as /tmp: they cannot
    assert _native._cache_file(compiler).startswith(os.path.realpath(open_parent / "cache") + os.sep)


@pytest.mark.skipif(not _native.available(), reason="no C++ compiler: the native kernel is not built")
def test_a_kept_build_others_may_write_is_not_loaded(tmp_path):
    """A kept file writable by others, or a symbolic link in its place, is not loaded."""
    import shutil

    directory = tmp_path / "build"
    directory.mkdir()
    assert _native._compile_and_load(str(directory), keep=str(tmp_path / "kept.so"))
    kept = tmp_path / "kept.so"
    assert _native._load_cached(str(kept))
    kept.chmod(0o666)
    assert _native._load_cached(str(kept)) is None and kept.exists()  # refused, not removed
    kept.chmod(0o600)
    link = tmp_path / "link.so"
    link.symlink_to(kept)
    assert _native._load_cached(str(link)) is None
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(not _native.available(), reason="no C++ compiler: the native kernel is not built")
def test_a_build_after_a_killed_compile_is_not_kept(tmp_path, monkeypatch):
    """Where the build with the best flags was killed (out of memory: the killer takes GCC's
    cc1plus, and the driver exits 1 saying so) rather than refused by the compiler, the fallback
    build serves this process but is not kept: a passing failure must not leave every later
    process with the slower kernel. A refusal keeps the fallback; a compiler that does not run at
    all leaves the next compiler's best build kept."""
    import shutil

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ (its -wrapper option runs cc1plus through a script)")
    kill = tmp_path / "kill-cc1plus"
    kill.write_text('#!/bin/sh\ncase "$1" in *cc1plus) kill -9 $$;; esac\nexec "$@"\n')
    kill.chmod(0o755)
    killed = tmp_path / "killed-cxx"  # g++ whose cc1plus is killed when it builds with -march=native
    killed.write_text(f'#!/bin/sh\ncase " $* " in *" -march=native "*) exec "{gxx}" -wrapper "{kill}" "$@";; esac\n'
                      f'exec "{gxx}" "$@"\n')
    refused = tmp_path / "refusing-cxx"  # g++ that does not know -march=native
    refused.write_text(f'#!/bin/sh\ncase " $* " in *" -march=native "*) echo "error: unrecognized command-line '
                       f'option" >&2; exit 1;; esac\nexec "{gxx}" "$@"\n')
    broken = tmp_path / "no-interpreter"  # not a program the system can run (no #! line)
    broken.write_text("echo never\n")
    for script in (killed, refused, broken):
        script.chmod(0o755)
    for name, compilers, kept_after in (
        ("killed", [[str(killed)]], False),
        ("refused", [[str(refused)]], True),
        ("broken first", [[str(broken)], [gxx]], True),
    ):
        monkeypatch.setattr(_native, "_compilers", lambda compilers=compilers: compilers)
        directory, kept = tmp_path / f"build {name}", tmp_path / f"{name}.so"
        directory.mkdir()
        assert _native._compile_and_load(str(directory), keep=str(kept)), name
        assert kept.exists() == kept_after, name
        shutil.rmtree(directory, ignore_errors=True)


def _slice_loop(fn, stack):
    """``fn`` on each slice of ``stack``, results stacked: what ``torch.vmap(fn)`` must equal."""
    outs = [fn(stack[e]) for e in range(stack.shape[0])]
    return type(outs[0])(*(torch.stack(list(fields)) for fields in zip(*outs)))


@pytest.mark.parametrize(
    "granularity",
    [qstats.PerAxis(0), qstats.PerGroup(64), qstats.PerTensor(), qstats.PerToken(), qstats.PerBlock((16, 32))],
    ids=repr,
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vmapped_update_takes_one_pass_for_every_slice(granularity, dtype, kernel_calls):
    """Under vmap the eager update unwraps the batch and makes one native pass over every slice
    (a state shared by every slice, as init gives under vmap, is read as it is, not repeated):
    bit for bit the per-slice loop, and the state of a slice with a NaN comes from the full path."""
    g = torch.Generator().manual_seed(8)
    stack = (torch.randn(6, 512, 256, generator=g) * 3).to(dtype)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))

    def two_updates(w):
        return obs.update(obs.update(obs.init(w), w), w * 0.5)

    batched = torch.vmap(two_updates)(stack)
    taken = [call for call in kernel_calls if call[0] == "update"]
    assert taken == [("update", True)] * 2
    kernel_calls.clear()
    _fields_bit_equal(batched, _slice_loop(two_updates, stack))
    # one slice not finite: the batch takes ATen's per-slice path, with the same counts
    dirty = stack.clone()
    dirty[4, 10, 3] = float("nan")
    batched = torch.vmap(two_updates)(dirty)
    assert ("update", False) in kernel_calls
    _fields_bit_equal(batched, _slice_loop(two_updates, dirty))
    assert int(batched.nonfinite.sum()) == 2


def test_vmapped_update_with_the_batch_in_another_dim(kernel_calls):
    """A batch along another dim of the input (``in_dims=1``) and in the outputs (``out_dims=1``):
    one native pass over the slices, the per-slice loop bit for bit."""
    g = torch.Generator().manual_seed(10)
    stack = torch.randn(512, 5, 128, generator=g)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    one = lambda w: obs.update(obs.init(w), w)  # noqa: E731
    batched = torch.vmap(one, in_dims=1, out_dims=1)(stack)
    assert ("update", True) in kernel_calls
    expected = _slice_loop(one, stack.movedim(1, 0))
    _fields_bit_equal(type(batched)(*(f.movedim(1, 0) for f in batched)), expected)


def test_vmapped_update_of_shared_and_stacked_states():
    """States per slice with one shared batch, one shared state observing per-slice batches that
    is not init's, and a stacked observer under vmap: the per-slice loop, bit for bit."""
    g = torch.Generator().manual_seed(9)
    stack = torch.randn(4, 512, 128, generator=g)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    states = torch.vmap(lambda w: obs.update(obs.init(w), w))(stack)
    shared_batch = torch.randn(512, 128, generator=g) * 4
    per_state = torch.vmap(lambda s: obs.update(s, shared_batch))(states)
    expected = [obs.update(type(states)(*(f[e] for f in states)), shared_batch) for e in range(4)]
    _fields_bit_equal(per_state, type(states)(*(torch.stack(list(f)) for f in zip(*expected))))
    base = obs.update(obs.init(stack[0]), stack[0] * 7)
    one = lambda w: obs.update(base, w)  # noqa: E731
    _fields_bit_equal(torch.vmap(one)(stack), _slice_loop(one, stack))


def test_vmapped_update_under_other_transforms_keeps_aten(kernel_calls):
    """Nested vmap and grad transforms are not unwrapped (their tensors are not plain memory):
    the ATen path, with the same values."""
    stack = torch.randn(2, 3, 512, 64)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    nested = torch.vmap(torch.vmap(lambda w: obs.update(obs.init(w), w)))(stack)
    assert ("update", True) not in kernel_calls
    assert torch.equal(nested.max_val, stack.amax(-1)) and torch.equal(nested.min_val, stack.amin(-1))

    def loss(w):
        state = obs.update(obs.init(w), w)
        return state.max_val.sum()

    grad = torch.func.grad(loss)(stack[0, 0].clone())
    assert ("update", True) not in kernel_calls
    assert grad.shape == (512, 64)


def test_vmapped_update_counts_every_slice_toward_the_kernel_size(kernel_calls):
    """Slices below the kernel's minimum size, together above it: one native pass (the size
    that pays for the call is the stack's); together below it: ATen. The per-slice loop, bit
    for bit, either way."""
    g = torch.Generator().manual_seed(13)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    one = lambda w: obs.update(obs.init(w), w)  # noqa: E731
    per_slice = _native._MIN_NUMEL // 8
    for slices, taken in ((16, True), (4, False)):
        stack = torch.randn(slices, 64, per_slice // 64, generator=g)
        kernel_calls.clear()
        batched = torch.vmap(one)(stack)
        assert (("update", True) in kernel_calls) == taken, slices
        _fields_bit_equal(batched, _slice_loop(one, stack))


def test_vmapped_update_reads_a_frozen_parameter_stack(kernel_calls):
    """A module's stacked weights (a frozen ``nn.Parameter``) under vmap: one native pass, as
    for a plain tensor, the per-slice loop bit for bit."""
    g = torch.Generator().manual_seed(11)
    weights = torch.nn.Parameter(torch.randn(4, 256, 300, generator=g), requires_grad=False)
    obs = qstats.minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    one = lambda w: obs.update(obs.init(w), w)  # noqa: E731
    batched = torch.vmap(one)(weights)
    assert kernel_calls == [("update", True)]
    _fields_bit_equal(batched, _slice_loop(one, weights.detach()))


def test_vmapped_global_scale_is_unbatched_whichever_path(monkeypatch):
    """Under vmap the global scale of an elementwise format is one unbatched 1, whether the
    native pass gives the scales (every entry valid) or ATen does (an uncalibrated entry): a
    caller's ``out_dims=None`` for it works on both, and the default stacks it alike."""
    g = torch.Generator().manual_seed(12)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
    obs = qstats.minmax(spec)
    states = torch.vmap(lambda w: obs.update(obs.init(w), w))(torch.randn(4, 256, 300, generator=g))
    partial = type(states)(states.min_val.clone(), states.max_val.clone(), states.count.clone(), states.nonfinite)
    partial.min_val[1, 3], partial.max_val[1, 3], partial.count[1, 3] = float("inf"), float("-inf"), 0
    taken = record_taken(monkeypatch, _native, "symmetric_scales")
    qparams = lambda s: qstats.compute_qparams(s, spec)  # noqa: E731
    out_dims = qstats.QParams(0, 0, None, 0)
    results = [torch.vmap(qparams, out_dims=out_dims)(s) for s in (states, partial)]
    stacked = [torch.vmap(qparams)(s).global_scale for s in (states, partial)]
    assert taken == [True, False, True, False]
    for result in results:
        assert result.global_scale.shape == () and float(result.global_scale) == 1.0
    assert stacked[0].shape == stacked[1].shape == (4,) and stacked[0].stride() == stacked[1].stride()
    assert torch.equal(stacked[0], torch.ones(4)) and torch.equal(stacked[1], torch.ones(4))


@pytest.mark.parametrize("mapping", ["symmetric", "narrow"])
@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8])
def test_vmapped_compute_qparams_equals_torch_ao(mapping, dtype):
    """vmap of init + update + compute_qparams over stacked experts (the update's and the
    scales' native passes over every slice at once) against torch.ao's PerChannelMinMaxObserver
    per expert; an expert that saw nothing (a masked one) gets the fallback, as per slice."""
    g = torch.Generator().manual_seed(10)
    experts = torch.randn(8, 256, 128, generator=g)
    experts[2, 5] = 0.0
    experts[3] *= 1e30
    if mapping == "narrow":
        spec = qstats.QuantSpec(dtype="int8", mapping="narrow", granularity=qstats.PerAxis(0))
    else:
        spec = qstats.QuantSpec.from_torch_ao(dtype, torch.per_channel_symmetric)
    obs = qstats.minmax(spec)

    def one(w):
        return qstats.compute_qparams(obs.update(obs.init(w), w), spec)

    batched = torch.vmap(one)(experts)
    for e in range(8):
        expected = one(experts[e])
        for name in ("scale", "zero_point", "calibrated"):
            assert bit_equal(getattr(batched, name)[e], getattr(expected, name)), (name, e)
        if mapping == "symmetric":
            reference = PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, qscheme=torch.per_channel_symmetric)
            reference(experts[e])
            scale, zero_point = reference.calculate_qparams()
            assert torch.equal(batched.scale[e], scale) and torch.equal(batched.zero_point[e].long(), zero_point)
    fallback = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
    obs = qstats.minmax(fallback)
    weight = torch.ones(8, 256, 1)
    weight[5] = 0.0  # expert 5 sees nothing

    def masked(w, m):
        return qstats.compute_qparams(obs.update(obs.init(w), w, m.expand_as(w)), fallback)

    batched = torch.vmap(masked)(experts, weight)
    assert not bool(batched.calibrated[5].any()) and bool(batched.calibrated[:5].all())
    assert torch.equal(batched.scale[5], torch.ones(256))
    expected = masked(experts[1], weight[1])
    assert bit_equal(batched.scale[1], expected.scale)


def test_intercepted_ops_never_reach_the_kernel():
    """Fake tensors, ``torch.jit.trace`` and zero tensors see the output allocations but not the
    kernel's writes (fake outputs have no memory; a trace would replay empty tensors): the ATen
    path, whose ops they record."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0))
    x = torch.randn(512, 256)
    for obs in (qstats.minmax(qstats.QuantSpec(dtype="int8")), qstats.minmax(spec)):
        with FakeTensorMode(allow_non_fake_inputs=True):
            state = obs.update(obs.init(x), x)
        assert type(state.min_val).__name__ == "FakeTensor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values
        scales = lambda lo, hi: qstats.qparams_from_minmax(lo, hi, spec).scale  # noqa: E731
        traced_scales = torch.jit.trace(scales, (-torch.ones(8), torch.ones(8)))
        per_tensor = qstats.minmax(qstats.QuantSpec(dtype="int8"))
        traced_update = torch.jit.trace(lambda t: per_tensor.update(per_tensor.init(t), t).max_val, (x,))
    assert torch.equal(traced_scales(-3 * torch.ones(8), 3 * torch.ones(8)), torch.full((8,), 3 / 127.5))
    y = torch.randn(512, 256) * 10
    assert torch.equal(traced_update(y), y.max())
    zeros = qstats.qparams_from_minmax(torch._efficientzerotensor(8), torch.ones(8), spec)
    assert torch.equal(zeros.scale, torch.full((8,), 1 / 127.5))


def test_calibrated_takes_a_mask_counts_or_a_python_bool():
    lo, hi = -torch.ones(3), torch.ones(3)
    for spec in (qstats.QuantSpec(dtype="int8"), qstats.QuantSpec(dtype="int8", mapping="asymmetric")):
        expected = qstats.qparams_from_minmax(lo, hi, spec).scale
        assert torch.equal(qstats.qparams_from_minmax(lo, hi, spec, calibrated=True).scale, expected)
        counts = qstats.qparams_from_minmax(lo, hi, spec, calibrated=torch.tensor([3, 0, 1]), check_uncalibrated=False)
        assert counts.calibrated.tolist() == [True, False, True]
        with pytest.raises(TypeError, match="bool mask or integer counts, got a tensor of dtype torch.float32"):
            qstats.qparams_from_minmax(lo, hi, spec, calibrated=torch.ones(3))


@pytest.fixture
def recalls(monkeypatch):
    """Records whether each look-up of `compute_qparams` (by spec, then by the spec's numbers)
    found the scales of the update pass (True) or not (False: `_native.recall` gave nothing)."""
    return record_taken(monkeypatch, _native, "recall")


def _torch_ao_scales(min_val, max_val, dtype=torch.qint8, qscheme=torch.per_channel_symmetric):
    """torch.ao's scales and zero points of a per-channel range (rows of a stack flattened)."""
    reference = PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, qscheme=qscheme)
    reference.min_val, reference.max_val = min_val.reshape(-1).clone(), max_val.reshape(-1).clone()
    scale, zero_point = reference.calculate_qparams()
    return scale.reshape(min_val.shape), zero_point.reshape(min_val.shape)


@pytest.mark.parametrize("form", ["plain", "vmap", "stacked"])
@pytest.mark.parametrize("dtype", [torch.qint8, torch.quint8], ids=str)
def test_the_update_pass_gives_compute_qparams_its_scales(form, dtype, recalls):
    """minmax.update maps its new ranges onto the spec's symmetric scales in the same pass, and
    the compute_qparams that follows takes them: torch.ao's scales and zero points, all
    calibrated, a global scale of ones (one per slice for a stack), bit for bit what the
    compute_qparams pass gives on a copy of the state."""
    g = torch.Generator().manual_seed(20)
    x = torch.randn(8, 256, 288, generator=g) * torch.rand(8, 256, 1, generator=g) * 4  # 64K+ values a slice
    spec = qstats.QuantSpec.from_torch_ao(dtype, torch.per_channel_symmetric)
    obs = qstats.minmax(spec)
    if form == "plain":
        state = obs.update(obs.init(x[0]), x[0])
        qparams = qstats.compute_qparams(state, spec)
        ones_shape = ()
    elif form == "vmap":
        state, qparams = torch.vmap(lambda w: (s := obs.update(obs.init(w), w), qstats.compute_qparams(s, spec)))(x)
        ones_shape = (8,)  # vmap stacks the unbatched 1
    else:
        stacked = qstats.stacked_observer(obs, 8)
        state = stacked.update(stacked.init(x), x)
        qparams = qstats.stacked_qparams(state, spec)
        ones_shape = (8,)
    assert recalls == [True]
    scale, zero_point = _torch_ao_scales(state.min_val, state.max_val, dtype)
    assert torch.equal(qparams.scale, scale) and torch.equal(qparams.zero_point.long(), zero_point)
    assert qparams.zero_point.dtype == torch.int32 and qparams.calibrated.all()
    assert torch.equal(qparams.global_scale, torch.ones(ones_shape))
    copy = type(state)(*(t.clone() for t in state))
    again = qstats.stacked_qparams(copy, spec) if form == "stacked" else (
        torch.vmap(lambda s: qstats.compute_qparams(s, spec))(copy) if form == "vmap" else qstats.compute_qparams(copy, spec)
    )
    assert recalls[0] and not any(recalls[1:])
    for name in qstats.QParams._fields:
        assert bit_equal(getattr(qparams, name), getattr(again, name)), name


def test_scales_of_the_update_pass_are_given_once_and_only_for_their_own_fields(recalls):
    """The update's scales go to the compute_qparams of its own, unchanged state and spec, once
    (a second call computes fresh tensors, so two callers never share them); another state,
    another spec, a state changed in place (or through ``.data``, or made to require grad),
    another thread or a mode that records ops get the scales computed from the fields as they
    are, against torch.ao."""
    import threading

    g = torch.Generator().manual_seed(21)
    x = torch.randn(256, 300, generator=g)
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
    obs = qstats.minmax(spec)
    state = obs.update(obs.init(x), x)
    first, second = qstats.compute_qparams(state, spec), qstats.compute_qparams(state, spec)
    assert recalls[0] and not any(recalls[1:])
    assert torch.equal(first.scale, second.scale) and first.scale.data_ptr() != second.scale.data_ptr()

    # an equal spec (another object) is found by its numbers
    import dataclasses

    state = obs.update(obs.init(x), x)
    recalls.clear()
    assert torch.equal(qstats.compute_qparams(state, dataclasses.replace(spec)).scale, first.scale)
    assert recalls == [False, True]

    def changed(change):
        recalls.clear()
        state = obs.update(obs.init(x), x)
        state = change(state) or state
        out = qstats.compute_qparams(state, spec)
        scale, _ = _torch_ao_scales(state.min_val.detach(), state.max_val.detach())
        assert torch.equal(out.scale.detach(), scale)
        return out

    def in_place(s):
        s.min_val[7] = -100.0

    def data_swap(s):
        s.max_val.data = torch.full_like(s.max_val, 50.0)

    def requires_grad(s):
        s.min_val.requires_grad_()

    for change in (in_place, data_swap):
        changed(change)
        assert recalls and not any(recalls)
    out = changed(requires_grad)
    assert recalls and not any(recalls) and out.scale.requires_grad  # the gradient reaches the range
    narrow = qstats.QuantSpec(dtype="int8", mapping="narrow", granularity=qstats.PerAxis(0))
    recalls.clear()
    state = obs.update(obs.init(x), x)
    out = qstats.compute_qparams(state, narrow)
    assert recalls and not any(recalls) and torch.equal(out.scale, torch.maximum(-state.min_val, state.max_val) / 127)
    other = obs.update(obs.init(x), x * 2)  # the latest update: an earlier state computes its own
    recalls.clear()
    assert torch.equal(qstats.compute_qparams(state, spec).scale, _torch_ao_scales(state.min_val, state.max_val)[0])
    scale, _ = _torch_ao_scales(other.min_val, other.max_val)
    assert not any(recalls)
    assert torch.equal(qstats.compute_qparams(other, spec).scale, scale) and recalls[-1]
    # another thread
    recalls.clear()
    state = obs.update(obs.init(x), x)
    results = []
    worker = threading.Thread(target=lambda: results.append(qstats.compute_qparams(state, spec)))
    worker.start()
    worker.join()
    assert recalls and not any(recalls) and torch.equal(results[0].scale, _torch_ao_scales(state.min_val, state.max_val)[0])
    # a mode recording the ops sees them run
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    recalls.clear()
    state = obs.update(obs.init(x), x)
    with Recording():
        out = qstats.compute_qparams(state, spec)
    assert recalls and not any(recalls) and {torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar} & set(Recording.ops)
    assert torch.equal(out.scale, _torch_ao_scales(state.min_val, state.max_val)[0])


def test_update_scales_with_an_entry_not_valid_leave_compute_qparams_its_own_path(recalls):
    """A state whose merged counts are not positive (a hand-made state) is updated in the pass,
    but its scales are not kept: compute_qparams maps it as it maps any state, the entries that
    count nothing uncalibrated."""
    g = torch.Generator().manual_seed(22)
    x = torch.randn(256, 300, generator=g)
    spec = qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0), on_uncalibrated="fallback")
    obs = qstats.minmax(spec)
    start = obs.init(x)
    start = start._replace(count=start.count.clone())
    start.count[3] = -300
    state = obs.update(start, x)
    assert int(state.count[3]) == 0
    qparams = qstats.compute_qparams(state, spec)
    assert recalls and not any(recalls)
    assert not bool(qparams.calibrated[3]) and float(qparams.scale[3]) == 1.0 and int(qparams.calibrated.sum()) == 255
    scale, _ = _torch_ao_scales(state.min_val, state.max_val)
    assert torch.equal(qparams.scale[4:], scale[4:])


def test_update_scales_are_kept_only_where_they_can_be_trusted_and_never_keep_a_state_alive(recalls):
    """No scales are kept for inference tensors (no version counter tells whether they change)
    or for rows shorter than `_native._SCALES_MIN_LENGTH` (most updates' scales go unread); the
    kept ones go with the state (a weak reference to its min_val, under vmap with the call); a
    per-tensor state under vmap is still refused by stacked_qparams; compute_qparams of a
    captured state inside grad and jvp works (it did not, before, on the native path)."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(23)
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
    obs = qstats.minmax(spec)
    x = torch.randn(256, 300, generator=g)
    _native._recent.clear()  # whatever earlier tests' live states left
    with torch.inference_mode():
        state = obs.update(obs.init(x), x)
        in_mode = qstats.compute_qparams(state, spec)
    assert not any(recalls) and torch.equal(in_mode.scale, _torch_ao_scales(state.min_val, state.max_val)[0])
    short = torch.randn(4096, 128, generator=g)
    recalls.clear()
    state = obs.update(obs.init(short), short)
    assert not _native._recent
    assert torch.equal(qstats.compute_qparams(state, spec).scale, _torch_ao_scales(state.min_val, state.max_val)[0])
    assert not any(recalls)
    # kept with the state, gone with it
    state = obs.update(obs.init(x), x)
    assert _native._recent
    alive = weakref.ref(state.min_val)
    del state
    gc.collect()
    assert alive() is None and not _native._recent
    torch.vmap(lambda w: obs.update(obs.init(w), w))(torch.randn(4, 256, 300, generator=g))
    assert not _native._recent  # the batched fields died with the call
    per_tensor = qstats.minmax(qstats.QuantSpec(dtype="int8"))
    with pytest.raises(ValueError, match="expected a stacked state"):
        torch.vmap(lambda w: qstats.stacked_qparams(per_tensor.update(per_tensor.init(w), w), per_tensor.spec))(
            torch.randn(4, 256, 300, generator=g)
        )
    # inside grad and jvp (the first call takes the kept scales, the second the pass)
    state = obs.update(obs.init(x), x)
    expected = _torch_ao_scales(state.min_val, state.max_val)[0]
    for _ in range(2):
        grad = torch.func.grad(lambda z: (qstats.compute_qparams(state, spec).scale * z).sum())(torch.ones(256))
        assert torch.equal(grad, expected)
        _, tangent = torch.func.jvp(lambda z: qstats.compute_qparams(state, spec).scale * z, (torch.ones(256),),
                                    (torch.ones(256),))
        assert torch.equal(tangent, expected)


# --------------------------------------------------------------------------------------------
# memoryless_minmax: the same pass, the state's values unread


def _odd_state(obs, x, g):
    """A memoryless state that is not init's: the extremes and counts of other, wider data."""
    other = torch.randn(x.shape, generator=g) * 50
    return obs.update(obs.init(other), other)


@pytest.mark.parametrize("stacked", [False, True], ids=["plain", "stacked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", [qstats.PerAxis(0), qstats.PerGroup(32), qstats.PerToken()], ids=repr)
def test_memoryless_fused_update_equals_the_full_path(stacked, dtype, granularity, kernel_calls, monkeypatch):
    """memoryless_minmax.update of an unweighted batch is one native pass that forgets the state:
    bit for bit (signed zeros included) the full path's batch extremes and counts, whatever state
    it is given."""
    g = torch.Generator().manual_seed(31)
    shape = (4, 256, 96) if stacked else (256, 384)
    batches = [torch.randn(shape, generator=g).round() * 0.0, torch.randn(shape, generator=g) * 3]
    batches[0][..., ::2] = -0.0
    batches = [b.to(dtype) for b in batches]
    obs = qstats.memoryless_minmax(qstats.QuantSpec(dtype="int8", granularity=granularity))
    if stacked:
        obs = qstats.stacked_observer(obs, 4)
    start = _odd_state(obs, batches[1], g)
    kernel_calls.clear()

    def run():
        return [obs.update(start, batch) for batch in batches]

    fused = run()
    assert kernel_calls == [("update", True)] * 2
    monkeypatch.setattr(_native, "update_extremes", lambda *args, **kwargs: None)
    for a, b in zip(fused, run()):
        _fields_bit_equal(a, b)
    n = batches[1].shape[-1] if not isinstance(granularity, qstats.PerGroup) else 32
    assert (fused[1].count == n).all() and (fused[1].nonfinite == 0).all()


def test_memoryless_fused_update_leaves_per_tensor_masked_and_odd_states_to_the_full_path(kernel_calls):
    """Per tensor (one ATen aminmax is one pass too), with a weight (unreached parameters keep
    the state) and for float64 extremes (the full path's dtypes): no fused update."""
    x = torch.randn(512, 256)
    per_tensor = qstats.memoryless_minmax(qstats.QuantSpec(dtype="int8"))
    state = per_tensor.update(per_tensor.init(x), x)
    assert ("update", True) not in kernel_calls and state.max_val == x.max()
    obs = qstats.memoryless_minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    weight = torch.ones(512, 256)
    weight[3] = 0  # row 3 unreached: keeps the state's
    start = obs.update(obs.init(x), x * 2)
    kernel_calls.clear()
    masked = obs.update(start, x, weight)
    assert ("update", True) not in kernel_calls
    assert masked.max_val[3] == 2 * x[3].max() and masked.max_val[4] == x[4].max()
    kernel_calls.clear()
    odd = type(start)(start.min_val.double(), start.max_val.double(), start.count, start.nonfinite)
    new = obs.update(odd, x)
    assert kernel_calls == [("update", False), ("row", True)]
    assert new.min_val.dtype == torch.float64 and torch.equal(new.min_val, x.double().amin(-1))


def test_memoryless_fused_update_with_a_nonfinite_value_takes_the_full_path(kernel_calls):
    x = torch.randn(512, 256)
    x[7, 9] = float("nan")
    obs = qstats.memoryless_minmax(qstats.QuantSpec(dtype="int8", granularity=qstats.PerAxis(0)))
    state = obs.update(obs.init(x), x)
    assert kernel_calls[0] == ("update", False)
    assert state.nonfinite[7] == 1 and state.count[7] == 255 and state.nonfinite.sum() == 1
    assert torch.equal(state.max_val[7], x[7].nan_to_num(-torch.inf).max())


@pytest.mark.parametrize("form", ["plain", "vmap", "stacked"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "args",
    [
        dict(num_bits=8, symmetric=True, strategy="channel"),
        dict(num_bits=8, symmetric=False, strategy="channel"),
        dict(num_bits=4, symmetric=True, strategy="group", group_size=128),
        dict(num_bits=4, symmetric=False, strategy="group", group_size=128),
    ],
    ids=lambda a: f"int{a['num_bits']}-{'sym' if a['symmetric'] else 'asym'}-{a['strategy']}",
)
def test_memoryless_fused_update_equals_llm_compressor(form, weight_dtype, args, kernel_calls, recalls):
    """Large weights (the fused path) through qstats.memoryless_minmax, as one weight, under vmap
    and as a stack, against llm-compressor's memoryless_minmax weight observer and
    compressed-tensors' calculate_qparams, expert by expert: the same scales and zero points.
    compressed-tensors' symmetric mapping on rows of 256 values or more, in float32 or in the
    half weight's arithmetic, takes the scales the update's pass computed (compute_qparams
    makes no pass of its own)."""
    llmc_observers = pytest.importorskip("llmcompressor.observers")
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(type="int", **args)
    g = torch.Generator().manual_seed(32)
    experts = (torch.randn(3, 512, 384, generator=g) * torch.rand(3, 512, 1, generator=g)).to(weight_dtype)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=weight_dtype)
    obs = qstats.memoryless_minmax(spec)
    if form == "plain":
        qparams = [qstats.compute_qparams(obs.update(obs.init(w), w), spec) for w in experts]
    elif form == "vmap":
        out = torch.vmap(lambda w: qstats.compute_qparams(obs.update(obs.init(w), w), spec))(experts)
        qparams = [type(out)(*(t[e] for t in out)) for e in range(3)]
    else:
        stacked = qstats.stacked_observer(obs, 3)
        out = qstats.stacked_qparams(stacked.update(stacked.init(experts), experts), spec)
        qparams = [type(out)(*(t[e] for t in out)) for e in range(3)]
    assert kernel_calls and all(call == ("update", True) for call in kernel_calls)
    if args.symmetric and args.strategy == "channel":
        assert recalls == [True] * (3 if form == "plain" else 1)
    else:  # asymmetric, or rows of 128: compute_qparams' own path
        assert not any(recalls)
    for e, qp in enumerate(qparams):
        reference = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
        reference(experts[e])
        theirs = reference.get_qparams()
        assert torch.equal(qp.scale, theirs["scale"].float().reshape(qp.scale.shape)), e
        assert torch.equal(qp.zero_point.float(), theirs["zero_point"].float().reshape(qp.scale.shape)), e


@pytest.mark.parametrize("form", ["plain", "vmap", "stacked"])
def test_memoryless_update_pass_gives_compute_qparams_its_scales(form, recalls):
    """As for minmax: the memoryless update's pass maps its ranges onto torch.ao's symmetric
    scales, and compute_qparams takes them, bit for bit what its own pass gives on a copy."""
    g = torch.Generator().manual_seed(33)
    x = torch.randn(8, 256, 288, generator=g) * torch.rand(8, 256, 1, generator=g) * 4
    spec = qstats.QuantSpec.from_torch_ao(torch.qint8, torch.per_channel_symmetric)
    obs = qstats.memoryless_minmax(spec)
    if form == "plain":
        state = obs.update(_odd_state(obs, x[0], g), x[0])
        qparams = qstats.compute_qparams(state, spec)
    elif form == "vmap":
        state, qparams = torch.vmap(lambda w: (s := obs.update(obs.init(w), w), qstats.compute_qparams(s, spec)))(x)
    else:
        stacked = qstats.stacked_observer(obs, 8)
        state = stacked.update(_odd_state(stacked, x, g), x)
        qparams = qstats.stacked_qparams(state, spec)
    assert recalls == [True]
    scale, zero_point = _torch_ao_scales(state.min_val, state.max_val)
    assert torch.equal(qparams.scale, scale) and torch.equal(qparams.zero_point.long(), zero_point)
    copy = type(state)(*(t.clone() for t in state))
    again = qstats.stacked_qparams(copy, spec) if form == "stacked" else (
        torch.vmap(lambda s: qstats.compute_qparams(s, spec))(copy) if form == "vmap" else qstats.compute_qparams(copy, spec)
    )
    for name in qstats.QParams._fields:
        assert bit_equal(getattr(qparams, name), getattr(again, name)), name


# --------------------------------------------------------------------------------------------
# the per-tensor reduction of every observer (finite_aminmax over one parameter): the whole pass


@pytest.mark.parametrize("size", [1 << 16, (1 << 20) + 4096 * 3 + 17, 4096 * 37 + 5], ids=["64K", "1M+", "rows+tail"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_extremes_equal_aten(size, threads, dtype, read_mode):
    g = torch.Generator().manual_seed(size % 1000)
    view = (torch.randn(1, size, generator=g) * 7).to(dtype)
    with torch_threads(threads):
        lo, hi, finite = _native.whole_extremes(view)
    assert finite and lo.dtype == hi.dtype == torch.float32 and lo.shape == hi.shape == ()
    assert torch.equal(lo, view.amin().float()) and torch.equal(hi, view.amax().float())
    for where in (0, size // 2, size - 1):
        for value in (float("nan"), float("inf")):
            dirty = view.clone()
            dirty[0, where] = value
            assert _native.whole_extremes(dirty)[2] is False
    assert _native.whole_extremes(view[:, :100]) is None  # too small: aminmax
    assert _native.whole_extremes(view.expand(2, size)) is None  # two observations


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_tensor_moving_average_takes_the_whole_pass_and_equals_torch_ao(dtype, monkeypatch):
    """moving_average_minmax per tensor on large batches (the whole pass instead of aminmax)
    against torch.ao's MovingAverageMinMaxObserver, bit for bit over four observations; a NaN
    in a batch takes the full path, which ignores and counts it."""
    from torch.ao.quantization import MovingAverageMinMaxObserver

    taken = record_taken(monkeypatch, _reductions, "whole_extremes")
    g = torch.Generator().manual_seed(41)
    batches = [(torch.randn(512, 384, generator=g) * s + s / 3).to(dtype) for s in (1.0, 4.0, 0.25, 2.0)]
    spec = qstats.QuantSpec.from_torch_ao(torch.quint8, torch.per_tensor_affine)
    obs = qstats.moving_average_minmax(spec, averaging_constant=0.1)
    reference = MovingAverageMinMaxObserver(averaging_constant=0.1, dtype=torch.quint8)
    state = obs.init(batches[0])
    for batch in batches:
        state = obs.update(state, batch)
        reference(batch.float())
    assert taken == [True] * 4
    assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)
    qp = qstats.compute_qparams(state, spec)
    scale, zero_point = reference.calculate_qparams()
    assert torch.equal(qp.scale.reshape(1), scale) and torch.equal(qp.zero_point.reshape(1).long(), zero_point)
    dirty = batches[1].clone()
    dirty[3, 5] = float("nan")
    new = obs.update(state, dirty)
    assert taken[-1] and int(new.nonfinite) == int(state.nonfinite) + 1
    monkeypatch.setattr(_reductions, "whole_extremes", lambda view: None)  # aminmax
    again = obs.init(batches[0])
    for batch in batches:
        again = obs.update(again, batch)
    _fields_bit_equal(state, again)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_per_tensor_memoryless_takes_the_whole_pass_and_equals_llm_compressor(weight_dtype, symmetric, monkeypatch):
    """memoryless_minmax per tensor on a large weight through the whole pass, against
    llm-compressor's memoryless_minmax weight observer (tensor strategy)."""
    llmc_observers = pytest.importorskip("llmcompressor.observers")
    from compressed_tensors.quantization import QuantizationArgs

    taken = record_taken(monkeypatch, _reductions, "whole_extremes")
    args = QuantizationArgs(num_bits=8, type="int", symmetric=symmetric, strategy="tensor")
    g = torch.Generator().manual_seed(42)
    weight = (torch.randn(1024, 512, generator=g) * 0.05 + 0.01).to(weight_dtype)
    spec = qstats.QuantSpec.from_compressed_tensors(args, observed_dtype=weight_dtype)
    obs = qstats.memoryless_minmax(spec)
    qp = qstats.compute_qparams(obs.update(obs.init(weight), weight), spec)
    assert taken == [True]
    reference = llmc_observers.Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    reference(weight)
    theirs = reference.get_qparams()
    assert torch.equal(qp.scale.reshape(1), theirs["scale"].float().reshape(1))
    assert torch.equal(qp.zero_point.float().reshape(1), theirs["zero_point"].float().reshape(1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_tensor_histogram_extremes_take_the_whole_pass(dtype, monkeypatch):
    """The histogram observer's per-tensor extremes (beside its bucket counts) through the whole
    pass, against torch.ao's HistogramObserver's min_val / max_val over three batches; with a
    NaN, the finite values' extremes (the pass flags it: aminmax over the finite values)."""
    from torch.ao.quantization import HistogramObserver

    taken = record_taken(monkeypatch, _native, "whole_extremes")
    g = torch.Generator().manual_seed(43)
    batches = [(torch.randn(512, 256, generator=g) * s).to(dtype) for s in (1.0, 3.0, 0.5)]
    obs = qstats.histogram(qstats.QuantSpec(dtype="uint8", mapping="asymmetric"))
    reference = HistogramObserver()
    state = obs.init(batches[0])
    for batch in batches:
        state = obs.update(state, batch)
        reference(batch.float())
    assert taken and all(taken)
    assert torch.equal(state.min_val, reference.min_val) and torch.equal(state.max_val, reference.max_val)
    dirty = (torch.randn(512, 256, generator=g) * 9).to(dtype)
    dirty[1, 2] = float("nan")
    new = obs.update(obs.init(dirty), dirty)
    finite = dirty[~dirty.isnan()].float()
    assert torch.equal(new.min_val, finite.min()) and torch.equal(new.max_val, finite.max())
