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


# --- the model's cost model (what the roofline asks), against a direct count of the checkpoint's weights ---
# Bytes per weight by the formats' own definitions (GGUF): Q8_0 = 32 int8 + one fp16 scale per 32 weights,
# Q4_1 = 32 nibbles + fp16 scale and min per 32. Packed, a quantized weight's rows are padded to panels of 8
# and its inputs to groups of 32 (quant_gemm.c's layout).
BYTES_PER_WEIGHT = {"fp32": 4, "int8": 34 / 32, "int4": 20 / 32}


@pytest.fixture(scope="module")
def tiny_llama_untied_dir(tmp_path_factory) -> str:
    from make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("llama_cost")), arch="llama", seed=2, tied=False)


def direct_linear_shapes(hf_model) -> list[tuple[int, ...]]:
    """Shapes of the weights the linears multiply by, from the HF state dict: every 2-D weight but the
    embedding tables, plus the lm_head's (the token table again when tied)."""
    sd = hf_model.state_dict()
    tables = ("wte.weight", "wpe.weight", "embed_tokens.weight")
    shapes = [tuple(v.shape) for k, v in sd.items() if v.ndim == 2 and not k.endswith(tables) and k != "lm_head.weight"]
    return shapes + [tuple(hf_model.get_output_embeddings().weight.shape)]


def direct_bytes(shapes: list[tuple[int, ...]], fmt: str) -> float:
    """Bytes of ``shapes`` in ``fmt``. Every tiny width is a multiple of 32 (so GPT-2's [in, out] Conv1D
    orientation does not matter) except the vocab: only the lm_head [V, C] pads its rows to a panel of 8."""
    *blocks, (vocab, width) = shapes
    assert all(a % 32 == 0 and b % 32 == 0 for a, b in blocks) and width % 32 == 0
    rows = vocab if fmt == "fp32" else -(-vocab // 8) * 8
    return (sum(a * b for a, b in blocks) + rows * width) * BYTES_PER_WEIGHT[fmt]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_cost_model_agrees_with_a_direct_count_of_the_weights(family, fmt, tiny_model_dir, tiny_llama_untied_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from models import families

    path = tiny_model_dir if family == "gpt2" else tiny_llama_untied_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = hf.config
    model = families()[cfg.model_type](hf, 2, 64, torch.device("cpu"), weights=fmt)
    shapes = direct_linear_shapes(hf)
    params = sum(a * b for a, b in shapes)
    n_layer = cfg.num_hidden_layers
    q_width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)  # H * D

    assert len(model.linears()) == 4 * n_layer + 1 and model.linears()[-1] is model.lm_head
    assert sum(lin.out_features * lin.in_features for lin in model.linears()) == params
    # 2 FLOPs per weight, plus q.K and att.V over the context: 4 * L * H * D per layer.
    assert model.flops_per_token(0) == 2 * params
    assert model.flops_per_token(100) - model.flops_per_token(0) == n_layer * 4 * 100 * q_width
    assert model.weight_bytes() == {fmt: direct_bytes(shapes, fmt)}
    # A step streams one copy of each weight; what is held can only be more (embeddings, a second fp32 copy).
    assert sum(model.resident_weights().values()) >= sum(model.weight_bytes().values())


def test_static_baseline_pads_with_model_runner_and_ours_ray_calls_bench_ray():
    """The benchmark's static batches use model_runner's padding; ours_ray is deploy/bench_ray.py's code (no copy).
    Import-level only: starting Ray is slow, ``--systems ours_ray`` exercises it."""
    import importlib.util

    from bench import systems, workloads

    from deploy import bench_ray
    from model_runner import left_pad

    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)  # [2, 3] each, right-aligned
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert systems.parse_system("ours_ray") == ("ours_ray", {})
    assert (systems.ray_missing() is None) == (importlib.util.find_spec("ray") is not None)
    assert bench_ray.PROMPT_TEXTS is workloads.PROMPT_TEXTS
    for name in ("direct_server", "ray_fleet", "interleaved", "proxy_overhead", "print_table"):
        assert callable(getattr(bench_ray, name))
