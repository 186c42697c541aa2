"""TEMPORARY re-export for qstats/calibrate.py (``runtime_spec``) until it reads
``spec.convention.computes_in_observed_dtype`` and ``qstats.conventions.compressed_tensors``;
the compressed-tensors convention lives in qstats/conventions/compressed_tensors.py."""

from .conventions.compressed_tensors import COMPUTE_NAMES as _COMPUTE_NAMES  # noqa: F401
