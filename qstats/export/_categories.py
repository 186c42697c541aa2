"""The warning categories of `qstats.export`, to filter its warnings by
(``warnings.simplefilter("ignore", qstats.export.UnloadedExpertsWarning)``; docs/export.md)."""

from __future__ import annotations

__all__ = ["ExportWarning", "UnloadedExpertsWarning"]


class ExportWarning(UserWarning):
    """A warning of `qstats.export` about the checkpoint it writes (rounded scales, another compute
    dtype than llm-compressor's, experts a loader misreads, ...); the checkpoint is written all the
    same. Modules written unquantized for want of qparams warn a `qstats.UncalibratedWarning` instead.

    >>> import warnings, qstats
    >>> issubclass(qstats.export.ExportWarning, UserWarning)
    True
    """


class UnloadedExpertsWarning(ExportWarning):
    """The checkpoint's unpacked experts are ones transformers' ``from_pretrained`` does not load back into
    the model's 3-D experts (Mixtral, PhiMoE, MiniMax, ...: it leaves them randomly initialised); vLLM and
    compressed-tensors read them. Filter it when the checkpoint is for vLLM.

    >>> import qstats
    >>> issubclass(qstats.export.UnloadedExpertsWarning, qstats.export.ExportWarning)
    True
    """
