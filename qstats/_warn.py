"""`warn`: a warning that points at the user's line that called into qstats."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn`` at the caller of the outermost qstats frame (``qstats.calibrate(...)`` in
    the user's script), however deep in qstats the warning is raised."""
    frame, level, outermost = sys._getframe(1), 2, 2
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            outermost = level
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=outermost + 1)
