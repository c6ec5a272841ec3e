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


def _pcts(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}


def _gaps(r: dict) -> list[float]:
    """A request's inter-token gaps (seconds)."""
    t = r.get("token_times") or []
    return [b - a for a, b in zip(t, t[1:])]


def summarize(per_request: list[dict]) -> dict:
    """A run's figures from its per-request dicts (times in seconds from t0: start, first, end, token_times),
    given in the workload's order.
    Latency and TTFT count from each request's own start; inter-token latency (ITL) pools every gap between a
    request's consecutive tokens, where the system shows token times (else None)."""
    wall = max(r["end"] for r in per_request)
    tokens = sum(r["tokens"] for r in per_request)
    lat = [(r["end"] - r["start"]) * 1e3 for r in per_request]
    ttft = [(r["first"] - r["start"]) * 1e3 for r in per_request]
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in per_request if r["tokens"] > 1]
    gaps = [g * 1e3 for r in per_request for g in _gaps(r)]
    out = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_ms": {**_pcts(lat), "p99": percentile(lat, 0.99)},
        "ttft_ms": _pcts(ttft),
        "tpot_ms": _pcts(tpot),
        "itl_ms": {**_pcts(gaps), "max": max(gaps)} if gaps else None,
        "latencies_ms": sorted(lat),
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in per_request),
        # [start, first token, end] of each request in the workload's order, seconds from t0
        "timeline": [[round(r["start"], 4), round(r["first"], 4), round(r["end"], 4)] for r in per_request],
    }
    tags = sorted({r.get("tag", "") for r in per_request} - {""})
    if tags:
        out["by_tag"] = {tag: _tag_summary([r for r in per_request if r.get("tag") == tag]) for tag in tags}
    return out


def _tag_summary(reqs: list[dict]) -> dict:
    """One group's figures: TTFT and each request's worst inter-token gap (its longest stall)."""
    worst = [max(_gaps(r)) * 1e3 for r in reqs if len(r.get("token_times") or []) > 1]
    return {
        "requests": len(reqs),
        "ttft_ms": _pcts([(r["first"] - r["start"]) * 1e3 for r in reqs]),
        "prompt_tokens_mean": sum(r.get("prompt_tokens", 0) for r in reqs) / len(reqs),
        "max_itl_ms": [round(w, 1) for w in worst],
    }


def _ms(d: dict | None, key: str, width: int = 7, digits: int = 0) -> str:
    return f"{d[key]:>{width}.{digits}f}" if d else f"{'-':>{width}}"


def print_table(results: dict) -> None:
    base = results.get("static_hf", {}).get("tokens_per_s")
    cb = results.get("hf_cb", {}).get("tokens_per_s")
    lc = results.get("llamacpp", {}).get("tokens_per_s")
    width = max([10, *(len(n) for n in results)])
    head = (
        f"{'system':<{width}} {'tok/s':>7} {'x static':>8} {'x hf_cb':>7} {'x llama':>7} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} "
        f"{'TTFT50':>7} {'TTFT95':>7} {'TPOT50':>7} {'ITL50':>7} {'ITL95':>7} {'ITLmax':>7} {'RSS MB':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        if r.get("failed"):
            print(f"{name:<{width}} {'SKIPPED' if r.get('skipped') else 'FAILED'}: {r['error']}")
            continue
        if "systems" in r:  # ours_ray: its own table (print_ray)
            continue
        x_static = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        x_cb = f"{r['tokens_per_s'] / cb:.2f}" if cb else "-"
        x_lc = f"{r['tokens_per_s'] / lc:.2f}" if lc else "-"
        lat, ttft, tpot, itl = r["latency_ms"], r["ttft_ms"], r["tpot_ms"], r.get("itl_ms")
        print(
            f"{name:<{width}} {r['tokens_per_s']:>7.1f} {x_static:>8} {x_cb:>7} {x_lc:>7} "
            f"{lat['p50']:>7.0f} {lat['p95']:>7.0f} "
            f"{lat['p99']:>7.0f} {ttft['p50']:>7.0f} {ttft['p95']:>7.0f} {tpot['p50']:>7.1f} "
            f"{_ms(itl, 'p50', digits=1)} {_ms(itl, 'p95', digits=1)} {_ms(itl, 'max')} {r['peak_rss_mb']:>6.0f}"
        )


def print_long_prompt(results: dict) -> None:
    """Each stream's worst inter-token gap while the long prompts load, per system; the worst stall's ratio
    to the first system's (list chunked prefill off first: ``ours:budget=0,ours``)."""
    rows = [(n, r) for n, r in results.items() if not r.get("failed") and "stream" in r.get("by_tag", {})]
    if not rows:
        return
    print("\nstreams' max inter-token latency while 4 long prompts arrive (ms):")
    first = max(rows[0][1]["by_tag"]["stream"]["max_itl_ms"] or [float("nan")])
    for name, r in rows:
        worst = r["by_tag"]["stream"]["max_itl_ms"]
        ratio = first / max(worst) if worst and max(worst) else float("nan")
        budget = r.get("config", {}).get("max_num_batched_tokens", "-")
        longs = r["by_tag"].get("long", {}).get("ttft_ms", {})
        print(
            f"  {name:<22} budget {budget!s:>5}: worst {max(worst):7.0f}, median {percentile(worst, 0.5):7.0f}, "
            f"stall cut vs {rows[0][0]}: {ratio:5.2f}x; long prompts' TTFT p50 {longs.get('p50', float('nan')):.0f}; "
            f"per stream {[round(w) for w in worst]}"
        )


def print_by_turn(results: dict) -> None:
    """multi-turn: TTFT per turn (each turn resends the conversation so far)."""
    print("\nTTFT p50 / p95 per turn (ms), and the mean prompt length:")
    for name, r in results.items():
        if r.get("failed") or "by_tag" not in r:
            continue
        cells = [
            f"{tag}: {t['ttft_ms']['p50']:.0f} / {t['ttft_ms']['p95']:.0f} ({t['prompt_tokens_mean']:.0f} tok)"
            for tag, t in sorted(r["by_tag"].items())
        ]
        print(f"  {name:<22} " + "; ".join(cells))


def print_prefill(results: dict) -> None:
    """shared-prefix and multi-turn: prompt tokens sent and, where the engine counts them, computed."""
    for name, r in results.items():
        if r.get("failed") or "prompt_tokens" not in r:
            continue
        computed = r.get("run_stats", {}).get("prefill_tokens_computed")
        extra = f", prefill tokens computed {computed}" if computed is not None else ""
        print(f"  {name:<22} prompt tokens sent {r['prompt_tokens']}{extra}")


def print_spec(results: dict) -> None:
    """Speculative decoding, where a system drafted: draft tokens proposed and accepted in the median run, the
    acceptance rate, and (ours) the accepted drafts by position and the tokens per drafting step."""
    rows = [(n, r["run_stats"]["spec"]) for n, r in results.items() if r.get("run_stats", {}).get("spec")]
    rows = [(n, s) for n, s in rows if s.get("spec_num_draft_tokens")]
    if not rows:
        return
    print("\nspeculative decoding (median run): draft tokens proposed, accepted, acceptance rate")
    for name, s in rows:
        proposed, accepted = s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]
        line = f"  {name:<22} proposed {proposed:6d}, accepted {accepted:6d} ({accepted / proposed:5.1%})"
        if s.get("spec_num_drafts"):
            per_pos = [n for n in s.get("spec_accepted_per_pos", []) if n]
            each = s["spec_num_emitted_tokens"] / s["spec_num_drafts"]
            line += f"; {s['spec_num_drafts']} drafting steps emitted {each:.2f} tokens each"
            line += f"; accepted by position {per_pos}"
        if s.get("spec_draft_model_forwards"):  # what the draft model cost: its share of the run's wall time
            seconds = s["spec_draft_model_ms"] / 1000
            share = seconds / s["run_seconds"] if s.get("run_seconds") else 0.0
            line += (
                f"; draft model: {s['spec_draft_model_forwards']} forwards, {s['spec_draft_model_tokens']} tokens, "
                f"{seconds:.2f} s ({share:.0%} of the run)"
            )
        print(line)


def print_memory(results: dict) -> None:
    """memory: peak RSS and KV MiB per capacity against the old per-slot reservation."""
    caps = sorted({int(c) for sys_r in results.values() for c in sys_r})
    head = (
        f"{'system':<14} {'seqs':>5} {'peak RSS MB':>11} {'KV pool MiB':>11} {'KV used MiB':>11} {'per-slot MiB':>12}"
    )
    print(head)
    for name, by_cap in results.items():
        for c in caps:
            r = by_cap.get(str(c), {})
            if r.get("failed"):
                print(f"{name:<14} {c:>5} {'SKIPPED' if r.get('skipped') else 'FAILED'}: {r.get('error')}")
                continue
            cfg, stats = r.get("config", {}), r.get("run_stats", {})
            used = stats.get("kv_peak_used_mib")
            print(
                f"{name:<14} {c:>5} {r['peak_rss_mb']:>11.0f} {cfg.get('kv_pool_mib', float('nan')):>11.0f} "
                f"{used if used is not None else float('nan'):>11.0f} "
                f"{cfg.get('per_slot_reservation_mib', float('nan')):>12.0f}"
            )
    print("(per-slot: what the pre-pool engine reserved, capacity x MAX_MODEL_LEN tokens of KV)")


def print_decode_step(rows: list[dict]) -> None:
    """decode-step: our engine's step against the pre-pool (contiguous) engine's, same batch and contexts:
    the median step and the best one (the least disturbed by other load), and their ratios."""
    by = {(r["tree"], r["context"]): r for r in rows if not r.get("failed")}
    for r in rows:
        if r.get("failed"):
            print(f"  {r['tree']}: {'SKIPPED' if r.get('skipped') else 'FAILED'}: {r['error']}")
    print(
        f"{'context':>7} {'batch':>5} {'paged ms':>9} {'contig. ms':>10} {'paged/contig.':>13} "
        f"{'best paged':>10} {'best contig.':>12} {'best ratio':>10}"
    )
    for ctx in sorted({c for _, c in by}):
        ours, prev = by.get(("ours", ctx)), by.get(("prev", ctx))
        ratio = f"{ours['step_ms'] / prev['step_ms']:.3f}" if ours and prev else "-"
        best = f"{ours['step_ms_min'] / prev['step_ms_min']:.3f}" if ours and prev else "-"
        print(
            f"{ctx:>7} {(ours or prev)['batch']:>5} {_ms(ours, 'step_ms', 9, 1)} {_ms(prev, 'step_ms', 10, 1)} "
            f"{ratio:>13} {_ms(ours, 'step_ms_min', 10, 1)} {_ms(prev, 'step_ms_min', 12, 1)} {best:>10}"
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
    print(f"{'rows':>5} {'oneDNN':>8} {'small_gemm':>10}")  # the kernel the fp32 linears run on; the other: off
    for r in rates:
        onednn = f"{r['onednn_gb_s']:>8.1f}" if "onednn_gb_s" in r else f"{'off':>8}"
        small = f"{r['small_gemm_gb_s']:>10.1f}" if "small_gemm_gb_s" in r else f"{'off':>10}"
        print(f"{r['rows']:>5} {onednn} {small}")


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
        if w == "memory":
            print_memory(results[w])
            continue
        if w == "decode-step":
            print_decode_step(results[w]["rows"])
            continue
        print_table(results[w])
        if w == "long-prompt":
            print_long_prompt(results[w])
        if w == "multi-turn":
            print_by_turn(results[w])
        if w in ("shared-prefix", "multi-turn", "n-choices"):
            print_prefill(results[w])
        print_spec(results[w])
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
        if w in ("sweep", "memory", "decode-step"):
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
