"""The benchmark script runs end to end in --quick mode and writes valid JSON and plots (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.model


def bench(*args: str) -> subprocess.CompletedProcess:
    # As a module from ROOT: the run imports this checkout's files, whichever checkout the environment installed.
    cmd = [sys.executable, "-m", "scripts.benchmark", "--quick", "--timeout", "300", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_quick_seed_benchmark_writes_json_for_every_system(tiny_model_dir, tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    proc = bench("--model", tiny_model_dir, "--workload", "seed", "--json", str(out), "--plot", str(plots))
    data = json.loads(out.read_text())
    assert data["model"] == tiny_model_dir and "machine" in data and data["quick"] is True
    assert all(" UTC, load average " in data["load"][k] for k in ("started", "ended"))
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
    assert [k["rows"] for k in kernels] == [1, 8]
    # The kernel the fp32 linears run on (their one copy): small_gemm's panels where it builds, else oneDNN.
    key = "small_gemm_gb_s" if small_gemm_builds() else "onednn_gb_s"
    assert all(k[key] > 0 for k in kernels)
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


def test_quick_timed_workloads_memory_and_decode_step(tiny_model_dir, tmp_path):
    """The workloads with arrival times and dependencies, the memory rows and the decode-step comparison, in
    their quick forms on ours: ITL and per-group fields present, the single user's requests never overlap,
    every later turn starts after its conversation's previous one ended."""
    out = tmp_path / "timed.json"
    workloads = "single,multi-turn,long-prompt,memory,decode-step"
    proc = bench("--model", tiny_model_dir, "--workload", workloads, "--systems", "ours", "--json", str(out))
    res = json.loads(out.read_text())["results"]
    for w in ("single", "multi-turn", "long-prompt"):
        r = res[w]["ours"]
        assert not r.get("failed"), r
        assert 0 <= r["itl_ms"]["p50"] <= r["itl_ms"]["p95"] <= r["itl_ms"]["max"], r["itl_ms"]
    single = res["single"]["ours"]["timeline"]
    assert len(single) == 4 and all(a[2] <= b[0] for a, b in zip(single, single[1:])), single
    turns = res["multi-turn"]["ours"]
    line, by_tag = turns["timeline"], turns["by_tag"]
    assert all(line[c][2] <= line[c + 4][0] for c in range(4)), line  # quick: 4 conversations x 2 turns
    assert by_tag["turn2"]["prompt_tokens_mean"] > by_tag["turn1"]["prompt_tokens_mean"] + 8  # history resent
    longp = res["long-prompt"]["ours"]
    assert len(longp["by_tag"]["stream"]["max_itl_ms"]) == 8 and longp["by_tag"]["long"]["requests"] == 4
    assert all(start >= 0.2 for start, _, _ in longp["timeline"][8:])  # the long prompts' arrival times
    assert "streams' max inter-token latency" in proc.stdout
    (mem,) = res["memory"]["ours"].values()  # quick: 8 sequences only
    assert mem["capacity"] == 8 and mem["peak_rss_mb"] > 0 and mem["config"]["kv_pool_mib"] == 512
    assert mem["config"]["per_slot_reservation_mib"] > 0 and mem["run_stats"]["kv_peak_used_mib"] > 0
    rows = res["decode-step"]["rows"]
    ours = [r for r in rows if r["tree"] == "ours"]
    assert [r["context"] for r in ours] == [16, 48] and all(r["step_ms"] > 0 and r["batch"] == 8 for r in ours)
    prev = [r for r in rows if r["tree"] == "prev"]
    assert prev and all(r.get("skipped") or r["step_ms"] > 0 for r in prev), prev  # skipped without git history


class ByteTokenizer:
    """Bytes as token ids; no chat template (workloads render system + user as plain text)."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


def test_drive_honors_arrival_times_dependencies_and_continued_turns():
    """The one request driver every system shares, on a fake system that answers after a fixed delay."""
    import asyncio

    from scripts.bench.systems import parse_system, unsupported
    from scripts.bench.workloads import build_workload, drive, slot_context

    def fake_send(delay: float):
        async def send(r, prompt):
            times = []
            for _ in range(r.max_new_tokens):
                await asyncio.sleep(delay)
                times.append(time.perf_counter())
            return [i % 200 + 1 for i in range(r.max_new_tokens)], times

        return send

    tok = ByteTokenizer()
    single = build_workload("single", tok, 0, True)
    out = asyncio.run(drive(single.requests, fake_send(0.002)))
    assert all(a["end"] <= b["start"] for a, b in zip(out, out[1:])) and all(r["tokens"] == 8 for r in out)
    assert all(len(r["token_times"]) == 8 and r["first"] == r["token_times"][0] for r in out)

    longp = build_workload("long-prompt", tok, 0, True)
    out = asyncio.run(drive(longp.requests, fake_send(0.001)))
    for req, r in zip(longp.requests, out):
        assert r["start"] >= req.arrival and r["tag"] == req.tag

    turns = build_workload("multi-turn", tok, 0, True)
    out = asyncio.run(drive(turns.requests, fake_send(0.001)))
    for i, req in enumerate(turns.requests):
        if req.continues:  # the previous turn's prompt and its 8 output tokens, then its own
            prev = out[req.after]
            assert out[i]["prompt_tokens"] == prev["prompt_tokens"] + 8 + len(req.prompt_ids)
            assert out[i]["start"] >= prev["end"]
    assert slot_context(turns.requests) >= max(r["prompt_tokens"] + 8 for r in out)

    # Who can express what: timed workloads skip static batches and hf_cb, with a reason.
    assert unsupported("ours", longp) is None and unsupported("llamacpp", turns) is None
    assert unsupported("static_hf", single) is None  # one at a time, in turn: batches of 1 do that
    assert "n/a" in unsupported("static_hf", longp) and "n/a" in unsupported("hf_cb", single)
    assert "n/a" in unsupported("static_hf", build_workload("memory", tok, 0, True, 8))
    assert parse_system("ours:budget=0:prefix=off") == ("ours", {"budget": "0", "prefix": "off"})
    assert parse_system("ours:int8") == ("ours", {"weights": "int8"})
    assert parse_system("ours:int8:isa=avx2") == ("ours", {"weights": "int8", "isa": "avx2"})
    assert parse_system("ours:lmin=1:lmax=6") == ("ours", {"lmin": "1", "lmax": "6"})
    assert parse_system("llamacpp:cache=on") == ("llamacpp", {"cache": "on"})
    assert parse_system("llamacpp:isa=avx2") == ("llamacpp", {"isa": "avx2"})
    with pytest.raises(SystemExit):
        parse_system("hf_cb:budget=0")


def test_ours_env_sets_knobs_through_config_from_env():
    """ours' options reach Config the way the server's do (PREFIX_CACHING included, once config.py has it)."""
    from config import Config
    from scripts.bench.systems import ours_env
    from scripts.bench.workloads import build_workload

    tok = ByteTokenizer()
    env = ours_env(build_workload("long-prompt", tok, 0, True), "", "auto", {"budget": "128", "prefix": "off"})
    assert env["MAX_NUM_BATCHED_TOKENS"] == "128" and env["PREFIX_CACHING"] == "false"
    cfg = Config.from_env({**env, "MODEL_ID": "fake"})
    assert cfg.max_num_batched_tokens == 128 and cfg.max_batch_size == 12 and cfg.max_model_len == 264
    # a draft model (ours:draft=PATH) drafts unless the system says otherwise; draft=N truncates the served GGUF
    copy = build_workload("copy", tok, 0, True)
    env = ours_env(copy, "", "auto", {"draft": "/models/draft.gguf"})
    assert env["SPECULATIVE_METHOD"] == "draft_model" and env["SPECULATIVE_MODEL"] == "/models/draft.gguf"
    assert ours_env(copy, "", "auto", {"draft": "/d.gguf", "spec": "off"})["SPECULATIVE_METHOD"] == "off"
    with pytest.raises(SystemExit, match="GGUF"):
        ours_env(copy, "", "auto", {"draft": "8"})


def small_gemm_builds() -> bool:
    from models.kernels import small_gemm

    return small_gemm.load() is not None


def test_quick_benchmark_of_a_quantized_engine_beside_a_missing_llamacpp(tiny_model_dir, tmp_path):
    """ours:int8 streams Q8_0 blocks, on the native runtime (RUNTIME=auto) and on torch, where the linears'
    kernel rates are measured too; llamacpp on a non-GGUF model (or unbuilt) fails saying why."""
    out = tmp_path / "bench.json"
    systems = "ours:int8,ours:int8:runtime=torch,llamacpp"
    proc = bench("--model", tiny_model_dir, "--workload", "seed", "--systems", systems, "--json", str(out))
    seed = json.loads(out.read_text())["results"]["seed"]
    native, ours = seed["ours:int8"], seed["ours:int8:runtime=torch"]
    for r, engine in ((native, "NativeEngine"), (ours, "HFEngine")):
        assert not r.get("failed") and r["tokens_per_s"] > 0 and r["config"]["weights"] == "int8"
        assert set(r["config"]["resident_weight_mb"]) >= {"Q8_0"} and r["config"]["engine"].startswith(engine)
    assert [k["rows"] for k in ours["linear_kernels"]] == [1, 8]
    assert all(k["quant_gemm_gb_s"] > 0 and k["fmt"] == "Q8_0" for k in ours["linear_kernels"])
    assert seed["llamacpp"]["failed"] and (
        "llama-server" in seed["llamacpp"]["error"] or ".gguf" in seed["llamacpp"]["error"]
    )
    assert "quant_gemm (Q8_0)" in proc.stdout


def _fake_llama_server(path, behaviour: str) -> str:
    """A stand-in llama-server: "segv" dies by SIGSEGV while starting unless given --no-repack (as the real one did
    on an AVX-512 VM), then answers /health; "hang" never answers. Each start appends its arguments to
    ``<path>.starts``."""
    path.write_text(
        f"""#!{sys.executable}
import http.server, os, signal, sys, time
with open({str(path) + ".starts"!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
if {behaviour!r} == "hang":
    time.sleep(60)
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
    )
    path.chmod(0o755)
    return str(path)


def test_a_llama_server_dying_while_repacking_is_started_again_without(tmp_path):
    """llamacpp:repack=auto (the default) restarts a server that died by itself while starting, with --no-repack,
    and says so in its config; repack=on reports the failure; a server that never answers is not restarted."""
    from scripts.bench.servers import _free_port, start_llama_server

    port = _free_port()
    cmd, url = [_fake_llama_server(tmp_path / "segv", "segv"), "--port", str(port)], f"http://127.0.0.1:{port}/health"
    with pytest.raises(RuntimeError, match="llama-server did not become ready"):
        start_llama_server(cmd, url, str(tmp_path / "on.log"), "on", timeout=30)
    starts = tmp_path / "segv.starts"
    for repack, started in (("auto", 3), ("off", 4)):  # on: 1 start; auto: 2 more (the second --no-repack); off: 1
        proc, log_file, repacked = start_llama_server(cmd, url, str(tmp_path / f"{repack}.log"), repack, timeout=30)
        try:
            assert not repacked and proc.args[-1] == "--no-repack" and proc.poll() is None
            assert len(starts.read_text().splitlines()) == started
        finally:
            proc.terminate()
            proc.wait(10)
            log_file.close()
    hang = [_fake_llama_server(tmp_path / "hang", "hang"), "--port", str(port)]
    with pytest.raises(RuntimeError, match="did not become ready"):
        start_llama_server(hang, url, str(tmp_path / "hang.log"), "auto", timeout=1.5)
    assert (tmp_path / "hang.starts").read_text().count("\n") == 1  # killed at its deadline, not started again
    with pytest.raises(ValueError, match="repack must be on, off or auto"):
        start_llama_server(cmd, url, str(tmp_path / "x.log"), "maybe")


def _cpuinfo(path, *processors: tuple[str, str]) -> str:
    """A /proc/cpuinfo with one (model name, flags) block per processor."""
    path.write_text(
        "\n\n".join(f"processor\t: {i}\nmodel name\t: {m}\nflags\t\t: {f}" for i, (m, f) in enumerate(processors))
    )
    return str(path)


def test_llamacpp_builds_are_kept_per_kind_of_cpu(tmp_path, monkeypatch):
    """A native llama-server build (-march=native) is cached under its CPU's tag: another instruction set or model
    means another directory, so a cache shared between machines never hands an AVX-512 binary to an AVX2 one."""
    from scripts.build_llamacpp import VERSION, binary_path, build_dir, cpu_tag

    xeon = cpu_tag(_cpuinfo(tmp_path / "a", ("Xeon", "fma avx2 avx512f"), ("Xeon", "fma")))
    assert len(xeon) == 10
    assert cpu_tag(_cpuinfo(tmp_path / "b", ("Xeon", "avx512f avx2 fma"))) == xeon  # flag order does not matter
    assert cpu_tag(_cpuinfo(tmp_path / "m", ("Xeon", "fma md_clear avx2 hypervisor avx512f"))) == xeon  # not ISA
    assert cpu_tag(_cpuinfo(tmp_path / "c", ("Xeon", "fma avx2"))) != xeon
    assert cpu_tag(_cpuinfo(tmp_path / "d", ("EPYC", "fma avx2 avx512f"))) != xeon
    assert len(cpu_tag(str(tmp_path / "missing"))) == 10  # no /proc/cpuinfo: what platform reports

    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "cache"))
    assert build_dir() == str(tmp_path / "cache" / f"llamacpp-{VERSION}-{cpu_tag()}")
    assert binary_path() is None
    os.makedirs(build_dir())
    server = os.path.join(build_dir(), "llama-server")
    with open(server, "w") as f:
        f.write("#!/bin/sh\n")
    assert binary_path() is None  # not executable: not a finished build
    os.chmod(server, 0o755)
    assert binary_path() == server
    # the portable AVX2 build (an AVX2-only CPU's kernels) lies beside it, under its ISA's name, not the CPU's
    assert build_dir(isa="avx2") == str(tmp_path / "cache" / f"llamacpp-{VERSION}-avx2")
    assert binary_path(isa="avx2") is None
    with pytest.raises(SystemExit, match="unknown llama.cpp build 'avx9'"):
        build_dir(isa="avx9")


# --- the model's cost model (what the roofline asks), against a direct count of the checkpoint's weights ---
# Bytes per weight by the formats' own definitions (GGUF): Q8_0 = 32 int8 + one fp16 scale per 32 weights,
# Q4_1 = 32 nibbles + fp16 scale and min per 32, held as the blocks themselves (no padding). fp32 held as
# small_gemm panels pads its rows to panels of 8.
BYTES_PER_WEIGHT = {"fp32": 4, "Q8_0": 34 / 32, "Q4_1": 20 / 32}
SERVED_AS = {"fp32": "fp32", "int8": "Q8_0", "int4": "Q4_1"}  # WEIGHTS -> the format the weights are held in


@pytest.fixture(scope="module")
def tiny_llama_untied_dir(tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("llama_cost")), arch="llama", seed=2, tied=False)


def direct_linear_shapes(hf_model) -> list[tuple[int, ...]]:
    """Shapes of the weights the linears multiply by, from the HF state dict: every 2-D weight but the
    embedding tables, plus the lm_head's (the token table again when tied)."""
    sd = hf_model.state_dict()
    tables = ("wte.weight", "wpe.weight", "embed_tokens.weight")
    shapes = [tuple(v.shape) for k, v in sd.items() if v.ndim == 2 and not k.endswith(tables) and k != "lm_head.weight"]
    return shapes + [tuple(hf_model.get_output_embeddings().weight.shape)]


def direct_bytes(shapes: list[tuple[int, ...]], fmt: str, panels: bool) -> float:
    """Bytes of ``shapes`` in ``fmt``. Every tiny width is a multiple of 32 (so GPT-2's [in, out] Conv1D
    orientation does not matter) except the vocab: only the lm_head [V, C] of fp32 small_gemm panels (``panels``)
    pads its rows to a panel of 8."""
    *blocks, (vocab, width) = shapes
    assert all(a % 32 == 0 and b % 32 == 0 for a, b in blocks) and width % 32 == 0
    rows = -(-vocab // 8) * 8 if panels and fmt == "fp32" else vocab
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
    held = SERVED_AS[fmt]
    assert model.weight_bytes() == {held: direct_bytes(shapes, held, model.small_gemm)}
    # A step streams the one copy of each weight; what is held is that plus the tables no linear holds.
    tables = [t for t in model.embedding_tables() if t is not model.lm_head.table()]
    table_bytes = sum(t.nbytes for t in tables)
    assert sum(model.resident_weights().values()) == sum(model.weight_bytes().values()) + table_bytes


def test_static_baseline_pads_with_hf_baseline_and_ours_ray_calls_bench_ray():
    """The benchmark's static batches use models.hf_baseline's padding; ours_ray is deploy/bench_ray.py's code (no
    copy). Import-level only: starting Ray is slow, ``--systems ours_ray`` exercises it."""
    import importlib.util

    from deploy import bench_ray
    from models.hf_baseline import left_pad
    from scripts.bench import systems, workloads

    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)  # [2, 3] each, right-aligned
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert systems.parse_system("ours_ray") == ("ours_ray", {})
    assert (systems.ray_missing() is None) == (importlib.util.find_spec("ray") is not None)
    assert bench_ray.PROMPT_TEXTS is workloads.PROMPT_TEXTS
    for name in ("direct_server", "ray_fleet", "interleaved", "proxy_overhead", "print_table"):
        assert callable(getattr(bench_ray, name))


def test_scale_models_are_named_shape_and_type(tmp_path, monkeypatch):
    """``--model llama-1b:Q4_K_M``: a Llama-3.2-1B-shaped file made once by llama.cpp's tools (bench/scale_model.py).
    The name parses (type case-insensitive, Q4_K_M by default), an unknown type stops with the choices, other model
    names are not scale models, and the cache key follows the recipe (shape, seed, llama.cpp version)."""
    from scripts.bench import scale_model

    assert scale_model.parse("llama-1b:q8_0") == ("llama-1b", "Q8_0")
    assert scale_model.parse("llama-1b") == ("llama-1b", "Q4_K_M")
    assert scale_model.parse("distilgpt2") is None and scale_model.parse("weights/x.gguf") is None
    with pytest.raises(SystemExit, match="Q4_K_M"):
        scale_model.parse("llama-1b:Q9_9")
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    first = scale_model.model_dir("llama-1b")
    assert first.startswith(str(tmp_path / "bench-models" / "llama-1b-"))
    monkeypatch.setitem(scale_model.SHAPES, "llama-1b", {**scale_model.SHAPES["llama-1b"], "num_hidden_layers": 2})
    assert scale_model.model_dir("llama-1b") != first
    shape = scale_model.SHAPES["llama-1b"]
    assert (shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"]) == (2048, 8192, 8)
    # the released models of the other families (issue 27): their tensor shapes; Gemma with a SentencePiece vocabulary
    released = {"qwen2.5-0.5b": (896, 4864, 2, 151936), "qwen3-0.6b": (1024, 3072, 8, 151936)}
    released["gemma-3-1b"] = (1152, 6912, 1, 262144)
    for name, dims in released.items():
        shape = scale_model.SHAPES[name]
        assert (
            shape["hidden_size"],
            shape["intermediate_size"],
            shape["num_key_value_heads"],
            shape["vocab_size"],
        ) == dims
        assert scale_model.parse(f"{name}:q8_0") == (name, "Q8_0")
    assert scale_model.TOKENIZERS == {"gemma-3-1b": "spm-gemma"}


# --- the kernel roofline (python -m scripts.bench.roofline): its reference reader and its paired rates ---


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stream_read_sums_every_byte_of_ragged_sizes(threads):
    import numpy as np

    from scripts.bench import roofline

    read = roofline.stream_reader()
    rng = np.random.default_rng(threads)
    for n in (0, 1, 127, 128, 129, 4096 + 77, 3 * 2**20 + 5):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert read(data.ctypes.data, n, threads) == int(data.sum(dtype=np.uint64)), n
    assert roofline.read_bandwidth(threads, mib=8, repeats=2) > 0


def test_weight_copies_outgrow_the_last_level_cache(tmp_path):
    from scripts.bench import roofline

    size = tmp_path / "size"
    size.write_text("491520K\n")  # a Xeon VM's 480 MiB L3
    assert roofline.cold_bytes(str(size)) == 960 * 2**20
    size.write_text("32768K\n")
    assert roofline.cold_bytes(str(size)) == 256 * 2**20
    size.write_text("2G\n")
    assert roofline.cold_bytes(str(size)) == 4 * 2**30
    assert roofline.cold_bytes(str(tmp_path / "missing")) == 256 * 2**20


def test_roofline_times_each_path_beside_a_read_of_the_same_copies(monkeypatch, tmp_path, capsys):
    from scripts.bench import roofline

    monkeypatch.setattr(roofline, "cold_bytes", lambda: 2**20)
    monkeypatch.setattr(roofline, "read_bandwidth", lambda threads: 1.0)
    out = tmp_path / "roofline.json"
    roofline.main(["--rows", "1,9", "--types", "Q4_K,F16", "--shapes", "64x512", "--rounds", "1", "--json", str(out)])
    rates = json.loads(out.read_text())["rates"]
    assert [(r["type"], r["rows"]) for r in rates] == [("Q4_K", 1), ("Q4_K", 9), ("F16", 1), ("F16", 9)]
    for r in rates:
        q4_k = {"fp32", "int8_panel", "int8_rows", "read", "int8_packed", "read_packed"}  # Q4_K packs (int_packed.c)
        paths = q4_k if r["type"] == "Q4_K" else {"fp32", "read"}
        assert {k[: -len("_gb_s")] for k in r if k.endswith("_gb_s")} == paths
        assert all(r[f"{p}_gb_s"] > 0 for p in paths)
    lines = capsys.readouterr().out.splitlines()
    assert "read" in lines[1].split() and lines[1].endswith("of read") and len(lines) == 2 + len(rates)
