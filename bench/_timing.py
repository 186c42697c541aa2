"""Timing helper shared by the bench scripts (run as ``python bench/<script>.py``)."""

import time


def best_time(fn, repeats):
    """Best wall-clock time of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
