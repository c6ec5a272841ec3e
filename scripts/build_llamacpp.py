#!/usr/bin/env python
"""Build llama.cpp's ``llama-server`` once, from the source vendored in the ``llama-cpp-python`` sdist.

    python scripts/build_llamacpp.py            # builds (10-30 minutes on 2 cores), prints the binary's path
    python scripts/build_llamacpp.py --print    # prints the path if built, else exits 1 (builds nothing)
    python scripts/build_llamacpp.py --isa avx2 # ggml's portable AVX2 build beside it (an AVX2-only CPU's kernels)

Why this route: no network but package registries here, and the ``llama-cpp-python`` sdist
(``pip download --no-deps --no-binary :all:``) carries a full llama.cpp tree under
``vendor/llama.cpp``. It is built with cmake (target ``llama-server``, ``-DLLAMA_CURL=OFF``: no
downloads from the server itself, and no libcurl needed) into ``<cache>/llamacpp-<version>``
-<cpu>`` (``models/cache_dir.py``; default ``~/.cache/minibatch-llm``), so it is built once
per machine; a second run finds the binary and only prints its path. ``<cpu>`` names the building CPU's
model and instruction sets (``cpu_tag``): ``-DGGML_NATIVE=ON`` compiles for that CPU (``-march=native``), so a
binary built on an AVX-512 host dies with SIGILL on an AVX2-only one, and a cache shared between machines
(``MINIBATCH_CACHE`` on a network disk) must keep one build per kind of CPU. The binary is written by
cmake into the build tree; ``<cache>/llamacpp-<version>/llama-server`` is copied there last, so an
interrupted build never looks finished.

``scripts/benchmark.py --systems llamacpp`` uses ``binary_path()``. This script never runs in CI or
tests: it is slow and needs the registry.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

from models.cache_dir import cache_subdir  # torch-free
from models.kernels.build import cpuinfo  # torch-free

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"  # pinned: the vendored llama.cpp, and so the cache directory, stay the same


# x86 /proc/cpuinfo flags that name instruction sets a native build may use (-march=native turns each on); the
# rest (bug mitigations, virtualization and power-management flags) can differ between hosts of one CPU kind.
_X86_ISA = re.compile(
    r"(sse|ssse|avx|amx|fma|f16c|bmi|aes|vaes|pclmul|vpclmul|gfni|sha|popcnt|lzcnt|abm|movbe|adx|cx16|xop|tbm|mmx|"
    r"3dnow|movdir|serialize|cldemote|clflushopt|clwb|rdpid|rdrand|rdseed|xsave|prfchw|waitpkg|enqcmd|uintr|hreset)"
)


def cpu_tag(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """Ten hex digits naming this CPU: its architecture, model name and instruction sets (the first processor's
    ``model name`` and the ISA part of its ``flags`` on x86, its ``Features`` elsewhere; what ``platform``
    reports where there is no /proc/cpuinfo). Machines that differ in any instruction set get different tags, and
    so different native builds; hosts that differ only in mitigation or virtualization flags share one."""
    found = cpuinfo(cpuinfo_path)
    model = found.get("model name", platform.processor())
    if "flags" in found:
        isa = sorted(flag for flag in found["flags"].split() if _X86_ISA.match(flag))
    else:
        isa = sorted(found.get("Features", "").split())
    return hashlib.sha1(f"{platform.machine()}|{model}|{' '.join(isa)}".encode()).hexdigest()[:10]


# Builds besides the native one: "avx2" is ggml's portable x86 build (-DGGML_NATIVE=OFF: AVX, AVX2, FMA, F16C and
# BMI2, no AVX-512, no VNNI), the kernels an AVX2-only CPU such as a Zen 3 runs, runnable on any AVX2 host. On an
# AVX-512 machine it is the peer of our kernels forced to their AVX2 form (KERNEL_ISA=avx2): both sides on the
# same silicon in the ISA the older CPU has.
ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"], "avx2": ["-DGGML_NATIVE=OFF"]}


def build_dir(version: str = VERSION, isa: str = "native") -> str:
    """<cache root>/llamacpp-<version>-<cpu_tag()> for the native build, ``-<isa>`` for a portable one
    (``models/cache_dir.py``: $MINIBATCH_CACHE, else XDG, else ~/.cache)."""
    if isa not in ISA_FLAGS:
        raise SystemExit(f"unknown llama.cpp build {isa!r} (choose from {', '.join(ISA_FLAGS)})")
    return cache_subdir(f"llamacpp-{version}-{cpu_tag() if isa == 'native' else isa}")


# The binaries built beside each other; ``llama-server`` is copied last, so its presence means a finished build.
TARGETS = ("llama-quantize", "llama-server")
# What the sdist carries besides the C++ source, kept beside the binaries: llama.cpp's own HF -> GGUF converter and
# its PEFT-adapter twin, the `conversion` package and the gguf-py they import (the way users' GGUF files are made).
CONVERTER_FILES = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion", "gguf-py")


def binary_path(version: str = VERSION, name: str = "llama-server", isa: str = "native") -> str | None:
    """A built binary (``llama-server`` or ``llama-quantize``) of build ``isa`` (``ISA_FLAGS``), or None when it
    has not been built on this machine."""
    path = os.path.join(build_dir(version, isa), name)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def converter_dir(version: str = VERSION) -> str | None:
    """The directory holding the vendored converter (every one of ``CONVERTER_FILES``), or None if not there."""
    path = os.path.join(build_dir(version), "converter")
    return path if all(os.path.exists(os.path.join(path, name)) for name in CONVERTER_FILES) else None


def ensure_converter(version: str = VERSION) -> str:
    """``converter_dir()``, extracting the converter from the sdist first (``pip download``; no build) when it is
    missing or incomplete (a build by an older version of this script kept no ``conversion`` package)."""
    found = converter_dir(version)
    if found is not None:
        return found
    out_dir = build_dir(version)
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="converter-", dir=out_dir)
    try:
        keep_converter(extract_llamacpp(download_sdist(work, version), work), out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return os.path.join(out_dir, "converter")


SENTENCEPIECE = "sentencepiece==0.2.3"  # what the converter reads a SentencePiece tokenizer.model with


def ensure_sentencepiece(version: str = VERSION) -> str:
    """A directory holding the ``sentencepiece`` package (``pip install --target``, once), for the converter's
    process only: put on ``sys.path`` where a checkpoint has a SentencePiece ``tokenizer.model`` (Gemma, Phi-3).
    Not installed in the environment, because its wheel carries a libgomp of its own, which ``import gguf`` would
    then map beside torch's in every serving and test process."""
    out = os.path.join(build_dir(version), SENTENCEPIECE.replace("==", "-"))
    if os.path.isdir(os.path.join(out, "sentencepiece")):
        return out
    os.makedirs(build_dir(version), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="sentencepiece-", dir=build_dir(version))
    try:
        _run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet",
              "--target", tmp, SENTENCEPIECE])  # fmt: skip
        try:
            os.replace(tmp, out)
        except OSError:  # another process put it there meanwhile
            if not os.path.isdir(os.path.join(out, "sentencepiece")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def keep_converter(source: str, out_dir: str) -> None:
    """Copy ``CONVERTER_FILES`` from the llama.cpp source tree into ``out_dir/converter`` (replaced whole)."""
    converter = os.path.join(out_dir, "converter")
    tmp = converter + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in CONVERTER_FILES:
        copy = shutil.copytree if os.path.isdir(os.path.join(source, name)) else shutil.copy2
        copy(os.path.join(source, name), os.path.join(tmp, name))
    shutil.rmtree(converter, ignore_errors=True)
    os.replace(tmp, converter)


def _run(cmd: list[str], cwd: str | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed (exit {proc.returncode})")


def download_sdist(work_dir: str, version: str) -> str:
    """``pip download`` the sdist alone (nothing is installed); returns the path of the .tar.gz."""
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "--quiet",
            f"{PACKAGE}=={version}",
            "-d",
            work_dir,
        ]
    )
    found = glob.glob(os.path.join(work_dir, "*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download of {PACKAGE}=={version} produced no sdist")
    return found[0]


def extract_llamacpp(sdist: str, work_dir: str) -> str:
    """Unpack the sdist; returns the vendored llama.cpp source directory."""
    with tarfile.open(sdist) as tar:
        tar.extractall(work_dir, filter="data")
    found = glob.glob(os.path.join(work_dir, "*", "vendor", "llama.cpp", "CMakeLists.txt"))
    if not found:
        raise SystemExit(f"{os.path.basename(sdist)} has no vendor/llama.cpp/CMakeLists.txt")
    return os.path.dirname(found[0])


def build(version: str, jobs: int, isa: str = "native") -> str:
    """Configure and build ``TARGETS`` with ``ISA_FLAGS[isa]``, keep the converter; returns the installed
    ``llama-server``'s path."""
    out_dir = build_dir(version, isa)
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="build-", dir=out_dir)
    source = extract_llamacpp(download_sdist(work, version), work)
    cmake_build = os.path.join(work, "build")
    _run(
        [
            "cmake",
            "-S",
            source,
            "-B",
            cmake_build,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            *ISA_FLAGS[isa],
        ]
    )
    _run(["cmake", "--build", cmake_build, "--target", *TARGETS, "--config", "Release", "-j", str(jobs)])
    keep_converter(source, out_dir)
    for target in TARGETS:
        built = glob.glob(os.path.join(cmake_build, "bin", target))
        if not built:
            raise SystemExit(f"the build finished but {cmake_build}/bin/{target} is missing")
        tmp = os.path.join(out_dir, f"{target}.tmp")
        shutil.copy2(built[0], tmp)
        os.replace(tmp, os.path.join(out_dir, target))
    shutil.rmtree(work, ignore_errors=True)
    return os.path.join(out_dir, "llama-server")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default=VERSION, help=f"{PACKAGE} version whose vendored llama.cpp to build")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    ap.add_argument("--print", action="store_true", help="print the binary's path if built, else exit 1")
    ap.add_argument("--converter", action="store_true", help="only extract the converter (no build); print its dir")
    ap.add_argument(
        "--isa",
        choices=list(ISA_FLAGS),
        default="native",
        help="native: -march=native (the default, what --systems llamacpp runs); avx2: ggml's portable AVX2 build, "
        "an AVX2-only CPU's kernels (--systems llamacpp:isa=avx2)",
    )
    args = ap.parse_args()
    if args.converter:
        print(ensure_converter(args.version))
        return
    path = binary_path(args.version, isa=args.isa)
    if path is None and args.print:
        print(f"llama-server ({args.isa}) is not built yet: run python {sys.argv[0]} --isa {args.isa}", file=sys.stderr)
        raise SystemExit(1)
    if path is None:
        path = build(args.version, args.jobs, args.isa)
    print(path)


if __name__ == "__main__":
    main()
