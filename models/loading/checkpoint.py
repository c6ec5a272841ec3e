"""(tokenizer, model) for any MODEL_ID: ``load_checkpoint``; the checkpoint's EOS set: ``eos_ids``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from . import convert
from .errors import ModelLoadError, one_line
from .model_id import OFFLINE_HINT, alias_path, gguf_path, is_gguf, resolve_model_id


def load_checkpoint(model_id: str, weights: str = "fp32", in_process: bool = False):
    """(tokenizer, HF causal-LM in fp32, eval mode) for a hub id, a local directory or a ``.gguf`` file.

    A ``.gguf`` file comes back as a ``models.gguf_model.GGUFModel``: config and tokenizer from its metadata
    directory (``convert.gguf_metadata_dir``), weights read from the file itself at the precision ``weights`` asks
    for (its own quantization under "auto", gguf-py's dequantized values under "fp32"), no HF model in memory.
    ``in_process``: its tokenizer and config are converted in this process, not in a child.
    """
    model_id = alias_path(model_id)  # an alias is its fetched .gguf file from here on
    if is_gguf(model_id):
        return load_gguf(model_id, weights, in_process)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_id(model_id)
    with load_errors(path):  # a hub id that cannot load -> an error naming the offline way
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return tokenizer, model.eval()


def load_gguf(model_id: str, weights: str, in_process: bool = False):
    """(tokenizer, ``GGUFModel``) for a ``.gguf`` file served at ``weights``: its metadata directory's
    tokenizer and config, its weights straight from the file. ``in_process`` (the model image's child): a file
    whose tokenizer and config our code reads alone (``convert.direct_config``) comes with a ``GGUFTokenizer``
    (what the image's tokenizer directory is written from), without transformers."""
    path = gguf_path(model_id)
    direct = convert.direct_config(path) if in_process else None
    if direct is not None:  # no transformers: the tokenizer is written from the file's vocabulary by our code
        from models.gguf.tokenizer import GGUFTokenizer

        metadata, config, generation_config = direct
        return GGUFTokenizer(metadata), _gguf_model(path, config, generation_config, weights)
    meta = convert.gguf_metadata_dir(path, in_process)
    with load_errors(meta):
        tokenizer = convert.saved_tokenizer(meta)
        config, generation_config = convert.saved_config(meta)
    return tokenizer, _gguf_model(path, config, generation_config, weights)


def _gguf_model(path: str, config, generation_config, weights: str):
    """``GGUFModel`` of the file ``path``; ``ModelLoadError`` naming it when it cannot be served."""
    from models.gguf_model import GGUFModel

    try:
        return GGUFModel(path, config, generation_config, weights)
    except ValueError as exc:  # the file changed under its cached metadata, or a type we cannot serve
        raise ModelLoadError(f"MODEL_ID {path}: {one_line(exc)}") from exc


def eos_ids(hf_model, tokenizer) -> set[int]:
    """The checkpoint's EOS ids: its generation config's (an id or a list), else the tokenizer's."""
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


@contextmanager
def load_errors(model_id: str) -> Iterator[None]:
    """Around ``from_pretrained(model_id)``: a hub id that fails to load raises ``ModelLoadError`` naming the
    offline way; a local directory's own error says what is wrong with it."""
    try:
        yield
    except OSError as exc:
        if os.path.exists(model_id):
            raise ModelLoadError(f"MODEL_ID {model_id} could not be loaded: {one_line(exc)}") from exc
        raise ModelLoadError(
            f"MODEL_ID {model_id!r} is not a local directory, .gguf file or alias, and it could not be loaded from "
            f"the Hugging Face hub ({one_line(exc) or type(exc).__name__}). Without hub access, {OFFLINE_HINT} "
            f"(MODEL_ID=smollm2 python server.py)."
        ) from exc
