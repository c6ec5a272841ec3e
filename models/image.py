"""The model image: a model's packed weights, written once by a torch process, for the torch-free runner.

Serving needs torch only to *build* the packed weights (quantized blocks, small_gemm panels, fused linears, RoPE
tables): every step of a quantized model up to ``StepPlan.max_rows`` rows is one compiled call
(``kernels/decode_step.c``) that reads those buffers and nothing else. So a model is built once, in a child
process, the way ``HFEngine`` builds it, and the buffers its ``StepPlan`` points at are written to a directory:

    weights.bin    every buffer of the plan's ``ModelSpec`` (``kernels/step_abi.py``), each ``ALIGN``-byte aligned,
                   a buffer shared by two names (a tied lm_head and the token table) once
    image.json     the spec with each buffer named, every buffer's offset / bytes / dtype / shape, and what a
                   server needs besides (model type, vocab, context window, KV geometry, max_rows, EOS ids,
                   resident and streamed weight bytes and the FLOP counts for the benchmark's roofline)
    tokenizer/     the checkpoint's tokenizer (``text.tokenizer.write_tokenizer_dir``: what ``TextTokenizer`` reads;
                   a GGUF's, where our code can, ``gguf/tokenizer.py``: the same files, without transformers)

``models/native.py`` maps ``weights.bin`` read-only and runs steps on it without importing torch. The KV pools are
not in the image (they depend on capacity): the runner allocates them.

``ensure_image(model_id, weights)`` (torch-free) returns the image's directory in the cache (``images/``), building
it first in a child process (``python -m models.image``) when no complete one exists for the model file's identity
(path, size, mtime; a directory's files), WEIGHTS, and a hash of the code that builds and reads it (``models/`` and
``text/tokenizer.py``: an edit rebuilds). Builds are atomic (``models.loading.build_dir_once``); a failure raises
``models.loading.ModelLoadError`` with the child's last error line; an image damaged after its build (``check_image``)
is built again. Each use stamps the image's marker; images that can no longer be served are removed once unused
for a day (``prune_images``), so edits, upgrades and deleted checkpoints do not fill the cache.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time

from models.cache_dir import cache_subdir
from models.image_files import MODEL_FILE
from models.loading import ALIASES, ModelLoadError, build_dir_once, fetch_gguf, is_built, marker_path, one_line

log = logging.getLogger("minibatch.image")

IMAGE_FORMAT = 3  # bumped when image.json's layout changes (2: the families; 3: linears of parts, GGUF-typed weights)
WEIGHTS_FILE = "weights.bin"
META_FILE = "image.json"
TOKENIZER_DIR = "tokenizer"
ALIGN = 64  # bytes: every buffer starts on a cache line (the mapping itself is page-aligned)
BUILD_TIMEOUT_S = 3600  # a child build of a large checkpoint takes minutes; a hung one must not hang the server
ERROR_PREFIX = "error: "  # the CLI's last stderr line on a failure
BUILD_BLOCK_SIZE = 16  # the writer's throwaway KV pool; the image holds none of it
# An image unused this long is removed when it can no longer be the one served: its model file is gone, a newer
# image of the same file and WEIGHTS exists, or other code built it. The wait keeps an image that another checkout
# or a running server still uses (a server maps weights.bin once, so removing it under one is harmless anyway).
PRUNE_UNUSED_S = 24 * 3600

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ImageError(ValueError):
    """A model image that cannot be used (missing, incomplete or corrupt file): ``str()`` names the file."""


def check_image(image_dir: str) -> dict:
    """image.json of a complete image (torch-free): raises ``ImageError`` naming the file when image.json is
    missing, unreadable or of another format, or weights.bin is missing or not the size image.json says, or the
    model file its buffers point into is missing or no longer the one it was built from (size, mtime), or a buffer
    lies outside its file."""
    path = os.path.join(image_dir, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ImageError(f"model image {path} cannot be read: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != IMAGE_FORMAT:
        raise ImageError(f"model image {path} is not format {IMAGE_FORMAT}")
    weights = os.path.join(image_dir, WEIGHTS_FILE)
    try:
        size, want = os.path.getsize(weights), meta["weights_bin_bytes"]
        if size != want:
            raise ImageError(f"model image file {weights} has {size} bytes, image.json says {want} (truncated?)")
        sizes = {None: (weights, size), MODEL_FILE: _model_file_size(image_dir, meta.get("model_file"))}
        for name, entry in meta["buffers"].items():
            path, limit = sizes[entry.get("file")]
            if not 0 <= entry["offset"] <= entry["offset"] + entry["nbytes"] <= limit:
                raise ImageError(f"model image {image_dir}: buffer {name} lies outside {path}")
    except OSError as exc:
        raise ImageError(f"model image file {weights} is missing: {exc}") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise ImageError(f"model image {path} is malformed ({type(exc).__name__}: {exc})") from exc
    return meta


def _model_file_size(image_dir: str, model_file: dict | None) -> tuple[str | None, int]:
    """(path, size) of the model file an image's buffers point into, as the image recorded it (None, 0: none);
    ``ImageError`` when it is missing or has changed since the build."""
    if model_file is None:
        return None, 0
    path = model_file["path"]
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ImageError(f"model image {image_dir}: its model file {path} is missing ({exc})") from exc
    if (st.st_size, st.st_mtime_ns) != (model_file["size"], model_file["mtime_ns"]):
        raise ImageError(f"model image {image_dir}: its model file {path} has changed since the image was built")
    return path, st.st_size


# --- the writer (imports torch when called) --------------------------------------------------------------------


def build_model(
    model_id: str,
    weights: str,
    num_blocks: int = 1,
    block_size: int = BUILD_BLOCK_SIZE,
    kv_cache_dtype: str = "fp32",
    in_process: bool = False,
):
    """(tokenizer, HF model, family class, our model) for ``model_id`` served at ``weights``, built as ``HFEngine``
    builds it (small_gemm panels on, one sequence, RoPE / positions over the whole context window, ``num_blocks``
    KV blocks of ``block_size`` of ``kv_cache_dtype``). Imports torch. Raises ``ModelLoadError``. ``in_process``:
    a GGUF's tokenizer and config are converted here, not in one more child (``load_checkpoint``)."""
    import torch

    from models import families
    from models.loading import load_checkpoint

    tokenizer, hf_model = load_checkpoint(model_id, weights, in_process)
    cfg = hf_model.config
    family = families().get(cfg.model_type)
    if family is None:
        raise ModelLoadError(f"model architecture {cfg.model_type!r} of {model_id!r} is not supported")
    try:
        model = family(
            hf_model.eval(),
            1,
            family.context_window(cfg),
            torch.device("cpu"),
            use_small_gemm=True,
            num_blocks=num_blocks,
            block_size=block_size,
            weights="fp32" if weights == "auto" else weights,  # a GGUF's "auto" is in hf_model already
            kv_cache_dtype=kv_cache_dtype,
        )
    except ValueError as exc:  # a config option our forward does not implement
        raise ModelLoadError(f"MODEL_ID {model_id}: {exc}") from exc
    return tokenizer, hf_model, family, model


def _table_rows(model) -> int:
    """Rows of the token table (ids must be below): a QuantWeight's outputs, a tied lm_head's, or fp32 rows."""
    table = model.embedding_tables()[0]
    if hasattr(table, "out_features"):
        return table.out_features
    return model.lm_head.out_features if table.dim() == 3 else table.shape[0]


def _write_buffers(spec, path: str, files=None) -> tuple:
    """Write every tensor the spec names into ``path``, each once (shared tensors share one entry), ``ALIGN``ed;
    a buffer whose bytes are a range of the model file (``files``: its ``image_files.FileTensors``, or None) is not
    written but recorded as that range. -> (the spec with each handle replaced by its buffer's name,
    {name: {offset, nbytes, dtype, shape[, file]}}, bytes written)."""
    from models.image_files import FileRange, flat_bytes, split_parts
    from models.kernels import step_abi

    named: dict[object, str] = {}
    entries: dict[str, dict] = {}
    if files is not None:
        spec = split_parts(spec, files)
    with open(path, "wb") as f:

        def put(name: str, t) -> str:
            if isinstance(t, FileRange):
                key, found = t, t
            else:
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(f"buffer {name} is not a contiguous CPU tensor")
                key, found = (t.data_ptr(), t.numel() * t.element_size()), None
            if key not in named:
                if found is None and files is not None:
                    found = files.locate(flat_bytes(t))
                if found is not None:  # the model file's own bytes: served from its mapping
                    entries[name] = {
                        "offset": found.offset,
                        "nbytes": found.nbytes,
                        "dtype": "uint8",
                        "shape": [found.nbytes],
                        "file": MODEL_FILE,
                    }
                else:
                    f.write(b"\0" * (-f.tell() % ALIGN))
                    entries[name] = {
                        "offset": f.tell(),
                        "nbytes": key[1],
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                    }
                    f.write(t.detach().numpy().data)
                named[key] = name
            return named[key]

        spec = step_abi.map_buffers(spec, put)
        size = f.tell()
    return spec, entries, size


def write_image(model_id: str, weights: str, out: str) -> dict:
    """Build ``model_id`` at ``weights`` and write its image into the directory ``out`` (created); -> image.json's
    contents. Raises ``ModelLoadError`` when the model cannot load, ``ValueError`` when its steps cannot run as
    one compiled call here."""
    from models.gguf.tokenizer import GGUFTokenizer
    from models.kernels import paged_attention, step_abi
    from models.loading import eos_ids
    from models.lora import targets_to_json
    from text.tokenizer import write_tokenizer_dir

    tokenizer, hf_model, family, model = build_model(model_id, weights, in_process=True)  # the image's child
    plan = model.fused_step
    if plan is None:
        gap = getattr(model, "kernel_gap", lambda: None)()
        why = step_abi.KERNEL.unavailable_reason or (
            f"the whole-step kernel does not implement {gap}"
            if gap
            else "a linear has no compiled copy, or the activation is not tanh GELU"
        )
        raise ValueError(f"{model_id} at WEIGHTS={weights} cannot run as one compiled step here ({why})")
    os.makedirs(out, exist_ok=True)
    model_file = _gguf_file(model_id)
    files = None
    if model_file is not None:
        from models.image_files import FileTensors

        files = FileTensors(model_file["path"])
    spec, entries, size = _write_buffers(plan.spec, os.path.join(out, WEIGHTS_FILE), files)
    cfg = hf_model.config
    meta = {
        "format": IMAGE_FORMAT,
        "model_id": model_id,
        "weights": weights,
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "n_vocab": plan.n_vocab,  # logits per row (the lm_head's outputs)
        "embed_rows": _table_rows(model),
        "context_window": family.context_window(cfg),  # rows of the RoPE / position tables
        "eos_ids": sorted(eos_ids(hf_model, tokenizer)),
        "kv": {"n_layer": model.n_layer, "n_kv_head": spec.KVH, "head_dim": spec.D},
        "kv_bytes_per_token": family.kv_bytes_per_token(cfg),
        "kv_window": family.kv_window(cfg),  # blocks that left every layer's sliding window are never read
        "max_block_size": paged_attention.MAX_BLOCK_SIZE,
        "max_rows": plan.max_rows,
        "resident_weights": model.resident_weights(),
        "weight_bytes": model.weight_bytes(),
        # flops_per_token(context) = token + context * per_position: MixedForward's count, read off it
        "flops": {
            "token": model.flops_per_token(0),
            "per_position": model.flops_per_token(1) - model.flops_per_token(0),
        },
        "lora_targets": targets_to_json(model.lora_targets()),  # the linears LoRA adapters may target
        "weights_bin_bytes": size,
        "model_file": model_file,  # the GGUF whose bytes the buffers with "file" are (None: none)
        "buffers": entries,
        "plan": step_abi.spec_to_json(spec),
    }
    if isinstance(tokenizer, GGUFTokenizer):  # written from the GGUF's vocabulary by our code (load_gguf)
        tokenizer.write_dir(os.path.join(out, TOKENIZER_DIR))
    else:
        write_tokenizer_dir(tokenizer, os.path.join(out, TOKENIZER_DIR))  # as the generic class TextTokenizer reads
    with open(os.path.join(out, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def _gguf_file(model_id: str) -> dict | None:
    """{path, size, mtime_ns} of the GGUF file ``model_id`` names (a path or an alias), else None."""
    from models.loading.model_id import alias_path, gguf_path, is_gguf

    path = alias_path(model_id)
    if not is_gguf(path):
        return None
    path = gguf_path(path)
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


# --- the cache (torch-free) ------------------------------------------------------------------------------------


def source_identity(model_id: str) -> tuple[str, object]:
    """(the MODEL_ID as the child loads it, what identifies its contents): a file -> its absolute path, size and
    mtime; a directory -> every file's relative path, size and mtime; an alias -> its fetched GGUF file's; anything
    else (a hub id) -> its name and the commit its cached snapshot is at (``hub_revision``)."""
    if model_id in ALIASES:
        model_id = fetch_gguf(ALIASES[model_id], cache_subdir("gguf"))[0]
    path = os.path.abspath(os.path.expanduser(model_id))
    if os.path.isfile(path):
        st = os.stat(path)
        return path, [path, st.st_size, st.st_mtime_ns]
    if os.path.isdir(path):
        files = []
        for root, _, names in os.walk(path):
            for name in sorted(names):
                st = os.stat(os.path.join(root, name))
                files.append([os.path.relpath(os.path.join(root, name), path), st.st_size, st.st_mtime_ns])
        return path, [path, sorted(files)]
    return model_id, [model_id, hub_revision(model_id)]


def hub_revision(model_id: str) -> str | None:
    """The commit of the snapshot the Hugging Face cache holds for a hub id (its config.json's), or None when it
    holds none (never downloaded, or not a valid hub id). Reads the cache only: no network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model_id, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception:  # an id the hub would refuse (HFValidationError), an unreadable cache
        return None
    return os.path.basename(os.path.dirname(path)) if isinstance(path, str) else None


@functools.cache
def code_hash() -> str:
    """A hash of every source that builds or reads an image: ``models/`` (Python and kernels,
    ``models/loading/`` included) and ``text/tokenizer.py`` (its tokenizer directory), plus the torch and transformers
    versions (quantization and the GGUF reader are theirs). Read once per process: a start keys, marks and prunes
    images with the same code."""
    h = hashlib.sha256()
    models_dir = os.path.join(_REPO, "models")
    paths = [os.path.join(_REPO, "text", "tokenizer.py")]
    for root, _, names in os.walk(models_dir):
        paths += [os.path.join(root, n) for n in names if n.endswith((".py", ".c", ".h"))]
    for path in sorted(paths):
        h.update(os.path.relpath(path, _REPO).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    for package in ("torch", "transformers"):
        try:
            h.update(f"{package}=={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    return h.hexdigest()


def image_dir(model_id: str, weights: str) -> tuple[str, str]:
    """(the MODEL_ID the child loads, <cache root>/images/<name>-<weights>-<key>): any change to the model file,
    WEIGHTS or the code gets a fresh directory."""
    source, identity = source_identity(model_id)
    if weights == "auto" and not source.lower().endswith(".gguf"):
        weights = "fp32"  # only a GGUF has a precision of its own: elsewhere "auto" loads fp32 (load_checkpoint)
    key = hashlib.sha256(json.dumps([identity, weights, IMAGE_FORMAT, code_hash()]).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(source.rstrip("/")) or "model")[:64]
    return source, os.path.join(cache_subdir("images"), f"{stem}-{weights}-{key}")


def ensure_image(model_id: str, weights: str = "fp32") -> str:
    """The directory of ``model_id``'s image at ``weights``, built first (in a child process) if the cache has no
    complete one. Torch-free. Raises ``ModelLoadError`` (the child's last error line) when it cannot be built.
    Stamps the image as used and prunes the cache (``prune_images``)."""
    source, out = image_dir(model_id, weights)
    if source.lower().endswith(".gguf") and weights != "fp32":
        check_gguf(source)  # before any child process: a file we cannot serve fails in one line, now
    if not _usable(out):
        log.info("building the model image of %s (WEIGHTS=%s) once into %s", model_id, weights, out)
        marker = {"source": source, "weights": weights, "format": IMAGE_FORMAT, "code": code_hash()}
        failure = f"MODEL_ID {model_id}: could not build its model image (WEIGHTS={weights})"
        build_dir_once(out, lambda tmp: _build_in_child(source, weights, tmp, failure), marker, failure)
        out = _settle(model_id, weights, out)
    else:
        log.info("model image of %s (WEIGHTS=%s): %s", model_id, weights, out)
    _stamp(out)
    prune_images(keep=out)
    return out


def check_gguf(path: str) -> None:
    """``ModelLoadError`` (one line, torch-free) when the GGUF file ``path`` cannot be served at its own precision:
    missing, corrupt or truncated, an unknown type id, a tensor of a type no kernel serves (named with its type),
    an architecture or a metadata key we do not serve (``gguf/config.py``)."""
    from models.gguf.config import file_config
    from models.gguf.reader import check_servable, read_metadata

    try:
        read = read_metadata(path)
        check_servable(path, read[1])
        file_config(path, read)
    except ValueError as exc:
        raise ModelLoadError(f"MODEL_ID {path}: {one_line(exc)}") from None


def _usable(out: str) -> bool:
    """Whether ``out`` holds a complete, undamaged image; a damaged one is removed (to be built again)."""
    if not is_built(out):
        return False
    try:
        check_image(out)
        return True
    except ImageError as exc:  # damaged since it was built
        log.warning("%s; building it again", exc)
        shutil.rmtree(out, ignore_errors=True)
        return False


def _settle(model_id: str, weights: str, out: str) -> str:
    """Where the image just built at ``out`` belongs: a hub id's first build downloads its snapshot, which fixes
    the revision its key names, so the image moves to that key (or yields to one already there)."""
    final = image_dir(model_id, weights)[1]
    if final == out:
        return out
    try:
        os.replace(out, final)
    except OSError:  # another process put a complete image there meanwhile
        if not is_built(final):
            return out
        shutil.rmtree(out, ignore_errors=True)
    return final


def _stamp(out: str) -> None:
    """Record a use of the image at ``out`` (its marker's mtime), which keeps it from ``prune_images``."""
    try:
        os.utime(marker_path(out))
    except OSError:  # a read-only cache: nothing is pruned from it either
        pass


def prune_images(keep: str, now: float | None = None) -> list[str]:
    """Remove the images in ``keep``'s cache directory, other than ``keep``, that no start will serve again and
    that have been unused for ``PRUNE_UNUSED_S``: built by other code (or an older image format), superseded by
    ``keep`` (same model and WEIGHTS), or built from a model file or directory that no longer exists; and build
    directories left by a killed build, older than ``BUILD_TIMEOUT_S``. -> the removed directories."""
    now = time.time() if now is None else now
    root = os.path.dirname(keep)
    mine, code = _read_marker(keep) or {}, code_hash()
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if path == keep or not os.path.isdir(path):
            continue
        try:
            if ".tmp-" in name:
                stale = now - os.path.getmtime(path) > BUILD_TIMEOUT_S
            else:
                marker = _read_marker(path)
                stale = (
                    marker is not None
                    and now - os.path.getmtime(marker_path(path)) > PRUNE_UNUSED_S
                    and _unservable(marker, mine, code)
                )
        except OSError:  # gone meanwhile: another start pruned it, or a build finished and renamed it
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            log.info("model image cache: removed %s (unused, and no longer what its model builds)", path)
            removed.append(path)
    return removed


def _read_marker(path: str) -> dict | None:
    """A complete image's marker (what built it), or None for a directory that is not one."""
    try:
        with open(marker_path(path)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _unservable(marker: dict, mine: dict, code: str) -> bool:
    """Whether the image ``marker`` describes can never be served again (``mine``: the marker of the one in use,
    ``code``: this code's ``code_hash``)."""
    source = marker.get("source")
    if marker.get("format") != IMAGE_FORMAT or marker.get("code") != code:
        return True
    if (source, marker.get("weights")) == (mine.get("source"), mine.get("weights")):
        return True  # the same model at the same WEIGHTS: the image in use supersedes it
    return isinstance(source, str) and os.path.isabs(source) and not os.path.exists(source)


def _build_in_child(model_id: str, weights: str, out: str, failure: str) -> None:
    """``python -m models.image`` into ``out``: torch and the build's transient memory stay in the child."""
    cmd = [sys.executable, "-m", "models.image", "--model-id", model_id, "--weights", weights, "--out", out]
    try:
        proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"{failure}: the build took over {BUILD_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        last = one_line(proc.stderr).removeprefix(ERROR_PREFIX)
        raise ModelLoadError(f"{failure}: {last or f'the build exited {proc.returncode}'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a model image (packed weights for the torch-free runner).")
    parser.add_argument("--model-id", required=True, help="a local checkpoint directory, a .gguf file or an alias")
    parser.add_argument("--weights", default="fp32", help="fp32, int8, int4 or auto (a GGUF's own precision)")
    parser.add_argument("--out", required=True, help="the directory to write (created)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        meta = write_image(args.model_id, args.weights, args.out)
    except ModelLoadError as exc:  # one line last on stderr: ensure_image reports it
        print(f"{ERROR_PREFIX}{one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"{ERROR_PREFIX}{type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return 1
    print(f"{args.out}: {meta['model_type']}, {meta['weights_bin_bytes'] / 2**20:.1f} MiB of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
