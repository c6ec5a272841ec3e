"""Load errors shared by every step of getting a MODEL_ID's checkpoint: ``ModelLoadError`` and ``one_line``."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """MODEL_ID cannot be served. ``str()`` is one line naming the cause and the way out; ``python server.py``
    prints it and exits."""


def one_line(text) -> str:
    """The last non-blank line of ``text`` (an exception, a child's stderr), stripped: what an error quotes."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
