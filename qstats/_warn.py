"""`warn`: a warning that points at the user's line that called into qstats."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
import typing_extensions

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# torch's modules and hooks, contextlib's managers, and typing_extensions' ``deprecated`` wrapper (torch
# wraps torch.ao's prepare and convert in it) sit between the user's line and qstats
_PASSED_THROUGH = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, contextlib.__file__,
                   typing_extensions.__file__)


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn`` at the caller of the outermost qstats frame (``qstats.calibrate(...)`` in
    the user's script; past torch's module calls and ``contextlib``, which run qstats' hooks and
    context managers for the user), however deep in qstats the warning is raised."""
    files, frame = [], sys._getframe(1)
    while frame is not None:
        files.append(frame.f_code.co_filename)
        frame = frame.f_back
    level = max((index for index, name in enumerate(files) if name.startswith(_PACKAGE)), default=0) + 1
    while level < len(files) and files[level].startswith(_PASSED_THROUGH):
        level += 1
    warnings.warn(message, category, stacklevel=level + 2)
