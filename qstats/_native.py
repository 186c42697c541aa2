"""One-pass row extremes on CPU: a small C++ kernel, compiled on first use.

ATen has no fast one-pass reduction giving both the min and the max of each row (``aminmax``
with a ``dim`` is several times slower than ``amin``; ``amin`` then ``amax`` reads the tensor
twice, and the compiler's fused reduction of both is slower than one sum), so the min/max
reduction (`qstats._reductions.finite_aminmax`: plain tensors, ``vmap``, whose batching rule
reduces the whole stack in one call, and ``torch.compile``, through the op
``qstats::row_extremes``) takes this kernel for large, unmasked, contiguous float32, bfloat16 or
float16 CPU inputs with one observation, some parameter dims and groups of 16 values or more
(per-channel, per-group, per-token): one read of the data, both extremes, and a flag for any
value that is not finite or any range that overflows (the caller then takes the full path).
`update_extremes` is the same pass merged into a min/max state with its counts: the whole eager
``minmax.update`` of an unweighted batch (plain or stacked) in one read of the data.
Everything else (masks, other dtypes, non-contiguous views, small tensors, accelerators) keeps
the ATen reductions, and so does every machine where the kernel cannot be built (no C++
compiler: tried once per process, silently).

The kernel is portable C++ (GCC/Clang vector extensions, no intrinsics), compiled with the
system's C++ compiler (``$CXX``, else ``c++``, ``g++``, ``clang++``) in a private temporary
directory, removed once the library is loaded, for this machine (``-march=native`` where the
compiler takes it), in about a quarter of a second, once per process. It splits rows over
``torch.get_num_threads()`` threads of torch's own OpenMP runtime (one thread in a forked child,
where that runtime's pool is gone). Min and max are exact, so the results equal ATen's
``amin``/``amax`` bit for bit (up to the sign of a zero extreme, which no qparam reads; ATen's
own choice between -0.0 and +0.0 depends on the memory layout). ``QSTATS_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import torch

__all__ = ["applies", "available", "row_extremes", "update_extremes"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <float.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Loads of 16 values as float32 lanes (exact widening for bfloat16 and float16), and of one.
struct F32 {
  typedef float T;
  static inline v16 load(const T* p) { v16 v; memcpy(&v, p, sizeof v); return v; }
  static inline float one(const T* p) { return *p; }
};
struct BF16 {
  typedef uint16_t T;
  static inline v16 load(const T* p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, u32x16) << 16);
  }
  static inline float one(const T* p) {
    uint32_t bits = (uint32_t)*p << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
  }
};
struct F16 {
  typedef uint16_t T;
  // IEEE half to single by integer arithmetic (vectorises everywhere; exact for every value):
  // move exponent and mantissa into place and rebias; Inf/NaN get the rest of the exponent;
  // subnormals are renormalised by one float subtraction
  static inline v16 load(const T* p) {
    u16x16 h16;
    memcpy(&h16, p, sizeof h16);
    const u32x16 h = __builtin_convertvector(h16, u32x16);
    u32x16 o = (h & 0x7fff) << 13;
    const u32x16 e = o & (0x7c00u << 13);
    o += (127 - 15) << 23;
    o = e == (0x7c00u << 13) ? o + ((128 - 16) << 23) : o;
    const v16 renormalised = (v16)(o + (1u << 23)) - (v16)((u32x16){} + (113u << 23));
    o = e == 0 ? (u32x16)renormalised : o;
    return (v16)(o | ((h & 0x8000) << 16));
  }
  static inline float one(const T* p) {
    const uint32_t h = *p;
    uint32_t o = (h & 0x7fff) << 13;
    const uint32_t e = o & (0x7c00u << 13);
    o += (127 - 15) << 23;
    float v;
    if (e == (0x7c00u << 13)) {
      o += (128 - 16) << 23;
    } else if (e == 0) {
      o += 1u << 23;
      const uint32_t magic_bits = 113u << 23;
      float magic;
      memcpy(&v, &o, sizeof v);
      memcpy(&magic, &magic_bits, sizeof magic);
      v -= magic;
      memcpy(&o, &v, sizeof v);
    }
    o |= (h & 0x8000) << 16;
    memcpy(&v, &o, sizeof v);
    return v;
  }
};

#if defined(__clang__)
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (i16){__VA_ARGS__})
#endif

// the min / max of a vector's 16 lanes, in four shuffle-and-compare steps
static inline float lanes_min(v16 v) {
  v16 t;
  t = SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); v = t < v ? t : v;
  t = SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); v = t < v ? t : v;
  t = SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); v = t < v ? t : v;
  t = SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); v = t < v ? t : v;
  return v[0];
}

static inline float lanes_max(v16 v) {
  v16 t;
  t = SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); v = t > v ? t : v;
  t = SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); v = t > v ? t : v;
  t = SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); v = t > v ? t : v;
  t = SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); v = t > v ? t : v;
  return v[0];
}

// Rows [r0, r1) of x viewed as [rows, len] (contiguous, len >= 16): lo[r] / hi[r] are the row's
// min / max. Returns 1 when a value is not finite or a row's range overflows. The first vector
// initialises the accumulators; two pairs of them hide the compare-select latency; v - v is 0
// for a finite v and NaN otherwise, so one sum of those tells whether every value was finite.
// With a state (s != nullptr: its min, max, count and non-finite count per row), lo / hi are
// merged with the state's extremes as torch.minimum / torch.maximum merge them in their vector
// body (the batch's value on a tie, so for -0.0 and +0.0 too; a NaN in the state stays),
// count[r] = the state's + len and nonfinite[r] the state's: the whole update of a min/max
// state in the same pass.
struct State {
  const float* lo;
  const float* hi;
  const int64_t* count;
  const int64_t* nonfinite;
  int64_t* count_out;
  int64_t* nonfinite_out;
};

template <class L>
static int extremes(const typename L::T* x, int64_t len, float* lo, float* hi, int64_t r0, int64_t r1,
                    const State* s) {
  v16 probe = {0};
  float tail_probe = 0.0f;
  int overflow = 0;
  const int64_t body = len - len % 16;
  for (int64_t r = r0; r < r1; ++r) {
    const typename L::T* p = x + r * len;
    v16 mn0 = L::load(p), mx0 = mn0, mn1 = mn0, mx1 = mn0;
    v16 sum = mn0 - mn0;
    int64_t j = 16;
    for (; j + 32 <= body; j += 32) {
      v16 a = L::load(p + j), b = L::load(p + j + 16);
      sum += (a - a) + (b - b);
      mn0 = a < mn0 ? a : mn0; mx0 = a > mx0 ? a : mx0;
      mn1 = b < mn1 ? b : mn1; mx1 = b > mx1 ? b : mx1;
    }
    if (j < body) {
      v16 a = L::load(p + j);
      sum += a - a;
      mn0 = a < mn0 ? a : mn0; mx0 = a > mx0 ? a : mx0;
    }
    probe += sum;
    float m = lanes_min(mn1 < mn0 ? mn1 : mn0), M = lanes_max(mx1 > mx0 ? mx1 : mx0);
    for (j = body; j < len; ++j) {
      const float v = L::one(p + j);
      tail_probe += v - v;
      m = v < m ? v : m;
      M = v > M ? v : M;
    }
    overflow |= !(M - m <= FLT_MAX);  // an infinite extreme or an overflowing range
    if (s) {
      m = m <= s->lo[r] ? m : s->lo[r];
      M = M >= s->hi[r] ? M : s->hi[r];
      s->count_out[r] = s->count[r] + len;
      s->nonfinite_out[r] = s->nonfinite[r];
    }
    lo[r] = m;
    hi[r] = M;
  }
  int bad = overflow | (tail_probe != 0.0f);
  for (int k = 0; k < 16; ++k) bad |= probe[k] != 0.0f;
  return bad;
}

template <class L>
static int split(const void* data, int64_t rows, int64_t len, float* lo, float* hi, int64_t threads,
                 const State* s) {
  const typename L::T* x = (const typename L::T*)data;
  int bad = 0;
#ifdef _OPENMP
  if (threads > 1 && rows >= threads) {
    // torch's own OpenMP runtime (the process has loaded its libgomp): its warm threads, no
    // second pool spinning against them
    const int64_t step = (rows + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) reduction(|: bad) schedule(static, 1)
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t r0 = t * step, r1 = r0 + step < rows ? r0 + step : rows;
      if (r0 < r1) bad |= extremes<L>(x, len, lo, hi, r0, r1, s);
    }
    return bad;
  }
#endif
  return extremes<L>(x, len, lo, hi, 0, rows, s);
}

static int dispatch(const void* x, int64_t kind, int64_t rows, int64_t len, float* lo, float* hi,
                    int64_t threads, const State* s) {
  if (kind == 0) return split<F32>(x, rows, len, lo, hi, threads, s);
  if (kind == 1) return split<BF16>(x, rows, len, lo, hi, threads, s);
  if (kind == 2) return split<F16>(x, rows, len, lo, hi, threads, s);
  return -1;
}

// kind: 0 float32, 1 bfloat16, 2 float16. Returns 1 when flagged, 0 when not, -1 for another.
extern "C" int qstats_row_extremes(const void* x, int64_t kind, int64_t rows, int64_t len,
                                   float* lo, float* hi, int64_t threads) {
  return dispatch(x, kind, rows, len, lo, hi, threads, nullptr);
}

// The same, merged into a min/max state (see State); the outputs are only meaningful when the
// result is 0 (a flagged input leaves them partly written: the caller takes the full path).
extern "C" int qstats_update_extremes(const void* x, int64_t kind, int64_t rows, int64_t len,
                                      const float* state_lo, const float* state_hi,
                                      const int64_t* state_count, const int64_t* state_nonfinite,
                                      float* lo, float* hi, int64_t* count, int64_t* nonfinite,
                                      int64_t threads) {
  const State s = {state_lo, state_hi, state_count, state_nonfinite, count, nonfinite};
  return dispatch(x, kind, rows, len, lo, hi, threads, &s);
}
"""

# Below this many values the two ATen reductions cost about as much as the call (and the data
# stays in cache, where a second pass is cheap); below this many per thread, no extra thread.
_MIN_NUMEL = 1 << 16
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NUMEL_PER_THREAD = 1 << 18

_lock = threading.Lock()
_library = None  # the loaded kernel, False where it cannot be built, None before the first try
_forked = False  # a child forked from this process: one thread (GNU OpenMP's pool does not survive a fork)


def _after_fork_in_child():
    global _forked, _lock
    _forked = True
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _compilers():
    seen = []
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path and path not in seen:
            seen.append(path)
    return seen


def _build():
    if os.environ.get("QSTATS_NATIVE", "1") == "0":
        return False
    try:
        directory = tempfile.mkdtemp(prefix="qstats-native-")
    except OSError:  # no writable temporary directory: ATen's reductions
        return False
    try:
        return _compile_and_load(directory)
    except OSError:
        return False
    finally:
        # the loaded library stays mapped; nothing is left behind, even if the process crashes
        shutil.rmtree(directory, ignore_errors=True)


def _compile_and_load(directory):
    source = os.path.join(directory, "row_extremes.cpp")
    with open(source, "w") as f:
        f.write(_SOURCE)
    target = os.path.join(directory, "row_extremes.so")
    base = ["-O3", "-std=c++17", "-shared", "-fPIC", source, "-o", target]
    for compiler in _compilers():
        for flags in (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []):
            try:
                done = subprocess.run([compiler, *flags, *base], capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                break
            if done.returncode == 0:
                try:
                    library = ctypes.CDLL(target)
                except OSError:
                    break
                extremes = library.qstats_row_extremes
                extremes.restype = ctypes.c_int
                extremes.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 2, ctypes.c_int64]
                update = library.qstats_update_extremes
                update.restype = ctypes.c_int
                update.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 8, ctypes.c_int64]
                return extremes, update
    return False


def _kernel():
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = _build()
    return _library


def applies(view: torch.Tensor, numel: Optional[int] = None) -> bool:
    """Whether `row_extremes` takes ``view`` (its shape, dtype, device and layout; fake tensors
    under ``torch.compile`` answer too) on a machine with the kernel. ``numel``: the size that
    counts, where it is not the view's (under ``vmap``, every slice together)."""
    return (
        view.ndim >= 3  # some parameter dims: a single row would take one thread
        and view.shape[0] == 1
        and view.shape[-1] >= 16
        and view.dtype in _KINDS
        and view.device.type == "cpu"
        and (view.numel() if numel is None else numel) >= _MIN_NUMEL
        and view.is_contiguous()
        # when tracing, the op's implementation asks again of the real tensor
        and (torch.compiler.is_compiling() or _plain_memory(view))
        and available()
    )


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are its memory as it is: no negative bit, no functionalization or
    functorch wrapper (whose data pointer is not the values'). Fake tensors under
    ``torch.compile`` pass (their real counterparts are checked again at run time)."""
    return not (t.is_neg() or torch._is_functional_tensor(t) or torch._C._functorch.is_functorch_wrapped_tensor(t))


def available() -> bool:
    """Whether this machine has the kernel (builds it on the first call)."""
    return bool(_kernel())


if hasattr(torch.compiler, "assume_constant_result"):
    # a constant for torch.compile, which cannot trace the build or the ctypes handle
    available = torch.compiler.assume_constant_result(available)


def row_extremes(view: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Min and max of a canonical view ``(1, *qparam_shape, group)`` over its last dim, in one
    pass, as float32, with ``True`` when every value is finite and so is every range
    (``max - min``).

    Returns None where the kernel does not apply (`applies`: more than one observation, no
    parameter dims, a group below 16 values, fewer than ``_MIN_NUMEL`` values, not a contiguous
    float32, bfloat16 or float16 CPU tensor) or where this machine has no kernel: the caller then
    takes ATen's reductions.
    """
    if not applies(view):
        return None
    out_shape = view.shape[1:-1]
    length = view.shape[-1]
    lo = view.new_empty(out_shape, dtype=torch.float32)  # the view's device and kind, not the default ones
    hi = view.new_empty(out_shape, dtype=torch.float32)
    bad = _kernel()[0](
        view.data_ptr(), _KINDS[view.dtype], view.numel() // length, length, lo.data_ptr(), hi.data_ptr(), _threads(view)
    )
    if bad < 0:
        raise AssertionError(f"qstats: the native kernel does not know dtype {view.dtype}")
    return lo, hi, not bad


def _threads(view: torch.Tensor) -> int:
    return 1 if _forked else max(1, min(torch.get_num_threads(), view.numel() // _NUMEL_PER_THREAD))


def _standard_fields(fields, shape) -> bool:
    """float32 extremes and int64 counts, contiguous, on the CPU, all of ``shape``, plain memory,
    no autograd (a field's gradient or forward-AD tangent is the full path's to carry)."""
    return all(
        type(t) is torch.Tensor
        and t.dtype == dtype
        and t.device.type == "cpu"
        and tuple(t.shape) == shape
        and t.is_contiguous()
        and not t.requires_grad
        and _plain_memory(t)
        and torch.autograd.forward_ad.unpack_dual(t).tangent is None
        for t, dtype in zip(fields, (torch.float32, torch.float32, torch.int64, torch.int64))
    )


def update_extremes(view: torch.Tensor, lo, hi, count, nonfinite):
    """A min/max state's whole update by an unmasked ``view`` in one pass: the new
    ``(min, max, count, nonfinite)``, fresh tensors, equal to merging `row_extremes` and the
    view's counts into the given fields with torch.minimum, torch.maximum and additions.

    Returns None where the kernel does not apply (as `row_extremes`, or fields other than
    float32 extremes and int64 counts of the parameter shape, contiguous, on the CPU) or where
    some value is not finite or some range overflows: the caller then takes the full path.
    """
    shape = tuple(view.shape[1:-1])
    fields = (lo, hi, count, nonfinite)
    if not applies(view) or not _standard_fields(fields, shape):
        return None
    length = view.shape[-1]
    out = [view.new_empty(shape, dtype=t.dtype) for t in fields]
    bad = _kernel()[1](
        view.data_ptr(), _KINDS[view.dtype], view.numel() // length, length,
        *(t.data_ptr() for t in fields), *(t.data_ptr() for t in out), _threads(view),
    )
    if bad:
        return None
    return tuple(out)
