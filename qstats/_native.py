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
``minmax.update`` of an unweighted batch (per tensor, plain or stacked) in one read of the data
(``memoryless_minmax.update`` too, the state's values unread); `whole_extremes` is the per-tensor
reduction of `finite_aminmax` (the other min/max observers, `mse`) and of the histogram's extremes
(the same rows over the threads, then the rest).
`symmetric_scales` maps observed ranges onto symmetric scales in one pass (the eager
`compute_qparams` of torch.ao's and compressed-tensors' symmetric specs, the latter in float32 or
in a half weight's arithmetic, where every entry is valid: after a large update
has evicted every cache, each ATen op call costs tens of microseconds); `update_extremes` can map
its new ranges the same way in its own pass and keep the scales for the `compute_qparams` of
that very state (`recall`).
Everything else (masks, other dtypes, non-contiguous views, small tensors, accelerators) keeps
the ATen ops, and so does every machine where the kernel cannot be built (no C++ compiler:
tried once per process, silently).

The kernel is portable C++ (GCC/Clang vector extensions of the target's native width: 16, 8 or 4
float lanes; no intrinsics), compiled with the system's C++ compiler (``$CXX``, arguments
included, else ``c++``, ``g++``, ``clang++``) in a private temporary directory, removed once
the library is loaded, for this machine (``-march=native`` where the compiler takes it), in
about a second on a 2-core machine, on the first use in a process. The build is kept in the
user's cache (``$QSTATS_CACHE_DIR``, else ``~/.cache/qstats``; ``QSTATS_NATIVE_CACHE=0`` turns
that off), named by a hash of the source, the compilers and the CPU, so that later processes
load it in milliseconds (`_cache_file`). It splits rows over ``torch.get_num_threads()``
threads of torch's own OpenMP runtime (one thread in a forked child, where that runtime's pool
is gone), and each thread reads 8 (4 where the target has 16 vector registers) far-apart rows
side by side, each stream asking for its data 1 KB ahead: more memory in flight than one
stream and the hardware prefetchers keep, so the pass takes about three quarters of one ATen
``sum`` over the same data on an Intel Xeon. On AMD processors (a Zen 5, whose prefetchers do
better alone) it reads 2 rows side by side with no software prefetch, level with one ``sum``
(``read_mode`` in the source; the same results either way). Min and max are exact, so the results equal ATen's
``amin``/``amax`` bit for bit (up to the sign of a zero extreme, which no qparam reads; ATen's
own choice between -0.0 and +0.0 depends on the memory layout). ``QSTATS_NATIVE=0`` turns it
off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat as stat_module
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Optional

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.utils import _python_dispatch

from ._torch_features import assume_constant_result

__all__ = ["applies", "available", "row_extremes", "symmetric_scales", "update_extremes", "whole_extremes"]

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <type_traits>

// The widest vector this target computes on natively (a wider GCC vector would be split into
// scalar code on some targets), and how many rows are read at once: one stream of memory per
// row, from far-apart places, keeps more loads in flight than one stream can; a min and a max
// accumulator per stream stay in registers (32 vector registers: 8 streams; 16: 4).
#if defined(__AVX512F__)
#define QS_BYTES 64
#elif defined(__AVX__)
#define QS_BYTES 32
#else
#define QS_BYTES 16
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
#define QS_STREAMS 8
#else
#define QS_STREAMS 4
#endif

typedef float vf __attribute__((vector_size(QS_BYTES)));
typedef uint32_t vu __attribute__((vector_size(QS_BYTES)));
typedef uint16_t vh __attribute__((vector_size(QS_BYTES / 2)));
enum { LANES = QS_BYTES / 4 };

// Loads of LANES values as float32 lanes (exact widening for bfloat16 and float16), and of one.
struct F32 {
  typedef float T;
  static inline vf load(const T* p) { vf v; memcpy(&v, p, sizeof v); return v; }
  static inline float one(const T* p) { return *p; }
};
struct BF16 {
  typedef uint16_t T;
  static inline vf load(const T* p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
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
  static inline vf load(const T* p) {
    vh h16;
    memcpy(&h16, p, sizeof h16);
    const vu h = __builtin_convertvector(h16, vu);
    vu o = (h & 0x7fff) << 13;
    const vu e = o & (0x7c00u << 13);
    o += (127 - 15) << 23;
    o = e == (0x7c00u << 13) ? o + ((128 - 16) << 23) : o;
    const vf renormalised = (vf)(o + (1u << 23)) - (vf)((vu){} + (113u << 23));
    o = e == 0 ? (vu)renormalised : o;
    return (vf)(o | ((h & 0x8000) << 16));
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

// The min / max of a vector's lanes: halve until one lane is left (the lower half's lane on a tie)
typedef float f4 __attribute__((vector_size(16)));
static inline float lanes_min(f4 v) {
  float m = v[0];
  for (int k = 1; k < 4; ++k) m = v[k] < m ? v[k] : m;
  return m;
}
static inline float lanes_max(f4 v) {
  float m = v[0];
  for (int k = 1; k < 4; ++k) m = v[k] > m ? v[k] : m;
  return m;
}
// the lower and the upper half of a vector, as vectors of half its width
template <class H, class V>
static inline void halves(V v, H& low, H& high) {
  memcpy(&low, &v, sizeof low);
  memcpy(&high, (const char*)&v + sizeof low, sizeof high);
}
#if QS_BYTES >= 32
typedef float f8 __attribute__((vector_size(32)));
static inline float lanes_min(f8 v) { f4 a, b; halves(v, a, b); return lanes_min(b < a ? b : a); }
static inline float lanes_max(f8 v) { f4 a, b; halves(v, a, b); return lanes_max(b > a ? b : a); }
#endif
#if QS_BYTES >= 64
typedef float f16 __attribute__((vector_size(64)));
static inline float lanes_min(f16 v) { f8 a, b; halves(v, a, b); return lanes_min(b < a ? b : a); }
static inline float lanes_max(f16 v) { f8 a, b; halves(v, a, b); return lanes_max(b > a ? b : a); }
#endif

// The symmetric scales of n observed ranges, where every entry is valid (calibrated, when
// given, with finite lo <= hi and a range that does not overflow): scale = min(max(-lo, hi) /
// half_range, cap) in float32, then floored at eps (torch.ao; floor_at_eps) or eps where it is 0
// (compressed-tensors) (eps > 0, so the sign of a zero peak never shows), the zero point (int32
// or float32) and calibrated (all true), written from entry `at` of the outputs. With
// round_to (1 bfloat16, 2 float16: compressed-tensors computing in a half weight's dtype, as
// ATen does for those dtypes: each operation in float32, its result rounded to nearest even),
// the peak is capped at cap, rounded, divided by half_range and the quotient rounded; a zero
// scale becomes eps, and an infinite rounded peak is not valid.
// Returns 1 when some entry is not valid (the outputs are then meaningless: the caller takes the
// full path). C: the calibrated mask's element type (unsigned char for a bool mask, int64_t for
// counts: calibrated where positive), or void for none.
struct Scales {
  float half_range, eps, cap;
  int64_t floor_at_eps, round_to;
  float* scale;
  void* zero_point;
  int64_t zero_point_is_float, zero_point_value;
  uint8_t* calibrated;
};

// x (not NaN) rounded to the nearest bfloat16, ties to even (c10::BFloat16's rounding)
static inline float round_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&x, &u, sizeof x);
  return x;
}

// x (0 <= x <= 65504, or -0.0) rounded to the nearest float16 value, ties to even: adding
// 2**(e + 13), e = x's exponent (at least float16's smallest normal one, -14), leaves the sum's
// last place at float16's spacing 2**(e - 10) around x; subtracting it back is exact
static inline float round_f16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  int32_t e = (int32_t)((u >> 23) & 0xffu) - 127;
  e = e < -14 ? -14 : e;
  const uint32_t magic_bits = (uint32_t)(e + 13 + 127) << 23;
  float magic;
  memcpy(&magic, &magic_bits, sizeof magic);
  return (x + magic) - magic;
}

template <class C>
static int symmetric(const float* lo, const float* hi, const void* calibrated, int64_t n, const Scales* p,
                     int64_t at) {
  int bad = 0;  // no branch in the loop, and the numbers in locals (no aliasing): it vectorises
  float* scale = p->scale + at;
  const float half_range = p->half_range, eps = p->eps, cap = p->cap;
  const int floor_at_eps = p->floor_at_eps != 0;
  if (p->round_to == 0) {
    for (int64_t i = 0; i < n; ++i) {
      const float span = hi[i] - lo[i];
      bad |= ((int)(span >= 0.0f) & (int)(span <= FLT_MAX)) ^ 1;
      if constexpr (!std::is_void<C>::value) bad |= ((const C*)calibrated)[i] <= 0;
      const float peak = -lo[i] > hi[i] ? -lo[i] : hi[i];
      float s = peak / half_range;
      s = s > cap ? cap : s;  // eps <= cap: capping first is the same as flooring first
      const float floored = s < eps ? eps : s, zero_to_eps = s == 0.0f ? eps : s;
      scale[i] = floor_at_eps ? floored : zero_to_eps;
    }
  } else {
    const int bf16 = p->round_to == 1;
    for (int64_t i = 0; i < n; ++i) {
      const float span = hi[i] - lo[i];
      bad |= ((int)(span >= 0.0f) & (int)(span <= FLT_MAX)) ^ 1;
      if constexpr (!std::is_void<C>::value) bad |= ((const C*)calibrated)[i] <= 0;
      float peak = -lo[i] > hi[i] ? -lo[i] : hi[i];
      peak = peak > cap ? cap : peak;  // rounding is monotonic: the peak of the rounded extremes
      peak = bf16 ? round_bf16(peak) : round_f16(peak);
      bad |= !(peak <= FLT_MAX);
      float s = peak / half_range;
      s = bf16 ? round_bf16(s) : round_f16(s);
      scale[i] = s == 0.0f ? eps : s;
    }
  }
  memset(p->calibrated + at, 1, (size_t)(n > 0 ? n : 0));
  if (p->zero_point_is_float) {
    float* z = (float*)p->zero_point + at;
    for (int64_t i = 0; i < n; ++i) z[i] = (float)p->zero_point_value;
  } else {
    int32_t* z = (int32_t*)p->zero_point + at;
    for (int64_t i = 0; i < n; ++i) z[i] = (int32_t)p->zero_point_value;
  }
  return bad;
}

// A min/max state to merge the rows' extremes into (see merge); lo null: none, the rows' own
// extremes and counts (memoryless)
struct State {
  const float* lo;
  const float* hi;
  const int64_t* count;
  const int64_t* nonfinite;
  int64_t* count_out;
  int64_t* nonfinite_out;
  int64_t period;  // rows of the state: row r reads the state's row r % period (one state shared by every slice)
  const Scales* scales;  // the merged ranges' symmetric scales too, or null
};

// The S rows first + k * stride + i (k < S, i < n) of x viewed as [rows, len] (contiguous,
// len >= LANES), read side by side: lo[r] / hi[r] are the row's min / max. Returns 1 when a
// value is not finite or a row's range overflows. The first vector initialises the
// accumulators; v - v is 0 for a finite v and NaN otherwise, so one sum of those tells whether
// every value was finite.
template <class L, int S, int PF = 0>
static int extremes(const typename L::T* x, int64_t len, float* lo, float* hi, int64_t first, int64_t stride,
                    int64_t n) {
  vf probe = {};
  float tail_probe = 0.0f;
  int overflow = 0;
  const int64_t body = len - len % LANES;
  for (int64_t i = 0; i < n; ++i) {
    const typename L::T* p[S];
    vf mn[S], mx[S];
    vf sum = {};
    for (int k = 0; k < S; ++k) {
      p[k] = x + (first + k * stride + i) * len;
      mn[k] = mx[k] = L::load(p[k]);
      sum += mn[k] - mn[k];
    }
    for (int64_t j = LANES; j < body; j += LANES) {
      for (int k = 0; k < S; ++k) {
        // each stream asks for its data PF bytes ahead (into every cache level); a prefetch
        // past the end never faults
        if (PF) __builtin_prefetch((const char*)(p[k] + j) + PF, 0, 3);
        const vf a = L::load(p[k] + j);
        sum += a - a;
        mn[k] = a < mn[k] ? a : mn[k];
        mx[k] = a > mx[k] ? a : mx[k];
      }
    }
    probe += sum;
    for (int k = 0; k < S; ++k) {
      float m = lanes_min(mn[k]), M = lanes_max(mx[k]);
      for (int64_t j = body; j < len; ++j) {
        const float v = L::one(p[k] + j);
        tail_probe += v - v;
        m = v < m ? v : m;
        M = v > M ? v : M;
      }
      overflow |= !(M - m <= FLT_MAX);  // an infinite extreme or an overflowing range
      const int64_t r = first + k * stride + i;
      lo[r] = m;
      hi[r] = M;
    }
  }
  int bad = overflow | (tail_probe != 0.0f);
  for (int k = 0; k < LANES; ++k) bad |= probe[k] != 0.0f;
  return bad;
}

// Rows [r0, r1) of lo / hi merged with a state (its min, max, count and non-finite count; row r
// reads the state's row r % s->period): the extremes as torch.minimum / torch.maximum merge them
// in their vector body (the batch's value on a tie, so for -0.0 and +0.0 too; a NaN in the state
// stays), count = the state's + len, nonfinite = the state's. A second, sequential pass over
// these small arrays while the rows' extremes are still in cache (merged in the row pass, the
// state's eight arrays were as many more memory streams, a few bytes per row: slower). Without a
// state (s->lo null), count = len and nonfinite = 0. With s->scales, the merged ranges'
// symmetric scales too (calibrated by the new counts); returns 1 when some entry is not valid
// for them.
static int merge(const State* s, float* lo, float* hi, int64_t len, int64_t r0, int64_t r1) {
  int bad = 0;
  if (!s->lo) {
    for (int64_t r = r0; r < r1; ++r) {
      s->count_out[r] = len;
      s->nonfinite_out[r] = 0;
    }
    if (s->scales) bad |= symmetric<int64_t>(lo + r0, hi + r0, s->count_out + r0, r1 - r0, s->scales, r0);
    return bad;
  }
  for (int64_t r = r0; r < r1;) {
    const int64_t q = r % s->period, n = r1 - r < s->period - q ? r1 - r : s->period - q;
    const float* state_lo = s->lo + q;
    const float* state_hi = s->hi + q;
    const int64_t* count = s->count + q;
    const int64_t* nonfinite = s->nonfinite + q;
    float* l = lo + r;
    float* h = hi + r;
    int64_t* count_out = s->count_out + r;
    int64_t* nonfinite_out = s->nonfinite_out + r;
    for (int64_t i = 0; i < n; ++i) {
      l[i] = l[i] <= state_lo[i] ? l[i] : state_lo[i];
      h[i] = h[i] >= state_hi[i] ? h[i] : state_hi[i];
      count_out[i] = count[i] + len;
      nonfinite_out[i] = nonfinite[i];
    }
    if (s->scales) bad |= symmetric<int64_t>(l, h, count_out, n, s->scales, r);
    r += n;
  }
  return bad;
}

// How rows are read (the results are the same either way; only the speed differs): 1, QS_STREAMS
// far-apart streams each asking for its data 1 KB ahead (on an Intel Xeon, 10-25% faster than
// the hardware prefetchers alone, and more streams keep more loads in flight); 2, two streams
// and no software prefetch (on an AMD Zen 5, whose prefetchers do better alone: 1.3x-1.4x faster
// than the first way there, as fast as one ATen sum). 0 (default): the second on AMD processors,
// the first elsewhere; qstats_read_mode sets it (tests).
static int qs_read_mode = 0;  // read and written atomically: set while other threads read rows

#if defined(__has_builtin)
#if __has_builtin(__builtin_cpu_is) && (defined(__x86_64__) || defined(__i386__))
#define QS_VENDOR_CHECK 1
#endif
#endif

static int read_mode() {
  const int forced = __atomic_load_n(&qs_read_mode, __ATOMIC_RELAXED);
  if (forced) return forced;
#ifdef QS_VENDOR_CHECK
  static const int mode = (__builtin_cpu_init(), __builtin_cpu_is("amd")) ? 2 : 1;
  return mode;
#else
  return 1;
#endif
}

template <class L, int S, int PF>
static int streams(const typename L::T* x, int64_t len, float* lo, float* hi, int64_t r0, int64_t r1) {
  const int64_t per_stream = (r1 - r0) / S;
  int bad = 0;
  if (per_stream > 0) bad |= extremes<L, S, PF>(x, len, lo, hi, r0, per_stream, per_stream);
  const int64_t rest = r0 + per_stream * S;
  if (rest < r1) bad |= extremes<L, 1, PF>(x, len, lo, hi, rest, 0, r1 - rest);
  return bad;
}

// Rows [r0, r1): far-apart streams over the bulk, one row at a time for the rest (read_mode);
// then, with a state, the merge (the whole update of a min/max state by the rows). Returns 1
// when a value is not finite or a range overflows, else 2 when the scales asked for are not
// valid, else 0.
template <class L>
static int range(const typename L::T* x, int64_t len, float* lo, float* hi, int64_t r0, int64_t r1,
                 const State* s) {
  int bad = read_mode() == 2 ? streams<L, 2, 0>(x, len, lo, hi, r0, r1)
                             : streams<L, QS_STREAMS, 1024>(x, len, lo, hi, r0, r1);
  if (s && !bad && merge(s, lo, hi, len, r0, r1)) bad = 2;
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
      if (r0 < r1) bad |= range<L>(x, len, lo, hi, r0, r1, s);
    }
    return bad;
  }
#endif
  return range<L>(x, len, lo, hi, 0, rows, s);
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

// The same, merged into a min/max state (see State; state_lo null: the rows' own extremes, count
// len and nonfinite 0, the other state arrays unread); the outputs are only meaningful when the
// result is 0 (a flagged input leaves them partly written: the caller takes the full path).
// With a scale output (not null), the merged ranges' symmetric scales too (see symmetric:
// calibrated where the new count is positive) and n_ones global scales of 1; a result of 2
// says that the update is done but some entry is not valid for the scales.
extern "C" int qstats_update_extremes(const void* x, int64_t kind, int64_t rows, int64_t len,
                                      const float* state_lo, const float* state_hi,
                                      const int64_t* state_count, const int64_t* state_nonfinite,
                                      float* lo, float* hi, int64_t* count, int64_t* nonfinite,
                                      int64_t state_rows, int64_t threads, float half_range, float eps,
                                      float cap, int64_t floor_at_eps, int64_t round_to, float* scale,
                                      void* zero_point, int64_t zero_point_is_float, int64_t zero_point_value,
                                      uint8_t* calibrated, float* ones, int64_t n_ones) {
  const Scales p = {half_range, eps, cap, floor_at_eps, round_to, scale, zero_point, zero_point_is_float,
                    zero_point_value, calibrated};
  const State s = {state_lo, state_hi, state_count, state_nonfinite, count, nonfinite, state_rows,
                   scale ? &p : nullptr};
  for (int64_t i = 0; i < n_ones; ++i) ones[i] = 1.0f;
  return dispatch(x, kind, rows, len, lo, hi, threads, &s);
}

// Both extremes of all n values of x (contiguous): rows of WHOLE_ROW values through the row
// pass (its streams and threads) into a scratch buffer, then the rest, then the rows' extremes.
// Returns 1 when a value is not finite, the range overflows or the scratch cannot be allocated.
enum { WHOLE_ROW = 4096 };

template <class L>
static int whole(const void* data, int64_t n, int64_t threads, float* m_out, float* M_out) {
  const typename L::T* x = (const typename L::T*)data;
  const int64_t rows = n / WHOLE_ROW, rest = n - rows * WHOLE_ROW;
  float m = 0.0f, M = 0.0f;
  int bad = 0, seen = 0;
  if (rows > 0) {
    float* scratch = (float*)malloc(2 * rows * sizeof(float));
    if (!scratch) return 1;
    bad |= split<L>(x, rows, WHOLE_ROW, scratch, scratch + rows, threads, nullptr);
    m = scratch[0];
    M = scratch[rows];
    for (int64_t r = 1; r < rows; ++r) {
      m = scratch[r] < m ? scratch[r] : m;
      M = scratch[rows + r] > M ? scratch[rows + r] : M;
    }
    free(scratch);
    seen = 1;
  }
  if (rest >= LANES) {
    float tm, tM;
    bad |= extremes<L, 1>(x + rows * WHOLE_ROW, rest, &tm, &tM, 0, 0, 1);
    m = !seen || tm < m ? tm : m;
    M = !seen || tM > M ? tM : M;
  } else {
    float probe = 0.0f;
    for (int64_t j = rows * WHOLE_ROW; j < n; ++j, seen = 1) {
      const float v = L::one(x + j);
      probe += v - v;
      m = !seen || v < m ? v : m;
      M = !seen || v > M ? v : M;
    }
    bad |= probe != 0.0f;
  }
  bad |= !(M - m <= FLT_MAX);
  *m_out = m;
  *M_out = M;
  return bad;
}

// Sets how rows are read (see read_mode: 0 by the processor, 1 or 2); returns the way now taken.
extern "C" int qstats_read_mode(int64_t mode) {
  if (mode >= 0 && mode <= 2) __atomic_store_n(&qs_read_mode, (int)mode, __ATOMIC_RELAXED);
  return read_mode();
}

// Both extremes of all n values of x (contiguous) in one pass (see whole): lo[0] and hi[0].
// Returns 1 when flagged (as whole), -1 for an unknown kind.
extern "C" int qstats_whole_extremes(const void* x, int64_t kind, int64_t n, int64_t threads, float* lo, float* hi) {
  if (kind == 0) return whole<F32>(x, n, threads, lo, hi);
  if (kind == 1) return whole<BF16>(x, n, threads, lo, hi);
  if (kind == 2) return whole<F16>(x, n, threads, lo, hi);
  return -1;
}

// The whole update of a per-tensor min/max state (0-dim fields) by n values: the extremes merged
// as torch.minimum / torch.maximum merge one element (the state's value on a tie; a NaN in the
// state stays), the count plus n, the non-finite count kept. Returns 1 when flagged (as whole),
// -1 for an unknown kind.
extern "C" int qstats_update_whole(const void* x, int64_t kind, int64_t n, const float* state_lo,
                                   const float* state_hi, const int64_t* state_count,
                                   const int64_t* state_nonfinite, float* lo, float* hi, int64_t* count,
                                   int64_t* nonfinite, int64_t threads) {
  float m, M;
  const int bad = qstats_whole_extremes(x, kind, n, threads, &m, &M);
  if (bad) return bad;
  *lo = m < *state_lo ? m : *state_lo;
  *hi = M > *state_hi ? M : *state_hi;
  *count = *state_count + n;
  *nonfinite = *state_nonfinite;
  return 0;
}

// The symmetric scales of n observed ranges in one pass (see symmetric); returns 1, the outputs
// meaningless, when some entry is not valid: the caller takes the full path.
// calibrated_kind: 0 none, 1 a bool mask, 2 int64 counts; ones: n_ones global scales of 1
extern "C" int qstats_symmetric_scales(const float* lo, const float* hi, const void* calibrated,
                                       int64_t calibrated_kind, int64_t n, float half_range, float eps,
                                       float cap, int64_t floor_at_eps, int64_t round_to, float* scale,
                                       void* zero_point, int64_t zero_point_is_float, int64_t zero_point_value,
                                       uint8_t* calibrated_out, float* ones, int64_t n_ones) {
  const Scales p = {half_range, eps, cap, floor_at_eps, round_to, scale, zero_point, zero_point_is_float,
                    zero_point_value, calibrated_out};
  for (int64_t i = 0; i < n_ones; ++i) ones[i] = 1.0f;
  if (calibrated_kind == 1) return symmetric<unsigned char>(lo, hi, calibrated, n, &p, 0);
  if (calibrated_kind == 2) return symmetric<int64_t>(lo, hi, calibrated, n, &p, 0);
  return symmetric<void>(lo, hi, calibrated, n, &p, 0);
}
"""

# Below this many values the two ATen reductions cost about as much as the call (and the data
# stays in cache, where a second pass is cheap); below this many per thread, no extra thread.
_MIN_NUMEL = 1 << 16
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NUMEL_PER_THREAD = 1 << 18
_CALIBRATED_KINDS = {torch.bool: 1, torch.int64: 2}

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
    """The compiler commands to try, each a list: ``$CXX`` first (a command with arguments, as
    ``ccache g++`` or ``g++ -m64``, split as a shell would), then ``c++``, ``g++``, ``clang++``."""
    seen = []
    try:
        cxx = shlex.split(os.environ.get("CXX", ""))
    except ValueError:  # unbalanced quotes: not a command
        cxx = []
    for command in (cxx, ["c++"], ["g++"], ["clang++"]):
        path = shutil.which(command[0]) if command else None
        if path and [path, *command[1:]] not in seen:
            seen.append([path, *command[1:]])
    return seen


def _build():
    if os.environ.get("QSTATS_NATIVE", "1") == "0":
        return False
    compilers = _compilers()
    cached = _cache_file(compilers)
    if cached is not None:
        loaded = _load_cached(cached)
        if loaded:
            return loaded
    try:
        directory = tempfile.mkdtemp(prefix="qstats-native-")
    except OSError:  # no writable temporary directory: ATen's reductions
        return False
    try:
        return _compile_and_load(directory, keep=cached)
    except OSError:
        return False
    finally:
        # the loaded library stays mapped; nothing is left behind, even if the process crashes
        shutil.rmtree(directory, ignore_errors=True)


# the compiler flags tried in turn: this machine's vector width and torch's OpenMP runtime first
_FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())


def _cache_file(compilers) -> Optional[str]:
    """Where this machine's build of the kernel is kept between processes: a file named by a
    hash of everything the build depends on (the source, the flag sets, the compilers with their
    files' size and time, the CPU's model and flags, as ``-march=native`` builds for them), in
    ``$QSTATS_CACHE_DIR``, else ``$XDG_CACHE_HOME/qstats``, else ``~/.cache/qstats``, a directory
    of this user's that nobody else may write. None without such a directory, on a system
    without user ids, or with ``QSTATS_NATIVE_CACHE=0``: every process then builds its own."""
    if os.environ.get("QSTATS_NATIVE_CACHE", "1") == "0" or not hasattr(os, "getuid") or not compilers:
        return None
    root = os.environ.get("QSTATS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "qstats"
    )
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        # every later step goes through the resolved path: a link on the way (a trailing "/",
        # ~/.cache on another disk) is followed once, here, and the place it leads to is checked
        root = os.path.realpath(root)
        if not _private_directory(root):
            return None  # another user could put code there: not a place to load it from
        identity = [_SOURCE, repr(_FLAG_SETS), platform.machine(), sys.platform, _cpu_identity()]
        for command in compilers:
            stat = os.stat(command[0])
            identity.append(repr((command, stat.st_size, stat.st_mtime_ns)))
    except OSError:
        return None
    digest = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:32]
    return os.path.join(root, f"native-{digest}.so")


def _private_directory(root: str) -> bool:
    """Whether nobody but this user (and the superuser) can change what ``root`` (a resolved
    path: no symbolic link on it) holds: ``root`` itself a directory, this user's and writable by
    nobody else, and each directory above it the superuser's or this user's and writable by
    nobody else or sticky (as ``/tmp``: others cannot rename or remove what they do not own
    there). A group-writable home directory, or one owned by another user id (some containers),
    fails this: each process then builds its own kernel; ``QSTATS_CACHE_DIR`` names another."""
    uid = os.getuid()
    status = os.lstat(root)
    if not stat_module.S_ISDIR(status.st_mode) or status.st_uid != uid or status.st_mode & 0o022:
        return False
    parent = os.path.dirname(root)
    while True:
        status = os.stat(parent)
        if status.st_uid not in (0, uid):
            return False
        if status.st_mode & 0o022 and not status.st_mode & stat_module.S_ISVTX:
            return False
        above = os.path.dirname(parent)
        if above == parent:
            return True
        parent = above


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f.read().splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


def _load_cached(path: str):
    """The kernel from a kept build, or None (none kept, or one that does not load: removed). The
    file is opened without following links and must be a plain file of this user's that nobody
    else may write (its directory passed `_private_directory`, so nobody else can replace it
    between this check and the load)."""
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        status = os.fstat(handle)
        if not stat_module.S_ISREG(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o022:
            return None
        try:
            return _bind(ctypes.CDLL(path))
        except (OSError, AttributeError):
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
    finally:
        os.close(handle)


def _keep(target: str, path: str) -> None:
    """Copies a fresh build to ``path`` for later processes, atomically (a process loading it
    meanwhile sees the old file or the new one, never a part); silently nothing where it fails."""
    try:
        handle, partial = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partial-", suffix=".so")
        try:
            with os.fdopen(handle, "wb") as out, open(target, "rb") as source:
                shutil.copyfileobj(source, out)
            os.replace(partial, path)
        except OSError:
            os.unlink(partial)
    except OSError:
        pass


def _compile_and_load(directory, flag_sets=_FLAG_SETS, keep: Optional[str] = None):
    source = os.path.join(directory, "row_extremes.cpp")
    with open(source, "w") as f:
        f.write(_SOURCE)
    target = os.path.join(directory, "row_extremes.so")
    base = ["-O3", "-std=c++17", "-shared", "-fPIC", source, "-o", target]
    for compiler in _compilers():
        # a build with fewer flags is kept for later processes only where this compiler refused
        # the better flags, not where a build of them was killed (out of memory: the driver
        # reports its killed cc1plus or clang frontend and exits 1): a passing failure must not
        # make every later process run the slower kernel
        accidental = False
        for flags in flag_sets:
            try:
                done = subprocess.run([*compiler, *flags, *base], capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):  # it does not run, or hangs: the next compiler
                break
            if done.returncode == 0:
                try:
                    library = ctypes.CDLL(target)
                except OSError:
                    break
                bound = _bind(library)
                if keep is not None and not accidental:
                    _keep(target, keep)
                return bound
            if done.returncode < 0 or _killed(done.stderr):
                accidental = True
    return False


def _killed(stderr: bytes) -> bool:
    """Whether a compiler's error output says that it, or a program it ran, was killed or crashed
    (GCC: "Killed signal terminated program cc1plus", "internal compiler error"; clang: "unable
    to execute command: Killed", "frontend command failed due to signal") rather than refused
    the source or its flags."""
    text = stderr.decode(errors="replace").lower()
    return any(sign in text for sign in ("killed", "signal", "internal compiler error"))


def _bind(library):
    """The kernel's entry points in ``library``, with their C signatures."""
    extremes = library.qstats_row_extremes
    extremes.restype = ctypes.c_int
    extremes.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 2, ctypes.c_int64]
    update = library.qstats_update_extremes
    update.restype = ctypes.c_int
    update.argtypes = [
        ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 8, *[ctypes.c_int64] * 2,
        *[ctypes.c_float] * 3, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 2,
        *[ctypes.c_void_p] * 2, ctypes.c_int64,
    ]
    scales = library.qstats_symmetric_scales
    scales.restype = ctypes.c_int
    scales.argtypes = [
        *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 2, *[ctypes.c_float] * 3, *[ctypes.c_int64] * 2,
        *[ctypes.c_void_p] * 2, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64,
    ]
    whole = library.qstats_update_whole
    whole.restype = ctypes.c_int
    whole.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 8, ctypes.c_int64]
    whole_extremes = library.qstats_whole_extremes
    whole_extremes.restype = ctypes.c_int
    whole_extremes.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 2]
    read_mode = library.qstats_read_mode
    read_mode.restype = ctypes.c_int
    read_mode.argtypes = [ctypes.c_int64]
    return extremes, update, scales, whole, whole_extremes, read_mode


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
        and view.shape[-1] >= 16
        and _readable(view, numel)
    )


def _readable(view: torch.Tensor, numel: Optional[int] = None) -> bool:
    """Whether the kernel reads ``view`` (one observation, a dtype it knows, contiguous plain CPU
    memory that nothing intercepts, large enough to pay for the call) on a machine with the
    kernel; `applies` and the per-tensor update add their shape's conditions."""
    if not (
        view.shape[0] == 1
        and view.dtype in _KINDS
        and view.device.type == "cpu"
        and (view.numel() if numel is None else numel) >= _MIN_NUMEL
        and view.is_contiguous()
    ):
        return False
    if torch.compiler.is_compiling():
        return available()  # when tracing, the op's implementation asks again of the real tensor
    return type(view) is torch.Tensor and _plain_memory(view) and _nothing_intercepts() and _built()


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are its memory as it is: no negative bit, no zero tensor (no
    memory at all), no functionalization or functorch wrapper (whose data pointer is not the
    values'). Fake tensors under ``torch.compile`` pass (their real counterparts are checked
    again at run time)."""
    return not (
        t.is_neg()
        or t._is_zerotensor()
        or torch._is_functional_tensor(t)
        or torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _nothing_intercepts() -> bool:
    """Whether the ops around a kernel call run as they are: no dispatch mode (fake tensors,
    ``make_fx``, a user's mode) and no ``torch.jit.trace``. These see the output allocations but
    not the kernel's writes: fake outputs have no memory to write, and a trace would replay
    empty tensors."""
    return torch._C._get_tracing_state() is None and _python_dispatch._get_current_dispatch_mode() is None


try:  # the one transform `vmap_slices` unwraps (private functorch API: ATen where it moved)
    from torch._C._functorch import TransformType as _TransformType

    _VMAP = _TransformType.Vmap
    torch._C._functorch.get_dynamic_layer_stack_depth
    torch._C._functorch.peek_interpreter_stack
except (ImportError, AttributeError):  # pragma: no cover
    _VMAP = None


def vmap_slices(tensors, batch_dims=None, repeat_shared: bool = True):
    """Under one ``torch.vmap`` and no other function transform (eager), the tensors every slice
    together: ``(level, dense)``, where ``dense[i]`` holds ``tensors[i]``'s slices stacked at
    ``batch_dims[i]`` (default 0; a tensor shared by every slice repeated, or left as it is
    without ``repeat_shared``), contiguous, plain memory (an ``nn.Parameter`` stays one: the
    passes' own field checks refuse it), and `rebatch` wraps results back. None elsewhere
    (nested or other transforms, compiling, nothing batched). The native passes take every slice
    in one call this way, without the per-call cost of a custom op's vmap rule (several hundred
    microseconds)."""
    functorch = torch._C._functorch
    if _VMAP is None or functorch.get_dynamic_layer_stack_depth() != 1 or torch.compiler.is_compiling():
        return None
    interpreter = functorch.peek_interpreter_stack()
    if interpreter.key() != _VMAP:
        return None
    level = interpreter.level()
    unwrapped = []
    for t in tensors:
        if functorch.is_batchedtensor(t):
            t, dim = functorch._unwrap_batched(t, level)
        else:
            dim = None
        # a module's parameter is its values (as for the plain update); other subclasses may not be
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or functorch.is_functorch_wrapped_tensor(t):
            return None
        unwrapped.append((t, dim))
    sizes = {t.shape[dim] for t, dim in unwrapped if dim is not None}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    dense = []
    for (t, dim), at in zip(unwrapped, batch_dims or [0] * len(unwrapped)):
        if dim is not None:
            t = t if dim == at else t.movedim(dim, at)
        elif repeat_shared:
            t = t.unsqueeze(at).expand(*t.shape[:at], size, *t.shape[at:])
        dense.append(t.contiguous())
    return level, dense


def rebatch(tensors, level: int):
    """Results of every slice together (the slices along dim 0) as batched tensors of ``level``
    (`vmap_slices`)."""
    return tuple(torch._C._functorch._add_batch_dim(t, 0, level) for t in tensors)


def available() -> bool:
    """Whether this machine has the kernel (builds it on the first call)."""
    return bool(_kernel())


def _built() -> bool:
    """`available` for eager code: without the compiler's wrapper, whose call costs tens of
    microseconds where a large pass has left the caches cold."""
    return bool(_library if _library is not None else _kernel())


# a constant for torch.compile, which cannot trace the build or the ctypes handle
available = assume_constant_result(available)


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


def whole_extremes(view: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, bool]]:
    """Min and max of every value of a view ``(1, N)`` in one pass, as 0-dim float32 tensors,
    with ``True`` when every value and the range are finite (the per-tensor reduction: ATen's
    ``aminmax`` over all values is slower than the row pass, which reads rows of 4096 values side
    by side over the threads). None where the kernel does not read the view (`_readable`) or where
    this machine has no kernel."""
    if not _readable(view):
        return None
    lo = view.new_empty((), dtype=torch.float32)
    hi = view.new_empty((), dtype=torch.float32)
    bad = _kernel()[4](view.data_ptr(), _KINDS[view.dtype], view.numel(), _threads(view), lo.data_ptr(), hi.data_ptr())
    if bad < 0:
        raise AssertionError(f"qstats: the native kernel does not know dtype {view.dtype}")
    return lo, hi, not bad


def _threads(view: torch.Tensor) -> int:
    return 1 if _forked else max(1, min(torch.get_num_threads(), view.numel() // _NUMEL_PER_THREAD))


_STATE_DTYPES = (torch.float32, torch.float32, torch.int64, torch.int64)


def _standard_fields(fields, shape, dtypes=_STATE_DTYPES) -> bool:
    """Tensors of ``dtypes`` (by default a min/max state's: float32 extremes, int64 counts),
    contiguous, on the CPU, all of ``shape``, plain memory, no autograd (a field's gradient or
    forward-AD tangent is the full path's to carry)."""
    dual = _forward_ad._current_level >= 0  # tangents exist only inside a dual level
    for t, dtype in zip(fields, dtypes):
        if not (
            type(t) is torch.Tensor
            and t.dtype == dtype
            and t.is_cpu
            and t.shape == shape
            and t.is_contiguous()
            and not t.requires_grad
            and _plain_memory(t)
        ) or (dual and _forward_ad.unpack_dual(t).tangent is not None):
            return False
    return True


def update_extremes(view: torch.Tensor, lo, hi, count, nonfinite, wrap=None, scales=None, forget=False):
    """A min/max state's whole update by an unmasked ``view`` in one pass: the new
    ``(min, max, count, nonfinite)``, fresh tensors, equal to merging `row_extremes` and the
    view's counts into the given fields with torch.minimum, torch.maximum and additions (a
    per-tensor view ``(1, N)`` with 0-dim fields: all N values, `_update_whole`). Fields of the
    parameter shape without its first dim are one state shared by every slice of that dim (the
    state of every slice under ``vmap`` right after init), merged as if repeated.

    Returns None where the kernel does not apply (as `row_extremes`, or fields other than
    float32 extremes and int64 counts of the parameter shape, contiguous, on the CPU) or where
    some value is not finite or some range overflows: the caller then takes the full path.
    ``wrap``: applied to the output tensors before the pass writes them (`rebatch` under vmap),
    its result returned: after a large pass every cache is cold, and each call costs more.

    ``scales``: ``(numbers, ones_shape, spec)``, `symmetric_scales`' numbers ``(half_range, eps,
    cap, zero_point, zero_point_dtype, floor_at_eps, round_to)`` for the observer's ``spec`` (`qstats._qparams.native_scales`:
    an eps above 0 in float32, an int32 or float32 zero point) and the global scale's shape, or
    None. For rows of ``_SCALES_MIN_LENGTH`` values or more (a few bytes per row written:
    most updates' scales go unread) outside inference mode, the same pass then also maps the
    new ranges onto those scales (calibrated by the new counts) and keeps them for `recall`:
    the ``compute_qparams`` that usually follows the update finds them instead of running its
    own pass over cold memory.

    ``forget``: the view's own extremes and counts (``count`` its row length, ``nonfinite`` 0), the
    state's values unread (``memoryless_minmax``; the fields still say the shape and kinds of the
    state). Not per tensor (None there: the reduction's own `whole_extremes` is that one pass).
    """
    shape = tuple(view.shape[1:-1])
    fields = (lo, hi, count, nonfinite)
    if shape == () and view.ndim == 2:
        return None if forget else _update_whole(view, fields)
    if not applies(view):
        return None
    state_shape = shape if tuple(lo.shape) == shape else shape[1:]
    if not _standard_fields(fields, state_shape):
        return None
    length = view.shape[-1]
    out = [view.new_empty(shape, dtype=t.dtype) for t in fields]
    if torch._C._functorch.is_functorch_wrapped_tensor(out[0]):
        return None  # a transform (grad, jvp) wraps what is made under it: no memory to write
    if scales is not None and not (
        # a few bytes per row: not worth writing for short rows (most updates' scales go unread)
        length >= _SCALES_MIN_LENGTH
        and not out[0].is_inference()  # no version counter tells whether the fields change
    ):
        scales = None
    if scales is None:
        mapped, numbers = [], (0.0, 0.0, 0.0, 0, 0, None, None, 0, 0, None, None, 0)  # no scales
    else:
        mapped, numbers = _scale_outputs(view, shape, scales[0], scales[1])  # plain, as out[0] is
    # one wrap for every output (the global scale stays as it is, unbatched under vmap)
    wrapped = tuple(out + mapped[:3]) if wrap is None else wrap(out + mapped[:3])
    pointers = [t.data_ptr() for t in out]
    bad = _kernel()[1](
        view.data_ptr(), _KINDS[view.dtype], view.numel() // length, length,
        *((None,) * 4 if forget else (t.data_ptr() for t in fields)), *pointers, max(1, lo.numel()),
        _threads(view), *numbers,
    )
    if bad & 1:
        return None
    result = wrapped[:4]
    if scales is not None and not bad:
        _remember(result, out, pointers, scales, (*wrapped[4:], mapped[3]))
    return result


# The scales of each thread's latest update pass (`recall`), by thread: weak references to the
# fields it returned (the entry goes when its min_val does), the dense fields under vmap (a
# batched field's own version counter does not move), their data pointers, the numbers, ones
# shape and spec of the scales, and the scales themselves.
_recent: dict = {}
_SCALES_MIN_LENGTH = 256


def _remember(result, dense, pointers, scales, outputs):
    thread = threading.get_ident()

    def forget(ref):
        if _recent.get(thread, (None,))[0] is ref:
            _recent.pop(thread, None)

    plain = result[0] is dense[0]
    refs = (weakref.ref(result[0], forget), weakref.ref(result[1]), weakref.ref(result[2]))
    # fresh tensors: version 0 (the pass's writes do not count); the scales are nobody's yet
    _recent[thread] = (*refs, None if plain else dense[:3], pointers[:3], *scales, outputs)


def recall(min_val, max_val, count, ones_shape, numbers=None, spec=None):
    """The ``(scale, zero_point, calibrated, ones)`` that the latest `update_extremes` of this
    thread computed for the same global scale shape and the same ``numbers`` (`symmetric_scales`'
    numbers) or the very ``spec`` it was given, where ``min_val``, ``max_val`` and ``count`` are
    the very fields it returned, unchanged since (no in-place op, ``.data`` swap or
    ``requires_grad_``), and no mode intercepts ops: exactly what `symmetric_scales` (or, inside
    any transform, ATen's ops) would compute from them. Each result is returned once (a second
    caller gets fresh tensors from a pass); None otherwise.

    A write that bypasses the version counter (into ``t.data`` or ``t.numpy()``, as autograd
    does not see either) between the update and this call is not seen: states are values, and
    such a write changes one behind every reader's back."""
    if torch.compiler.is_compiling():
        return None  # a graph computes its own
    last = _recent.get(threading.get_ident())
    if last is None:
        return None
    lo, hi, counts, dense, pointers, kept_numbers, kept_ones_shape, kept_spec, outputs = last
    if not (
        min_val is lo()
        and max_val is hi()
        and count is counts()
        and tuple(ones_shape) == kept_ones_shape
        and (spec is kept_spec if spec is not None else numbers == kept_numbers)
    ):
        return None
    del _recent[threading.get_ident()]
    if (
        min_val.requires_grad
        or max_val.requires_grad
        or not _nothing_intercepts()
        or any(t._version or t.data_ptr() != p for t, p in zip(dense or (min_val, max_val, count), pointers))
    ):
        return None
    return outputs


def symmetric_scales(min_val, max_val, calibrated, half_range: float, eps: float, cap: float, zero_point: int,
                     zero_point_dtype: torch.dtype, floor_at_eps: bool = True, round_to: int = 0, ones_shape=()):
    """``(scale, zero_point, calibrated, ones)`` of a symmetric mapping over observed ranges, in
    one pass: ``min(max(-min, max) / half_range, cap)`` in float32 arithmetic (``half_range``,
    ``eps`` and ``cap`` rounded to float32 first, as ATen rounds a scalar operand of a float32
    tensor), floored at ``eps`` (torch.ao; ``floor_at_eps``) or ``eps`` where it is 0
    (compressed-tensors). ``round_to`` 1 (bfloat16) or 2 (float16): compressed-tensors' arithmetic
    in that dtype, as ATen computes it (each result rounded to it, nearest even): the peak capped
    at ``cap``, rounded, divided by ``half_range``, the quotient rounded, ``eps`` where it is 0.
    ``zero_point`` everywhere, every entry calibrated and float32 ones of
    ``ones_shape`` (the global scale; written by the pass, so that every output comes from one
    kind of op call: after a large pass each new kind of call costs tens of microseconds); fresh
    tensors. ``calibrated``: a bool mask, int64 counts (calibrated where positive) or None.

    Returns None where the kernel does not apply (not float32 extremes of one shape, contiguous
    plain CPU memory, ``calibrated`` of that shape, ``eps`` > 0 in float32, a zero point dtype
    other than int32 or float32, no kernel) or where some entry is not valid (uncalibrated,
    ``min > max``, a non-finite extreme or an overflowing range): the caller then takes the full
    path.
    """
    shape = tuple(min_val.shape)
    fields = (min_val, max_val) if calibrated is None else (min_val, max_val, calibrated)
    calibrated_kind = 0 if calibrated is None else _CALIBRATED_KINDS.get(calibrated.dtype)
    if not (
        zero_point_dtype in (torch.int32, torch.float32)
        and calibrated_kind is not None
        and eps > 2.0**-150  # > 0 in float32 (2**-150 and below round to 0)
        and _nothing_intercepts()
        and _standard_fields(fields, shape, (torch.float32, torch.float32, calibrated_kind and calibrated.dtype))
        and _built()
    ):
        return None
    numbers = (half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, round_to)
    made = _scale_outputs(min_val, shape, numbers, ones_shape)
    if made is None:
        return None
    outputs, numbers = made
    bad = _kernel()[2](
        min_val.data_ptr(), max_val.data_ptr(), None if calibrated is None else calibrated.data_ptr(),
        calibrated_kind, min_val.numel(), *numbers,
    )
    return None if bad else tuple(outputs)


def _scale_outputs(like: torch.Tensor, shape, numbers, ones_shape):
    """Fresh outputs of a symmetric scales pass, ``[scale, zero_point, calibrated, ones]``
    (float32, the zero point's dtype and bool of ``shape``; float32 ones of ``ones_shape``, the
    global scale), made like ``like``, and the kernel's arguments for ``numbers``
    (`symmetric_scales`' ``(half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, round_to)``) and these
    outputs, in the order both of its entry points take them (the C struct ``Scales``). None where
    a transform (grad, jvp) wraps what is made under it: no memory to write."""
    half_range, eps, cap, zero_point, zero_point_dtype, floor_at_eps, round_to = numbers
    outputs = [like.new_empty(shape, dtype=dtype) for dtype in (torch.float32, zero_point_dtype, torch.bool)]
    if torch._C._functorch.is_functorch_wrapped_tensor(outputs[0]):
        return None
    outputs.append(like.new_empty(ones_shape, dtype=torch.float32))
    scale, zero_points, calibrated, ones = outputs
    return outputs, (
        half_range, eps, cap, int(floor_at_eps), round_to, scale.data_ptr(), zero_points.data_ptr(),
        int(zero_point_dtype == torch.float32), zero_point, calibrated.data_ptr(), ones.data_ptr(), ones.numel(),
    )


def _update_whole(view: torch.Tensor, fields):
    """`update_extremes` of a per-tensor state (0-dim fields) by a view ``(1, N)``: one pass over
    all N values (rows of the row pass, split over the threads), merged as torch.minimum and
    torch.maximum merge one element."""
    # eager only (`update_extremes`' callers): `_readable` checks the real tensor
    if not (_readable(view) and _standard_fields(fields, ())):
        return None
    out = [view.new_empty((), dtype=t.dtype) for t in fields]
    bad = _kernel()[3](
        view.data_ptr(), _KINDS[view.dtype], view.numel(), *(t.data_ptr() for t in fields),
        *(t.data_ptr() for t in out), _threads(view),
    )
    return None if bad else tuple(out)
