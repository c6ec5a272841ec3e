"""The Hugging Face baselines: ``static_hf`` (static batches through HF ``generate``) and ``hf_cb`` (transformers'
own continuous batching), each as (model_dir, workload) -> (once() -> per-request dicts, config dict)."""

from __future__ import annotations

import time

from .workloads import Workload

HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the HF baselines' dtype=... option


def hf_dtype(name: str):
    """``static_hf:dtype=bf16`` -> torch.bfloat16 (fp32, bf16, fp16)."""
    import torch

    if name not in HF_DTYPES:
        raise SystemExit(f"dtype must be one of {', '.join(HF_DTYPES)} (got {name!r})")
    return getattr(torch, HF_DTYPES[name])


def system_static_hf(model_dir: str, workload: Workload, device: str = "cpu", dtype: str = "fp32"):
    """FCFS batches of the capacity through HF generate on ``device`` in ``dtype``; a request finishes when its
    batch does. Every row of a batch gets its tokens at the batch's steps (the time each step's logits reach the
    sampler)."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from models.hf_baseline import HFModelRunner, left_pad

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype(dtype))
    runner = HFModelRunner(model_dir, device=device, model=model)
    requests, capacity = workload.requests, workload.capacity

    class Steps(LogitsProcessor):
        """Records when each step's tokens are chosen."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def once() -> list[dict]:
        out = []
        t0 = time.perf_counter()
        for first in range(0, len(requests), capacity):
            batch = requests[first : first + capacity]
            start = time.perf_counter()
            ids, mask = left_pad([r.prompt_ids for r in batch], runner.pad_id)  # each [B, W]
            ids, mask = ids.to(runner.device), mask.to(runner.device)
            width = ids.shape[1]
            steps = Steps()
            with torch.inference_mode():
                gen = runner.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    eos_token_id=None,
                    max_new_tokens=max(r.max_new_tokens for r in batch),
                    pad_token_id=runner.pad_id,
                    logits_processor=LogitsProcessorList([steps]),
                )
            end = time.perf_counter()
            for r in batch:
                n = min(r.max_new_tokens, gen.shape[1] - width)
                times = [t - t0 for t in steps.times[:n]]
                out.append(
                    {
                        "tag": r.tag,
                        "prompt_tokens": len(r.prompt_ids),
                        "tokens": n,
                        "start": start - t0,
                        "first": times[0] if times else end - t0,
                        "end": end - t0,
                        "token_times": times,
                    }
                )
        return out

    config = {"batching": "static FCFS batches, left-padded, HF generate(do_sample=False)", "batch_size": capacity}
    return once, {**config, "device": str(runner.device), "dtype": dtype}


def system_hf_cb(model_dir: str, workload: Workload, device: str = "cpu", dtype: str = "fp32"):
    """transformers' continuous batching (ContinuousBatchingManager) on ``device`` in ``dtype``, same request cap,
    all queued at t0; token times are its own per-token timestamps (``record_timestamps``)."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    requests, capacity = workload.requests, workload.capacity
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype(dtype), attn_implementation="sdpa")
    model = model.to(device).eval()
    page = 32
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    # eos_token_id=-1: no EOS (None would fall back to the model's EOS).
    gen = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.max_new_tokens for r in requests)
    )
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=capacity,  # the request cap, as for ours
        max_batch_tokens=max(256, 2 * capacity),  # explicit: left unset it sizes itself from system RAM
        page_size=page,
        num_blocks=capacity * (longest // page + 2),  # KV pages for `capacity` of the longest requests
        scheduler_type="fifo",
        allow_block_sharing=False,
        auto_switch_to_flash=False,
    )
    config = {
        "attn_implementation": "sdpa",
        "max_requests_per_batch": capacity,
        "max_batch_tokens": cb.max_batch_tokens,
        "page_size": page,
        "num_blocks": cb.num_blocks,
        "scheduler_type": "fifo",
        "device": device,
        "dtype": dtype,
    }

    def once() -> list[dict]:
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        done: dict[str, object] = {}
        t0 = time.perf_counter()
        try:
            for i, r in enumerate(requests):
                manager.add_request(
                    r.prompt_ids,
                    request_id=f"r{i}",
                    max_new_tokens=r.max_new_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
            deadline = time.monotonic() + 1800
            while len(done) < len(requests):
                if time.monotonic() > deadline or not manager.is_running():
                    raise RuntimeError(f"continuous batching stopped with {len(done)}/{len(requests)} requests done")
                out = manager.get_result(timeout=1.0)
                if out is not None and out.is_finished():
                    if out.error:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    done[out.request_id] = out
        finally:
            manager.stop(block=True, timeout=10)
            manager.destroy()
        outs = [done[f"r{i}"] for i in range(len(requests))]
        return [
            {
                "tag": r.tag,
                "prompt_tokens": len(r.prompt_ids),
                "tokens": len(o.generated_tokens),
                "start": 0.0,
                "first": o.timestamps[0] - t0,
                "end": o.lifespan[1] - t0,
                "token_times": [t - t0 for t in o.timestamps],
            }
            for r, o in zip(requests, outs)
        ]

    return once, config
