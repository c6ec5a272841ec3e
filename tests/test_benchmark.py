"""The benchmark script runs end to end in --quick mode and writes valid JSON and plots (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.model


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--quick", "--timeout", "300", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_quick_seed_benchmark_writes_json_for_every_system(tiny_model_dir, tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    proc = bench("--model", tiny_model_dir, "--workload", "seed", "--json", str(out), "--plot", str(plots))
    data = json.loads(out.read_text())
    assert data["model"] == tiny_model_dir and "machine" in data and data["quick"] is True
    seed = data["results"]["seed"]
    assert set(seed) == {"static_hf", "hf_cb", "ours"}
    for name, r in seed.items():
        if r.get("failed"):  # a peer may fail; it must say why, and ours must not
            assert name != "ours" and r["error"], r
            continue
        assert r["tokens"] > 0
        assert r["tokens_per_s"] > 0 and r["requests"] == 8 and r["capacity"] == 8
        lat = r["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
        assert 0 < r["ttft_ms"]["p50"] <= lat["p99"] and r["peak_rss_mb"] > 0
    ours = seed["ours"]
    # Every request delivers exactly its budget (EOS ignored): the same token total for every system.
    for r in seed.values():
        if not r.get("failed"):
            assert r["tokens"] == ours["tokens"]
    overhead = ours["overhead"][0]
    assert overhead["engine_step_ms"] > 0 and overhead["bare_step_ms"] > 0 and 0 < overhead["roofline_fraction"]
    assert ours["machine_peaks"]["matmul_gflops"] > 0
    kernels = ours["linear_kernels"]
    assert [k["rows"] for k in kernels] == [1, 8] and all(k["onednn_gb_s"] > 0 for k in kernels)
    if small_gemm_builds():
        assert all(k["small_gemm_gb_s"] > 0 for k in kernels)
    assert "weights streamed per second through every linear" in proc.stdout
    assert (plots / "latency_cdf_seed.png").stat().st_size > 1000
    assert "== workload seed ==" in proc.stdout and "ours" in proc.stdout


def test_quick_sweep_plots_throughput_vs_capacity(tiny_model_dir, tmp_path):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    bench(
        "--model", tiny_model_dir, "--workload", "sweep", "--systems", "ours", "--json", str(out), "--plot", str(plots)
    )
    sweep = json.loads(out.read_text())["results"]["sweep"]["ours"]
    assert set(sweep) == {"1", "2"} and all(v["tokens_per_s"] > 0 for v in sweep.values())
    assert sweep["1"]["capacity"] == 1 and sweep["2"]["capacity"] == 2
    assert (plots / "throughput_vs_capacity.png").stat().st_size > 1000


def small_gemm_builds() -> bool:
    from models.kernels import small_gemm

    return small_gemm.load() is not None


def test_quick_benchmark_of_a_quantized_engine_beside_a_missing_llamacpp(tiny_model_dir, tmp_path):
    """ours:int8 streams packed int8 weights; llamacpp on a non-GGUF model (or unbuilt) fails saying why."""
    out = tmp_path / "bench.json"
    proc = bench("--model", tiny_model_dir, "--workload", "seed", "--systems", "ours:int8,llamacpp", "--json", str(out))
    seed = json.loads(out.read_text())["results"]["seed"]
    ours = seed["ours:int8"]
    assert not ours.get("failed") and ours["tokens_per_s"] > 0 and ours["config"]["weights"] == "int8"
    assert set(ours["config"]["resident_weight_mb"]) >= {"int8"}
    assert [k["rows"] for k in ours["linear_kernels"]] == [1, 8]
    assert all(k["quant_gemm_gb_s"] > 0 and k["fmt"] == "int8" for k in ours["linear_kernels"])
    assert seed["llamacpp"]["failed"] and (
        "llama-server" in seed["llamacpp"]["error"] or ".gguf" in seed["llamacpp"]["error"]
    )
    assert "quant_gemm (int8)" in proc.stdout
