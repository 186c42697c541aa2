"""One-pass row extremes on CPU: a small C++ kernel, compiled on first use.

ATen has no fast one-pass reduction giving both the min and the max of each row (``aminmax``
with a ``dim`` is several times slower than ``amin``; ``amin`` then ``amax`` reads the tensor
twice), so per-channel and per-group min/max updates of large float32 tensors on CPU take this
kernel: one read of the data, both extremes, a flag for any NaN or any non-finite range. It is
the plain eager path's only native code; everything else (vmap, compile, accelerators, masks,
other dtypes, non-contiguous views, small tensors) keeps the ATen reductions, and so does every
machine where the kernel cannot be built (no C++ compiler: checked once per process, silently).

The kernel is portable C++ (GCC/Clang vector extensions, no intrinsics), compiled with the
system's C++ compiler (``$CXX``, else ``c++``, ``g++``, ``clang++``) into a private temporary
directory of this process, for this machine (``-march=native`` where the compiler takes it); it
takes about a quarter of a second, once. Min and max are exact, so the results equal ATen's
``amin``/``amax`` bit for bit (up to the sign of a zero extreme, which no qparam reads).
``QSTATS_NATIVE=0`` in the environment turns it off.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import torch

__all__ = ["row_extremes"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <float.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 vload(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }

// Rows [r0, r1) of x viewed as [rows, len] (contiguous, len >= 16): lo[r] / hi[r] are the row's
// min / max. Returns 1 when a value is NaN or a row's range is not finite. (The first vector
// initialises the accumulators; two pairs of them hide the compare-select latency.)
static int extremes(const float* x, int64_t len, float* lo, float* hi, int64_t r0, int64_t r1) {
  i16 nan = {0};
  int bad = 0;
  const int64_t body = len - len % 16;
  for (int64_t r = r0; r < r1; ++r) {
    const float* p = x + r * len;
    v16 mn0 = vload(p), mx0 = mn0, mn1 = mn0, mx1 = mn0;
    nan |= mn0 != mn0;
    int64_t j = 16;
    for (; j + 32 <= body; j += 32) {
      v16 a = vload(p + j), b = vload(p + j + 16);
      nan |= (a != a) | (b != b);
      mn0 = a < mn0 ? a : mn0; mx0 = a > mx0 ? a : mx0;
      mn1 = b < mn1 ? b : mn1; mx1 = b > mx1 ? b : mx1;
    }
    for (; j < body; j += 16) {
      v16 a = vload(p + j);
      nan |= a != a;
      mn0 = a < mn0 ? a : mn0; mx0 = a > mx0 ? a : mx0;
    }
    mn0 = mn1 < mn0 ? mn1 : mn0;
    mx0 = mx1 > mx0 ? mx1 : mx0;
    float m = mn0[0], M = mx0[0];
    for (int k = 1; k < 16; ++k) {
      m = mn0[k] < m ? mn0[k] : m;
      M = mx0[k] > M ? mx0[k] : M;
    }
    for (; j < len; ++j) {
      const float v = p[j];
      bad |= v != v;
      m = v < m ? v : m;
      M = v > M ? v : M;
    }
    bad |= !(M - m <= FLT_MAX);  // an infinite extreme or an overflowing range
    lo[r] = m;
    hi[r] = M;
  }
  for (int k = 0; k < 16; ++k) bad |= nan[k] != 0;
  return bad;
}

extern "C" int qstats_row_extremes(const float* x, int64_t rows, int64_t len,
                                   float* lo, float* hi, int64_t threads) {
  int bad = 0;
#ifdef _OPENMP
  if (threads > 1 && rows >= threads) {
    // torch's own OpenMP runtime (the process has loaded its libgomp): its warm threads, no
    // second pool spinning against them
    const int64_t step = (rows + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) reduction(|: bad) schedule(static, 1)
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t r0 = t * step, r1 = r0 + step < rows ? r0 + step : rows;
      if (r0 < r1) bad |= extremes(x, len, lo, hi, r0, r1);
    }
    return bad;
  }
#endif
  return extremes(x, len, lo, hi, 0, rows);
}
"""

# Below this many values the two ATen reductions cost about as much as the call (and the data
# stays in cache, where a second pass is cheap); below this many per thread, no extra thread.
_MIN_NUMEL = 1 << 16
_NUMEL_PER_THREAD = 1 << 18

_lock = threading.Lock()
_library = None  # the loaded kernel, False where it cannot be built, None before the first try


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
    directory = tempfile.mkdtemp(prefix="qstats-native-")
    atexit.register(shutil.rmtree, directory, True)
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
                function = library.qstats_row_extremes
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                return function
    return False


def _kernel():
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = _build()
    return _library


def row_extremes(view: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Min and max of a canonical view ``(1, *qparam_shape, group)`` over its last dim, in one
    pass, with ``True`` when every value is finite and so is every range (``max - min``).

    Returns None where the kernel does not apply (more than one observation, a group below 16
    values, fewer than ``_MIN_NUMEL`` values, not a contiguous float32 CPU tensor) or where this
    machine has no kernel: the caller then takes ATen's reductions.
    """
    if (
        view.ndim < 2
        or view.shape[0] != 1
        or view.shape[-1] < 16
        or view.dtype != torch.float32
        or view.device.type != "cpu"
        or view.numel() < _MIN_NUMEL
        or not view.is_contiguous()
    ):
        return None
    kernel = _kernel()
    if not kernel:
        return None
    out_shape = view.shape[1:-1]
    length = view.shape[-1]
    lo = torch.empty(out_shape, dtype=torch.float32)
    hi = torch.empty(out_shape, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), view.numel() // _NUMEL_PER_THREAD))
    bad = kernel(view.data_ptr(), view.numel() // length, length, lo.data_ptr(), hi.data_ptr(), threads)
    return lo, hi, not bad
