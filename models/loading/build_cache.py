"""The generic build-once cache directory: ``build_dir_once`` fills a temporary directory, writes its marker last
and renames it into place, so a directory at its final path is always complete (``is_built``). The GGUF
conversions (``convert.py``) and the model image (``models/image.py``) are built through it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable

from .errors import ModelLoadError, one_line

MARKER = "minibatch-gguf.json"  # written last: a cache directory without it is incomplete


def is_built(out_dir: str) -> bool:
    """Whether ``out_dir`` is a complete cache directory (``build_dir_once`` wrote its marker last)."""
    return os.path.isfile(os.path.join(out_dir, MARKER))


def marker_path(out_dir: str) -> str:
    """The marker file of a cache directory (``build_dir_once`` writes it last; its mtime may record a last use)."""
    return os.path.join(out_dir, MARKER)


def build_dir_once(out_dir: str, fill: Callable[[str], None], marker: dict, failure: str) -> None:
    """Build a cache directory: ``fill(tmp)`` writes its contents into a fresh temporary directory beside
    ``out_dir``, then the marker (``marker`` as JSON) goes in last and the directory is renamed to ``out_dir``
    (atomic: a directory at ``out_dir`` is always complete, ``is_built``). A ``ModelLoadError`` from ``fill``
    passes through; any other failure raises one as "``failure``: its type: its last line". No partial directory
    is left behind."""
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=os.path.dirname(out_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        try:
            fill(tmp)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{failure}: {type(exc).__name__}: {one_line(exc)}") from exc
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_built(out_dir):
                raise
            # another process built the same directory meanwhile: keep its copy
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
