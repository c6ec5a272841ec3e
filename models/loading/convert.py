"""A ``.gguf`` file made loadable by transformers-free code, converted once into the cache's ``checkpoints/``.

- ``gguf_metadata_dir``: only its tokenizer and config, converted in a child process (transformers' GGUF reader
  materializes the whole vocabulary, ~160 MB, and its config classes import sympy and torch.distributed, ~55 MB,
  none of which a server should keep), into ``checkpoints/<key>-meta``. Later starts read that directory without
  importing transformers' model classes: the tokenizer through its own class (``saved_tokenizer``), the config as
  a ``PlainConfig`` of every attribute the converter saw (``saved_config``).
- ``convert_gguf``: the whole model dequantized to fp32 through transformers and saved with ``save_pretrained``
  (what WEIGHTS=fp32 and the torch reference load).
Both are keyed by the file's name, size and mtime (``gguf_cache_dir``) and built atomically
(``build_cache.build_dir_once``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable

from models.cache_dir import cache_subdir

from .build_cache import MARKER, build_dir_once
from .errors import ModelLoadError, one_line

log = logging.getLogger("minibatch.checkpoints")

_SAVED_CONFIG = "minibatch-config.json"  # a metadata directory's full config, its aliases, its generation config
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's root


def gguf_cache_dir(path: str) -> str:
    """<cache root>/checkpoints/<name>-<size>-<hash of size and mtime>: a changed file gets a fresh directory."""
    st = os.stat(path)
    stem = os.path.basename(path)[: -len(".gguf")]
    stamp = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return os.path.join(cache_subdir("checkpoints"), f"{stem}-{st.st_size}-{stamp}")


def gguf_metadata_dir(path: str, in_process: bool = False) -> str:
    """The directory of the GGUF file ``path``'s tokenizer and config (``gguf_cache_dir(path)-meta``, keyed the same
    way), converted now if no earlier start did: by a child process, or here when ``in_process`` (a process that
    imports transformers anyway and exits after the load: the model image's build)."""
    out_dir = gguf_cache_dir(path) + "-meta"
    if os.path.isfile(os.path.join(out_dir, MARKER)):
        log.info("GGUF %s: tokenizer and config from %s", path, out_dir)
        return out_dir
    from models.gguf.config import file_config

    try:  # a corrupt, truncated or unservable file fails here, in one line, before any conversion
        file_config(path)
    except ValueError as exc:
        raise ModelLoadError(f"MODEL_ID {path} could not be loaded as a GGUF checkpoint: {one_line(exc)}") from exc
    log.info("GGUF %s: converting its tokenizer and config once into %s", path, out_dir)
    build_gguf_once(path, out_dir, write_gguf_metadata if in_process else _metadata_in_child)
    return out_dir


def _metadata_in_child(path: str, out: str) -> None:
    """``write_gguf_metadata(path, out)`` in a fresh interpreter, so that none of its memory stays in ours."""
    code = "import sys; from models.loading import convert; convert.write_gguf_metadata(sys.argv[1], sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, path, out], cwd=_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(one_line(proc.stderr) or f"the conversion exited {proc.returncode}")


def write_gguf_metadata(path: str, out: str) -> None:
    """Save the GGUF file ``path``'s tokenizer, config and generation config into ``out``, plus ``_SAVED_CONFIG``:
    the config's every attribute (``save_pretrained`` leaves out the class defaults), its attribute aliases and the
    generation config, for ``saved_config``.

    The config is ours (``models/gguf/config.py``: llama.cpp's keys per architecture), GPT-2's transformers'. The
    tokenizer is transformers' conversion of the file's vocabulary (by its ``tokenizer.ggml.model``), through the
    tokenizer class transformers picks for ``llama`` and ``gpt2`` files and its generic one otherwise (transformers
    picks a class from its own config conversion, which knows none of OLMo 2, Granite, OLMoE)."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from models.gguf.config import file_config
    from models.gguf.reader import fields_reader_installed

    directory, name = os.path.split(path)
    values = file_config(path)
    with fields_reader_installed():  # transformers reads the header through our parser (seconds, not tens)
        if values is None:  # gpt2
            config = AutoConfig.from_pretrained(directory, gguf_file=name)
        else:
            config = AutoConfig.for_model(values.pop("model_type"), **values)
        tokenizers = AutoTokenizer if config.model_type in ("gpt2", "llama") else transformers.PreTrainedTokenizerFast
        tokenizers.from_pretrained(directory, gguf_file=name).save_pretrained(out)
    save_config(out, config, GenerationConfig.from_model_config(config))  # the generation config a model gets


def save_config(directory: str, config, generation_config) -> None:
    """``save_pretrained`` both transformers configs into ``directory``, and ``_SAVED_CONFIG`` beside them."""
    config.save_pretrained(directory)
    generation_config.save_pretrained(directory)
    saved = {
        "config": json.loads(config.to_json_string(use_diff=False)),
        "aliases": dict(getattr(config, "attribute_map", {})),
        "generation_config": json.loads(generation_config.to_json_string(use_diff=False)),
    }
    with open(os.path.join(directory, _SAVED_CONFIG), "w") as f:
        json.dump(saved, f, indent=1)


class PlainConfig:
    """A config's saved attributes as plain attributes (``aliases``: alternative names, e.g. GPT-2's
    ``hidden_size`` for ``n_embd``), standing in for a transformers config class on the serving path."""

    def __init__(self, values: dict, aliases: dict[str, str] | None = None) -> None:
        self.__dict__.update(values)
        self._aliases = dict(aliases or {})

    def __getattr__(self, name: str):  # only reached for a name that is not an attribute
        aliases = self.__dict__.get("_aliases", {})
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(name)


# Model types whose forward (models/) reads only plain attributes of the config, with default RoPE
# (a scaled RoPE is computed by transformers' own functions, which need its config class).
PLAIN_MODEL_TYPES = ("llama", "gpt2")


def _default_rope(values: dict) -> bool:
    """Whether a saved config's RoPE is the plain one (or none): no scaling, one setting for every layer."""
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):  # per layer type
        return False
    return rope.get("rope_type", rope.get("type", "default")) == "default"


def direct_config(path: str):
    """(metadata, config, generation config) of the GGUF file ``path`` read by our code alone, without
    transformers: when its config is ``gguf/config.py``'s for a ``PLAIN_MODEL_TYPES`` model with default RoPE, it
    names an EOS token, and our code writes its tokenizer (``gguf/tokenizer.py``). The config is a ``PlainConfig``
    of that dict (what the family reads of transformers' config class: the same values, tests/test_gguf_tokenizer.py
    compares the images built both ways), the generation config the ids transformers copies from it. None (and a
    debug line saying why) for any other file: the caller converts it with transformers."""
    from models.gguf.config import file_config
    from models.gguf.reader import read_metadata
    from models.gguf.tokenizer import written_by_us

    try:
        metadata, tensors = read_metadata(path, max_items=1 << 62)  # the vocabulary and merges in full
        values = file_config(path, (metadata, tensors))
    except ValueError as exc:  # unreadable or unservable: the transformers path reports it in its words
        log.debug("GGUF %s: not read by our code alone (%s)", path, one_line(exc))
        return None
    if values is None or values.get("model_type") not in PLAIN_MODEL_TYPES or not _default_rope(values):
        why = "its config is not a plain one (a gpt2 file, another family, or scaled RoPE)"
    elif values.get("eos_token_id") is None:
        why = "it names no EOS token"
    else:
        why = written_by_us(metadata)
    if why is not None:
        log.debug("GGUF %s: tokenizer and config converted by transformers: %s", path, why)
        return None
    ids = {k: values.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return metadata, PlainConfig(values), PlainConfig(ids)


def saved_config(directory: str) -> tuple:
    """(config, generation config) of a GGUF's metadata directory: ``PlainConfig``s of every attribute the
    converter saw where the model type allows (no transformers model module is imported), else the
    transformers classes."""
    with open(os.path.join(directory, _SAVED_CONFIG)) as f:
        saved = json.load(f)
    values = saved["config"]
    if values.get("model_type") in PLAIN_MODEL_TYPES and _default_rope(values):
        return PlainConfig(values, saved["aliases"]), PlainConfig(saved["generation_config"])
    from transformers import AutoConfig, GenerationConfig

    return AutoConfig.from_pretrained(directory), GenerationConfig.from_pretrained(directory)


def saved_tokenizer(directory: str):
    """The tokenizer saved in ``directory``, through the class its tokenizer_config.json names (what
    ``AutoTokenizer`` resolves too, without loading the model config to decide), else ``AutoTokenizer``."""
    import transformers

    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        name = json.load(f).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return (cls or transformers.AutoTokenizer).from_pretrained(directory)


def convert_gguf(path: str, out_dir: str) -> None:
    """Load ``path`` through transformers (dequantized to fp32) and save tokenizer + model into ``out_dir``."""
    log.info("GGUF %s: converting once to an fp32 checkpoint in %s", path, out_dir)
    build_gguf_once(path, out_dir, _save_fp32_checkpoint)


def _save_fp32_checkpoint(path: str, out: str) -> None:
    tokenizer, model = _load_gguf(path)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_gguf_once(path: str, out_dir: str, fill: Callable[[str, str], None]) -> None:
    """Build a cache directory for the GGUF file ``path``: ``fill(path, tmp)`` writes its contents
    (``build_dir_once``). Any failure of ``fill`` raises ``ModelLoadError`` naming the file."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"MODEL_ID {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    st = os.stat(path)
    marker = {"source": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    build_dir_once(
        out_dir, lambda tmp: fill(path, tmp), marker, f"MODEL_ID {path} could not be loaded as a GGUF checkpoint"
    )


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
            raise ValueError(
                f"weight {key} did not dequantize to a dense fp32 tensor ({type(param).__name__}, {param.dtype})"
            )
    return tokenizer, model
