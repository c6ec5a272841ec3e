"""Bounded native memory on the torch CPU path (torch-free module: it runs before torch is imported).

Every distinct prompt length gives the linears a new row count, and oneDNN (the primitive cache) and
ideep (its own LRU cache of computations) each keep a compiled kernel plus scratch per shape, up to
1024 entries by default; glibc then holds on to the freed scratch. Measured on the tiny model, 300
distinct prompt lengths took RSS from 362 to 888 MB, and 990 MB on a second pass; with both caches
capped at 64 entries and the heap trimmed after prefills, 362 to 416 MB and flat on the second pass
(any one of the three alone left 690-770 MB). ``tests/test_memory.py`` guards the bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

# Entries per cache: the decode shapes of a batch (a few weight shapes x batch sizes) stay resident.
CACHE_CAPACITY = "64"
TRIM_INTERVAL_S = 1.0


def bound_native_caches() -> None:
    """Cap oneDNN's primitive cache and ideep's LRU cache. Must run before torch's first oneDNN op; an
    explicit setting of either variable in the environment wins."""
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(var, CACHE_CAPACITY)


class HeapTrimmer:
    """``malloc_trim(0)`` at most once per ``interval`` seconds: hands freed heap pages back to the OS.

    A no-op where the C library has no ``malloc_trim`` (not glibc).
    """

    def __init__(self, interval: float = TRIM_INTERVAL_S) -> None:
        self.interval = interval
        self._last = 0.0
        try:
            self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None

    def maybe_trim(self) -> None:
        if time.monotonic() - self._last >= self.interval:
            self.trim()

    def trim(self) -> None:
        """Trim now (after a load: its freed scratch and transient copies are garbage the heap would keep)."""
        self._last = time.monotonic()
        if self._trim is not None:
            self._trim(0)


def memory_mib() -> dict[str, float]:
    """This process's VmRSS, VmHWM (peak RSS), RssAnon and RssFile in MiB from /proc/self/status ({} elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in lines) if k in keys}
