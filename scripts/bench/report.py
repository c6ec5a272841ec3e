"""Report: per-request timings -> a run's summary; tables on stdout, the JSON file, the PNG plots."""

from __future__ import annotations

import json
import os


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(per_request: list[dict]) -> dict:
    wall = max(r["e2e"] for r in per_request)
    tokens = sum(r["tokens"] for r in per_request)
    lat = [r["e2e"] * 1e3 for r in per_request]
    ttft = [r["ttft"] * 1e3 for r in per_request]
    tpot = [(r["e2e"] - r["ttft"]) * 1e3 / (r["tokens"] - 1) for r in per_request if r["tokens"] > 1]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_ms": {"p50": percentile(lat, 0.5), "p95": percentile(lat, 0.95), "p99": percentile(lat, 0.99)},
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95)},
        "tpot_ms": {"p50": percentile(tpot, 0.5), "p95": percentile(tpot, 0.95)},
        "latencies_ms": sorted(lat),
    }


def print_table(results: dict) -> None:
    base = results.get("static_hf", {}).get("tokens_per_s")
    cb = results.get("hf_cb", {}).get("tokens_per_s")
    lc = results.get("llamacpp", {}).get("tokens_per_s")
    head = (
        f"{'system':<10} {'tok/s':>7} {'x static':>8} {'x hf_cb':>7} {'x llama':>7} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
        f"{'TTFT50':>7} {'TTFT95':>7} {'TPOT50':>7} {'TPOT95':>7} {'RSS MB':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        if r.get("failed"):
            print(f"{name:<10} {'SKIPPED' if r.get('skipped') else 'FAILED'}: {r['error']}")
            continue
        if "systems" in r:  # ours_ray: its own table (print_ray)
            continue
        x_static = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        x_cb = f"{r['tokens_per_s'] / cb:.2f}" if cb else "-"
        x_lc = f"{r['tokens_per_s'] / lc:.2f}" if lc else "-"
        lat, ttft, tpot = r["latency_ms"], r["ttft_ms"], r["tpot_ms"]
        print(
            f"{name:<10} {r['tokens_per_s']:>7.1f} {x_static:>8} {x_cb:>7} {x_lc:>7} "
            f"{lat['p50']:>7.0f} {lat['p95']:>7.0f} "
            f"{lat['p99']:>7.0f} {ttft['p50']:>7.0f} {ttft['p95']:>7.0f} {tpot['p50']:>7.1f} {tpot['p95']:>7.1f} "
            f"{r['peak_rss_mb']:>6.0f}"
        )


def print_overhead(ours: dict) -> None:
    peaks = ours["machine_peaks"]
    print(
        f"\nmachine peaks: fp32 matmul {peaks['matmul_gflops']:.0f} GFLOP/s, "
        f"copy bandwidth {peaks['copy_gb_s']:.1f} GB/s"
    )
    head = (
        f"{'batch':>5} {'context':>7} {'engine ms':>9} {'bare ms':>8} {'overhead':>8} {'GFLOP/s':>8} "
        f"{'weights GB/s':>12} {'roofline ms':>11} {'of roofline':>11}"
    )
    print(head)
    for o in ours["overhead"]:
        print(
            f"{o['batch']:>5} {o['context']:>7} {o['engine_step_ms']:>9.1f} {o['bare_step_ms']:>8.1f} "
            f"{o['overhead_pct']:>7.1f}% {o['bare_gflops']:>8.1f} {o['bare_weight_gb_s']:>12.1f} "
            f"{o['roofline_step_ms']:>11.1f} {o['roofline_fraction'] * 100:>10.0f}%"
        )


def print_linear_kernels(ours: dict) -> None:
    rates = ours.get("linear_kernels") or []
    if not rates:
        return
    print("\nweights streamed per second through every linear (GB/s), by rows per call:")
    if "quant_gemm_gb_s" in rates[0]:
        print(f"{'rows':>5} {'quant_gemm (' + rates[0]['fmt'] + ')':>18}")
        for r in rates:
            print(f"{r['rows']:>5} {r['quant_gemm_gb_s']:>18.1f}")
        return
    print(f"{'rows':>5} {'oneDNN':>8} {'small_gemm':>10}")
    for r in rates:
        small = f"{r['small_gemm_gb_s']:>10.1f}" if "small_gemm_gb_s" in r else f"{'off':>10}"
        print(f"{r['rows']:>5} {r['onednn_gb_s']:>8.1f} {small}")


def print_ray(ray: dict) -> None:
    """ours_ray: our HTTP server against Ray Serve with 1 and 2 replicas, measured side by side (bench_ray.py)."""
    from deploy import bench_ray

    cfg = ray["config"]
    print(f"\n-- ours_ray: {cfg['repeats']} interleaved rounds, {cfg['idle_probes']} idle probes per Ray system --")
    bench_ray.print_table(ray["systems"], os.path.basename(cfg["model"].rstrip("/")), cfg["cpus"])


def report(results: dict) -> None:
    """Every workload's tables on stdout."""
    for w in results:
        print(f"\n== workload {w} ==")
        if w == "sweep":
            print_sweep(results[w])
            continue
        print_table(results[w])
        for name, r in results[w].items():
            if name.startswith("ours") and "overhead" in r:
                print(f"\n-- {name} --")
                print_overhead(r)
                print_linear_kernels(r)
            elif "systems" in r:
                print_ray(r)


def write_json(path: str, results: dict, **header) -> None:
    """``header`` (model, note, machine, repeats, quick) and every result, indented."""
    with open(path, "w") as f:
        json.dump({**header, "results": results}, f, indent=2)


def print_sweep(results: dict) -> None:
    caps = sorted({int(c) for sys_r in results.values() for c in sys_r})
    print(f"{'tok/s at capacity':<18}" + "".join(f"{c:>8}" for c in caps))
    for name, by_cap in results.items():
        cells = []
        for c in caps:
            r = by_cap.get(str(c), {})
            cells.append(f"{'FAIL':>8}" if r.get("failed") else f"{r.get('tokens_per_s', float('nan')):>8.1f}")
        print(f"{name:<18}" + "".join(cells))


def _footnote(fig, note: str) -> None:
    """The model note under the axes (savefig's tight bbox grows the canvas to hold it)."""
    import textwrap

    fig.text(0.5, -0.02, textwrap.fill(note, 110), ha="center", va="top", fontsize=6)


def plot(results: dict, out_dir: str, note: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if "sweep" in results:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, by_cap in results["sweep"].items():
            pts = sorted((int(c), r["tokens_per_s"]) for c, r in by_cap.items() if not r.get("failed"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (max concurrent sequences)")
        ax.set_ylabel("delivered tokens/s")
        ax.set_title("Throughput vs capacity (sweep workload)")
        ax.grid(alpha=0.3)
        ax.legend()
        _footnote(fig, note)
        paths.append(os.path.join(out_dir, "throughput_vs_capacity.png"))
        fig.savefig(paths[-1], dpi=130, bbox_inches="tight")
        plt.close(fig)
    for w, res in results.items():
        if w == "sweep":
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, r in res.items():
            if not r.get("failed") and "latencies_ms" in r:
                lat = r["latencies_ms"]
                ax.step([x / 1e3 for x in lat], [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=name)
        ax.set_xlabel("request latency from t0 (s)")
        ax.set_ylabel("fraction of requests done")
        ax.set_title(f"Latency CDF ({w} workload)")
        ax.grid(alpha=0.3)
        ax.legend()
        _footnote(fig, note)
        paths.append(os.path.join(out_dir, f"latency_cdf_{w}.png"))
        fig.savefig(paths[-1], dpi=130, bbox_inches="tight")
        plt.close(fig)
    return paths
