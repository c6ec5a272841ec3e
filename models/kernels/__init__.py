"""Compiled CPU kernels: C sources built once with the system compiler (``build.py``) and called via ctypes."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

# Every kernel library a start loads (decode_step.c is built by step_abi, linked against quant_gemm's library).
KERNEL_MODULES = ("decode_ops", "int_dot", "paged_attention", "quant_gemm", "small_gemm", "step_abi")


def build_all() -> None:
    """Build, or find built, every kernel under this process's cache root. A kernel is loaded once per process,
    from the cache root current at its first load, so building into another root takes a fresh process:
    ``build_all_into``."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"{__name__}.{name}").load()


def build_all_into(cache: str, tree: str | None = None) -> None:
    """Build every kernel under the cache root ``cache`` (``$MINIBATCH_CACHE``) in a child process, with the
    checkout ``tree``'s sources (default: this one). A first start there then only loads them: a kernel linked
    against another is keyed by that library's path, so each cache root builds its own copies once (minutes on 2
    busy cores)."""
    tree = tree or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The module list travels in the code, so an older checkout (a before/after run's) builds the same set.
    load = "importlib.import_module('models.kernels.' + name).load()"
    code = f"import importlib\nfor name in {KERNEL_MODULES!r}:\n    {load}"
    env = dict(os.environ, MINIBATCH_CACHE=cache)
    subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True)
