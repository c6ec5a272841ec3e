"""Server processes the benchmark starts (llama-server, ``python server.py``): a free port, a log file, a bounded
wait until the server answers, its peak RSS, and stopping it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from . import ROOT


def _log_path(name: str) -> str:
    """<repo>/weights/<name>, the directory made first (a fresh checkout has none)."""
    os.makedirs(os.path.join(ROOT, "weights"), exist_ok=True)
    return os.path.join(ROOT, "weights", name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_handles(proc: subprocess.Popen, log_file, stop_timeout: float):
    """(peak_rss_mb(), stop()) of a server process we started: its own VmHWM; SIGTERM, then SIGKILL."""

    def peak_rss_mb() -> float:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()

    return peak_rss_mb, stop


def start_llama_server(cmd: list[str], health_url: str, log_path: str, repack: str, timeout: float = 120):
    """Start llama-server (``cmd``) and wait until ``health_url`` answers (the model loaded) -> (process, its log
    file, whether it repacks weights). ``repack`` "off" adds ``--no-repack``; "auto" starts it repacking and, when
    the server dies by itself before it is ready, once more with ``--no-repack`` (saying so)."""
    if repack not in ("on", "off", "auto"):
        raise ValueError(f"llamacpp:repack must be on, off or auto (got {repack!r})")
    repacked = repack != "off"
    while True:
        log_file = open(log_path, "w")
        proc = subprocess.Popen(cmd if repacked else [*cmd, "--no-repack"], stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, health_url, timeout, log_path, "llama-server")
            return proc, log_file, repacked
        except RuntimeError:
            log_file.close()
            crashed = proc.wait() not in (0, -signal.SIGKILL)  # died by itself, not killed at the deadline
            if not (crashed and repacked and repack == "auto"):
                raise
            repacked = False
            print(f"llama-server died while starting (exit {proc.returncode}); again with --no-repack", flush=True)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: str, name: str) -> None:
    """Bounded wait for a server we started to answer 200 at ``url``; it is killed if it does not."""
    import urllib.request

    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not become ready (see {log_path})")
        time.sleep(0.5)
