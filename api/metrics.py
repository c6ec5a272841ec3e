"""Prometheus metrics (``GET /metrics``) and the one-line-per-request log. No torch.

Every app gets its own ``CollectorRegistry`` (tests build many apps in one process). Names carry
the ``minibatch:`` prefix, like vLLM's ``vllm:``. Three sources feed them:

* the scheduler's hooks: ``on_engine_call`` after every successful engine call (step time,
  batch size, tokens, inter-token latency) and ``on_resolved`` once per sequence (finish reason,
  queue time, TTFT, end-to-end latency from the sequence's own timestamps, and the log line);
* the HTTP layer: rejections by reason (``rejected``);
* gauges read at scrape time from the live state (running, waiting, KV usage, in flight, ...).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from scheduler import EngineCall

disable_created_metrics()  # no *_created series: one sample per counter, like vLLM

# Text exposition format 0.0.4 (OpenMetrics would rename the colon-prefixed families).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
REJECT_REASONS = (
    "auth",
    "too_large",
    "too_many_connections",
    "draining",
    "validation",
    "not_found",
    "queue_full",
    "not_ready",
    "timeout",
    "body_timeout",
)

request_log = logging.getLogger("minibatch.requests")

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
_ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    """All metrics of one app. ``live()`` returns the scrape-time gauges' values (or None before startup)."""

    def __init__(self, live: Callable[[], dict[str, float] | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "minibatch:"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            p + "request_success",
            "Requests that ended, by finish reason (every queued request lands here once).",
            ["finished_reason"],
            registry=r,
        )
        self.request_rejected = Counter(
            p + "request_rejected",
            "Requests refused without a result, by reason.",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between a sequence's consecutive tokens.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to finish, every finish reason.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to admission into the batch.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            p + "engine_step_seconds",
            "Engine call time: prefill (admission), decode step, or mixed (both in one forward).",
            ["phase"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            p + "batch_size",
            "Sequences in each decode step (newcomers prefilled in the same forward included).",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        for reason in FINISH_REASONS:  # every series exists from the start (rate() needs a zero)
            self.request_success.labels(reason)
        for reason in REJECT_REASONS:
            self.request_rejected.labels(reason)
        for phase in ("prefill", "decode", "mixed"):
            self.step_time.labels(phase)
        r.register(_LiveCollector(live))
        self._last_token: dict[int, float] = {}  # seq_id -> time of its latest token (for inter-token latency)

    # --- feeds ---------------------------------------------------------------------------------
    def on_engine_call(self, call: EngineCall) -> None:
        now = time.perf_counter()
        self.step_time.labels(call.phase).observe(call.seconds)
        self.generation_tokens.inc(call.tokens if call.tokens is not None else len(call.prefilled) + len(call.decoded))
        self.prompt_tokens.inc(sum(s.prompt_len for s in call.prefilled))
        for seq in call.prefilled:
            self._last_token[seq.seq_id] = seq.first_token_time or now
        if not call.decoded:
            return
        self.batch_size.observe(len(call.decoded) + len(call.prefilled))
        last = self._last_token
        for seq in call.decoded:
            prev = last.get(seq.seq_id)
            if prev is not None:
                self.itl.observe(now - prev)
            last[seq.seq_id] = now

    def on_resolved(self, seq: Sequence) -> None:
        self._last_token.pop(seq.seq_id, None)
        reason = seq.finish_reason or "abort"
        self.request_success.labels(reason).inc()
        end = seq.finish_time if seq.finish_time is not None else time.perf_counter()
        self.e2e.observe(max(0.0, end - seq.arrival_time))
        if seq.admit_time is not None:
            self.queue_time.observe(max(0.0, seq.admit_time - seq.arrival_time))
        elif seq.status is SequenceStatus.FINISHED_TIMEOUT:
            self.rejected("timeout")  # timed out in the queue: never served
        if seq.first_token_time is not None:
            self.ttft.observe(max(0.0, seq.first_token_time - seq.arrival_time))
        if request_log.isEnabledFor(logging.INFO):
            m = seq.metrics_ms()
            fields = {
                "request_id": seq.request_id,
                "finish_reason": reason,
                "prompt_tokens": seq.prompt_len,
                "completion_tokens": len(seq.output_token_ids),
                "queue_ms": round(m["queue_wait_ms"], 1) if seq.admit_time is not None else None,
                "ttft_ms": round(m["ttft_ms"], 1) if seq.first_token_time is not None else None,
                "e2e_ms": round(m["e2e_ms"], 1),
            }
            if seq.error:
                fields["error"] = seq.error
            request_log.info("%s", logfmt("request_finished", **fields))

    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Gauges (and engine failure counters) computed from the live server at scrape time."""

    _GAUGES = {
        "num_requests_running": "Sequences holding a batch slot.",
        "num_requests_waiting": "Sequences waiting for a slot.",
        "num_requests_prefilling": "Admitted sequences whose prompt is still being prefilled in chunks.",
        "kv_cache_usage_perc": "KV-cache blocks in use / blocks in the pool, 0..1.",
        "kv_cache_free_blocks": "KV-cache blocks free in the pool.",
        "kv_cache_blocks": "KV-cache blocks in the pool (KV_CACHE_MB / bytes per block).",
        "kv_cache_cached_blocks": "KV-cache blocks in the prefix cache (held by a sequence, or free and evictable).",
        "kv_cache_bytes": "Bytes of the KV-cache pool (K and V in KV_CACHE_DTYPE elements, int8's scales).",
        "num_requests_in_flight": "HTTP requests in flight (probes and /metrics excluded).",
        "batch_capacity": "Most sequences running at once (MAX_BATCH_SIZE).",
        "ready": "1 when /ready answers 200.",
        "draining": "1 while draining for shutdown.",
    }

    def __init__(self, live: Callable[[], dict[str, float] | None]) -> None:
        self.live = live

    def collect(self):
        values = self.live() or {}
        for name, doc in self._GAUGES.items():
            yield GaugeMetricFamily(f"minibatch:{name}", doc, value=float(values.get(name, 0.0)))
        if "kv_cache_dtype" in values:
            doc = "The KV-cache pool's element type (KV_CACHE_DTYPE); always 1."
            info = GaugeMetricFamily("minibatch:kv_cache_info", doc, labels=["dtype"])
            info.add_metric([str(values["kv_cache_dtype"])], 1.0)
            yield info
        failures = CounterMetricFamily(
            "minibatch:engine_failures",
            "Engine calls that raised (their sequences ended with an error).",
            labels=["phase"],
        )
        failures.add_metric(["prefill"], float(values.get("failed_admits", 0)))
        failures.add_metric(["decode"], float(values.get("failed_steps", 0)))
        yield failures
        yield CounterMetricFamily(
            "minibatch:num_preemptions",
            "Running sequences sent back to the queue because the KV cache was full (recomputed on readmission).",
            value=float(values.get("num_preemptions", 0)),
        )
        yield CounterMetricFamily(
            "minibatch:prefix_cache_queries",
            "Tokens of admitted sequences looked up in the prefix cache (prefix caching on).",
            value=float(values.get("prefix_cache_queries", 0)),
        )
        yield CounterMetricFamily(
            "minibatch:prefix_cache_hits",
            "Of those, tokens found in the cache (their K/V shared, not computed).",
            value=float(values.get("prefix_cache_hits", 0)),
        )
        yield from _spec_metrics(values.get("spec"))
        yield from _lora_metrics(values.get("lora"))
        yield CounterMetricFamily(
            "minibatch:prefill_tokens_computed",
            "Tokens the engine's prefill really computed: prompts (and recomputed preempted sequences), without "
            "prefix-cache hits or the prompt's copies for the forked choices of an n > 1 request.",
            value=float(values.get("prefill_tokens_computed", 0)),
        )


def _lora_metrics(lora: dict | None):
    """LoRA adapters (``api.ops.lora_state``): how many are loaded, and vLLM's ``lora_requests_info``."""
    if lora is None:
        return
    yield GaugeMetricFamily("minibatch:lora_adapters_loaded", "LoRA adapters resident (of MAX_LORAS).", lora["loaded"])
    info = GaugeMetricFamily(
        "minibatch:lora_requests_info",
        "The adapters the running and the waiting sequences chose (comma-separated names), MAX_LORAS; always 1.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    info.add_metric([str(lora["max_lora"]), ",".join(lora["running"]), ",".join(lora["waiting"])], 1.0)
    yield info


def _spec_metrics(spec):
    """Speculative decoding's counters (vLLM's ``spec_decode_*`` names; ``core.speculative.SpecStats``)."""
    if spec is None:
        return
    p = "minibatch:spec_decode_"
    for name, doc, value in (
        ("num_drafts", "Decode rows that carried draft tokens into a step.", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens proposed (and verified).", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        (
            "num_emitted_tokens",
            "Tokens the rows with drafts emitted (accepted drafts + one each).",
            spec.num_emitted_tokens,
        ),
    ):
        yield CounterMetricFamily(p + name, doc, value=float(value))
    per_pos = CounterMetricFamily(
        p + "num_accepted_tokens_per_pos", "Draft tokens accepted, by their position in the draft.", labels=["position"]
    )
    last = max((i for i, n in enumerate(spec.accepted_per_pos) if n), default=-1)
    for pos in range(last + 1):
        per_pos.add_metric([str(pos)], float(spec.accepted_per_pos[pos]))
    yield per_pos
    yield GaugeMetricFamily(
        p + "draft_acceptance_rate", "Accepted draft tokens per proposed one, so far.", value=spec.acceptance_rate
    )


_BARE = re.compile(r"[A-Za-z0-9_.:/@+-]+")


def logfmt(event: str, **fields) -> str:
    """``event k=v ...``; values that are not bare words are JSON-quoted (no newlines or quotes get through)."""
    parts = [event]
    for key, value in fields.items():
        if value is None:
            text = "-"
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            text = str(value)
        else:
            text = str(value)
            if not _BARE.fullmatch(text):
                text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)
