"""Build a C kernel once per machine into the cache (``models/cache_dir.py``) and load it with ctypes.

The shared object is named after a hash of the source, the flags and the machine, so an edited
source or another CPU architecture builds afresh and an unchanged one compiles once (about a
second). Builds go to a temporary file renamed into place: concurrent builders never load a
half-written library.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable

from ..cache_dir import cache_subdir

KERNEL_ISAS = ("auto", "avx2")  # config.KERNEL_ISA: "auto" = AVX-512 where the CPU has it
_isa_choice = "auto"
_isa_libs: list = []  # the loaded kernels that have AVX-512 paths (``with_isa``: their ISA_SWITCHES)


def kernel_dir() -> str:
    """``<cache root>/kernels``, its links resolved: a library linked against another is keyed by that library's
    path, so a cache root whose ``kernels`` links to another root's finds the same builds there."""
    return os.path.realpath(cache_subdir("kernels"))


def built_path(source: str, flags: list[str], link: tuple[str, ...] = ()) -> str:
    """Where ``source`` built with ``flags`` (and linked against the libraries ``link``) lives in the cache (it may not
    exist yet)."""
    spec = " ".join([*flags, *link]).encode() + platform.machine().encode()
    key = hashlib.sha256(_source_bytes(source) + spec).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(kernel_dir(), f"{stem}-{key}.so")


def _source_bytes(source: str, seen: frozenset[str] = frozenset()) -> bytes:
    """The source plus every local file it includes (``#include "x.h"`` or ``"x.c"`` beside it, recursively):
    an edited header or included kernel rebuilds."""
    with open(source, "rb") as f:
        text = f.read()
    names = re.findall(rb'^#include "([^"]+)"', text, flags=re.M)
    seen = seen | {os.path.abspath(source)}
    for name in names:
        path = os.path.join(os.path.dirname(source), name.decode())
        if os.path.abspath(path) not in seen:
            text += _source_bytes(path, seen)
    return text


COMPILE_TIMEOUT_S = 900  # quant_gemm.c's per-type kernels take ~25 s of one core; a loaded box stretches that


def compile_to(compiler: str, source: str, flags: list[str], target: str, link: tuple[str, ...] = ()) -> None:
    """Compile to a temporary file, then rename: concurrent builders never see a half-written .so. ``link``: shared
    libraries (paths) the result needs, given after the source (the loader finds them by those paths)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        cmd = [compiler, *flags, source, *link, "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(source: str, flags: list[str], link: tuple[str, ...] = ()) -> str:
    """The path of ``source``'s library in the cache, compiling it first when the cache lacks it.

    Raises RuntimeError when no C compiler is found (``$CC``, else ``cc``, else ``gcc``) or the build fails.
    """
    target = built_path(source, flags, link)
    if not os.path.exists(target):
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError(f"no C compiler found to build {os.path.basename(source)} (set CC, or install gcc)")
        compile_to(compiler, source, flags, target, link)
    return target


def build_and_load(source: str, flags: list[str], link: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The loaded library of ``source`` (``build``), linked against ``link``."""
    return ctypes.CDLL(build(source, flags, link))  # ctypes releases the GIL during each call


def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags", ...; torch-free), {} where it cannot be
    read (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip() and fields:
                    break  # the end of the first processor's block
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (torch-free), or None where it cannot be read (not Linux)."""
    flags = cpuinfo().get("flags")
    return None if flags is None else set(flags.split())


def has_avx512() -> bool:
    """The CPU has AVX-512 F, BW and VL, so the quantized kernels' AVX-512 paths can run (they check it themselves as
    well)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= (cpu_flags() or set())


def require_cpu_flags(flags: tuple[str, ...], needs: str) -> None:
    """Raise unless the CPU has every one of ``flags`` (/proc/cpuinfo names: "avx2", "fma", "f16c"), without
    importing torch (the torch-free serving path loads kernels too); where the flags cannot be read, torch's
    own check (``require_avx2``) decides."""
    have = cpu_flags()
    if have is None:
        require_avx2(needs)
        return
    missing = [flag for flag in flags if flag not in have]
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(missing)}: the kernel needs {needs}")


def require_avx2(needs: str = "AVX2 and FMA") -> None:
    """Raise unless torch reports an AVX2-class CPU: every kernel here is compiled with -mavx2 -mfma."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"CPU capability is {capability}, the kernel needs {needs}")


class KernelLoader:
    """One compiled kernel, loaded at most once per process (every kernel module has one).

    ``load()`` returns the library, or None when it cannot be built or run here: then
    ``unavailable_reason`` says why, logged once together with what the callers do instead.
    """

    def __init__(self, what: str, load: Callable[[], ctypes.CDLL], instead: str, log: logging.Logger) -> None:
        self.what, self.instead, self._load, self._log = what, instead, load, log
        self._lock = threading.Lock()
        self._kernel: ctypes.CDLL | None = None
        self._tried = False
        self.unavailable_reason: str | None = None

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._kernel = self._load()
                except Exception as exc:  # no compiler, no AVX2, a failed build: the fallback carries on
                    self.unavailable_reason = str(exc)
                    self._log.warning("%s unavailable, %s: %s", self.what, self.instead, exc)
            return self._kernel


def with_isa(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Register a kernel with AVX-512 paths (quant_gemm.c's library, and decode_step.c linked against it; int_dot.c's
    integer path; paged_attention.c's ``attention_isa``, in its own library and in decode_step.c's, which includes
    it) and apply the chosen instruction set to it. quant_gemm's AVX2 and AVX-512 paths give the same bits
    (quant_gemm.c), and so do int_dot's (int_dot.c) and paged attention's (paged_attention.c), so the choice changes
    speed only."""
    for name in ISA_SWITCHES:
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.c_int]
    _apply_isa(lib)
    _isa_libs.append(lib)
    return lib


ISA_SWITCHES = ("kernel_isa", "attention_isa", "int_dot_isa")
_isa_hooks: list[Callable[[], None]] = []  # called after set_kernel_isa (int_dot: ACTIVATIONS=auto follows the ISA)


def on_isa_change(hook: Callable[[], None]) -> None:
    _isa_hooks.append(hook)


def _apply_isa(lib: ctypes.CDLL) -> None:
    for name in ("kernel_isa", "attention_isa"):  # 1: AVX-512 where the CPU has it (the kernel checks)
        if hasattr(lib, name):
            getattr(lib, name)(1 if _isa_choice == "auto" else 0)
    if hasattr(lib, "int_dot_isa"):
        lib.int_dot_isa(2 if _isa_choice == "auto" else 0)  # 2: the best VNNI path the CPU has; 0: AVX2 maddubs


def set_kernel_isa(choice: str) -> None:
    """``auto``: the kernels' AVX-512 paths where the CPU has AVX-512 F/BW/VL; ``avx2``: their AVX2 paths everywhere.
    Applies to kernels already loaded and to those loaded later; a call already running finishes on its ISA."""
    global _isa_choice
    if choice not in KERNEL_ISAS:
        raise ValueError(f"kernel ISA must be one of {', '.join(KERNEL_ISAS)} (got {choice!r})")
    _isa_choice = choice
    for lib in _isa_libs:
        _apply_isa(lib)
    for hook in _isa_hooks:
        hook()


def kernel_isa() -> str:
    """What the quantized kernels run: "avx512" when they take their AVX-512 paths, else "avx2" (before any
    kernel loads: what they will run)."""
    libs = [lib for lib in _isa_libs if hasattr(lib, "kernel_isa") or hasattr(lib, "attention_isa")]
    if libs:
        switch = getattr(libs[-1], "kernel_isa", None) or libs[-1].attention_isa
        return "avx512" if switch(-1) else "avx2"
    return "avx512" if _isa_choice == "auto" and has_avx512() else "avx2"
