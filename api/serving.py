"""From a validated request to a running ``Generation``, shared by /generate and /v1. No torch.

``Runtime`` is what the handlers need once the model has loaded. The path of a prompt keeps the
event loop free: cheap limits first (characters, number of token ids: no tokenizer call), then
tokenizing, detokenizing and chat-template rendering in a small thread pool (a 100,000-character
prompt costs a tokenizer ~100 ms, which on the loop would stall every stream), then the sampling
and length checks, then the queue.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from api.errors import APIError
from config import Config
from core.generation import Generation
from core.sampling import SamplingParams
from core.sequence import Sequence, group_choices
from engine import ChatTemplateError, InferenceEngine
from guided.grammars import GrammarError, GrammarState, compiler_for
from scheduler import QueueFullError, Scheduler
from schemas import SamplingFields


class Runtime:
    """Config, engine, scheduler, and the thread pool prompts are tokenized in (once loaded)."""

    def __init__(self, config: Config, engine: InferenceEngine, scheduler: Scheduler) -> None:
        self.config, self.engine, self.scheduler = config, engine, scheduler
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=config.tokenizer_threads, thread_name_prefix="tokenize")

    async def off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in the tokenizer pool: the loop keeps serving meanwhile."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, call)

    def close(self) -> None:
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def current_runtime(request: Request) -> Runtime:
    """FastAPI dependency: the runtime, or 503 while the model loads or after the engine loop died."""
    runtime: Runtime | None = request.app.state.server
    if runtime is None or not runtime.scheduler.alive:
        raise APIError(503, "server is not ready", "unavailable", reason="not_ready")
    return runtime


# --- cheap limits (no tokenizer call) -------------------------------------------------------------
def check_prompt_chars(runtime: Runtime, text: str) -> str:
    """MAX_PROMPT_CHARS, checked before tokenizing (a huge prompt must not cost a tokenizer pass)."""
    limit = runtime.config.max_prompt_chars
    if limit and len(text) > limit:
        raise APIError(
            422,
            f"prompt is {len(text)} characters; the limit is {limit} (MAX_PROMPT_CHARS)",
            param="prompt",
            reason="too_large",
        )
    return text


def check_token_ids(runtime: Runtime, ids: list[int]) -> list[int]:
    """A prompt given as token ids: no longer than the context window, every id in the vocabulary."""
    window = runtime.engine.max_context
    if len(ids) >= window:  # at least one token must be generated
        raise APIError(
            422,
            f"prompt is {len(ids)} tokens; the model's context window is {window} tokens",
            param="prompt",
            reason="too_large",
        )
    vocab = runtime.engine.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(422, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return ids


def check_max_tokens(runtime: Runtime, n: int, param: str) -> int:
    limit = runtime.config.max_new_tokens_limit
    if not 1 <= n <= limit:
        raise APIError(422, f"{param} must be in [1, {limit}] (got {n})", param=param)
    return n


# --- tokenizer work, off the loop -----------------------------------------------------------------
async def tokenize(runtime: Runtime, text: str, add_special_tokens: bool = True) -> list[int]:
    check_prompt_chars(runtime, text)
    return await runtime.off_loop(runtime.engine.encode, text, add_special_tokens=add_special_tokens)


async def detokenize(runtime: Runtime, ids: list[int]) -> str:
    return await runtime.off_loop(runtime.engine.decode, ids)


async def render_chat(runtime: Runtime, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template applied to ``messages`` and ``tools`` (400 if the model has none or it fails on them)."""
    try:
        args = (messages,) if tools is None else (messages, tools)
        return await runtime.off_loop(runtime.engine.apply_chat_template, *args)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


def logit_bias(runtime: Runtime, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as sorted (token id, bias) pairs; 422 for a token outside the vocabulary."""
    pairs = tuple(sorted((int(key), float(value)) for key, value in (bias or {}).items()))
    vocab = runtime.engine.vocab_size
    bad = next((t for t, _ in pairs if t >= vocab), None)
    if bad is not None:
        raise APIError(422, f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})", param="logit_bias")
    return pairs


# --- sequence and generation ----------------------------------------------------------------------
def make_sequence(
    runtime: Runtime,
    prompt_ids: list[int],
    max_new_tokens: int,
    fields: SamplingFields,
    request_id: str,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> Sequence:
    """Validate sampling and length against the config and the model; build the Sequence.
    ``logprobs`` / ``prompt_logprobs``: the top-k wanted for each output / prompt token (None: none)."""
    cfg = runtime.config
    for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if k is not None and k > cfg.max_logprobs:
            raise APIError(422, f"{name} must be in [0, {cfg.max_logprobs}] (got {k})", param=name)
    try:
        sampling = SamplingParams(
            temperature=fields.temperature,
            top_p=fields.top_p,
            top_k=fields.top_k,
            min_p=fields.min_p,
            repetition_penalty=fields.repetition_penalty,
            presence_penalty=fields.presence_penalty,
            frequency_penalty=fields.frequency_penalty,
            seed=fields.seed,
            logit_bias=logit_bias(runtime, fields.logit_bias),
        )
    except ValueError as exc:
        raise APIError(422, str(exc)) from None
    now = time.perf_counter()
    seq = Sequence(
        prompt_token_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        request_id=request_id,
        stop_token_ids=frozenset(fields.stop_token_ids or ()),
        ignore_eos=fields.ignore_eos,
        sampling=sampling,
        logprobs=logprobs,
        prompt_logprobs_k=prompt_logprobs,
        arrival_time=now,
        queue_deadline=now + cfg.max_queue_time_s if cfg.max_queue_time_s else None,
        deadline=now + cfg.request_timeout_s if cfg.request_timeout_s else None,
    )
    reason = runtime.engine.check_admissible(seq)
    if reason:
        raise APIError(422, reason, param="prompt")
    return seq


def start_generation(runtime: Runtime, seq: Sequence, stop: list[str] | None) -> Generation:
    """Queue ``seq``; 503 with Retry-After when the queue is full."""
    gen = Generation(seq, runtime.engine.decode, runtime.scheduler, stop)
    try:
        gen.start()
    except QueueFullError as exc:
        raise APIError(503, str(exc), "overloaded", reason="queue_full", headers={"Retry-After": "1"}) from None
    return gen


def start_generations(runtime: Runtime, seqs: list[Sequence], stop: list[str] | None, n: int = 1) -> list[Generation]:
    """Queue all of ``seqs`` at once (no await between them: the scheduler sees them together), or
    none: if the queue fills part way, the ones already queued are cancelled and the answer is 503.
    ``n`` > 1: each run of ``n`` consecutive sequences holds the choices of one prompt (``group_choices``),
    so the engine prefills that prompt once and forks it to the other choices."""
    if n > 1:
        for i in range(0, len(seqs), n):
            group_choices(seqs[i : i + n])
    gens: list[Generation] = []
    try:
        for seq in seqs:
            gens.append(start_generation(runtime, seq, stop))
    except APIError:
        for gen in gens:
            gen.cancel()
        raise
    return gens


# --- structured output ----------------------------------------------------------------------------
async def attach_grammar(runtime: Runtime, seqs: list[Sequence], grammar: str | None, param: str) -> None:
    """Compile ``grammar`` (off the event loop) into one matcher per sequence; 400 naming ``param`` when the
    grammar is not supported. Nothing happens without a grammar: an unconstrained request pays nothing."""
    if grammar is None:
        return

    def build() -> list[GrammarState]:
        compiler = compiler_for(runtime.engine)
        return [compiler.matcher(grammar) for _ in seqs]

    try:
        states = await runtime.off_loop(build)
    except GrammarError as exc:
        raise APIError(400, f"`{param}`: {exc}", param=param) from None
    for seq, state in zip(seqs, states):
        seq.grammar = state
