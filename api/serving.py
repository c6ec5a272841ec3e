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
import hashlib
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from api.errors import APIError
from config import Config
from core.generation import Generation
from core.sampling import SamplingParams
from core.sequence import Sequence, group_choices
from core.speculative import SpecParams
from engine import ChatTemplateError, InferenceEngine
from guided.grammars import CompiledGrammar, GrammarBusyError, GrammarError, GrammarState, compiler_for
from scheduler import QueueFullError, Scheduler
from schemas import SamplingFields, SpeculativeFields
from text.chat_prompt import ChatPrompt, encode_chat_prompt, render_chat_prompt


class Runtime:
    """Config, engine, scheduler, and the thread pool prompts are tokenized in (once loaded)."""

    def __init__(self, config: Config, engine: InferenceEngine, scheduler: Scheduler) -> None:
        self.config, self.engine, self.scheduler = config, engine, scheduler
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=config.tokenizer_threads, thread_name_prefix="tokenize")
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary id
        self.control_tokens = engine.control_tokens()  # kept as text where a chat message types them
        self.fingerprint = system_fingerprint(config, engine)

    def token_text(self, token_id: int) -> str:
        """One token's own text (``engine.decode([id])``; U+FFFD for part of a character), decoded once per server:
        a logprobs answer names up to MAX_LOGPROB_ENTRIES tokens, mostly the same few thousand. Any thread."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.decode([token_id])
        return text

    async def off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in the tokenizer pool: the loop keeps serving meanwhile."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, call)

    def close(self) -> None:
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def system_fingerprint(config: Config, engine: InferenceEngine) -> str:
    """OpenAI's ``system_fingerprint``: names what serves the answers (the checkpoint, its weights format, the
    runtime, the KV dtype), so a client sees when the backend configuration changed (greedy output may then differ)."""
    parts = (config.model_id, config.weights, type(engine).__name__, getattr(engine, "kv_cache_dtype", ""))
    return "fp_" + hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=5).hexdigest()


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


def check_token_ids(runtime: Runtime, ids: list[int], room: int = 1) -> list[int]:
    """A prompt given as token ids: within the context window with ``room`` positions to spare (one token must be
    generated; an embedding needs none), every id in the vocabulary."""
    window = runtime.engine.max_context
    if len(ids) > window - room:
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


async def render_chat(runtime: Runtime, messages: list[dict], tools: list[dict] | None = None) -> ChatPrompt:
    """The chat template applied to ``messages`` and ``tools``, special-token strings the messages type kept as data
    (``text/chat_prompt.py``); 400 if the model has no template or it fails on them."""
    engine = runtime.engine

    def apply(msgs: list[dict], tls: list[dict] | None) -> str:
        return engine.apply_chat_template(msgs) if tls is None else engine.apply_chat_template(msgs, tls)

    try:
        return await runtime.off_loop(render_chat_prompt, apply, messages, tools, runtime.control_tokens)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


async def chat_prompt_ids(runtime: Runtime, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The token ids of a conversation: rendered (``render_chat``), MAX_PROMPT_CHARS checked on the text, tokenized
    off the loop with the template's control tokens matched and the messages' typed ones as plain text."""
    prompt = await render_chat(runtime, messages, tools)
    check_prompt_chars(runtime, prompt.text)
    engine = runtime.engine

    def encode(text: str) -> list[int]:
        return engine.encode(text, add_special_tokens=False)  # the template holds BOS and the turn markers

    return await runtime.off_loop(encode_chat_prompt, prompt, encode, engine.encode_as_text)


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
    model: str | None = None,
) -> Sequence:
    """Validate sampling and length against the config and the model; build the Sequence.
    ``logprobs`` / ``prompt_logprobs``: the top-k wanted for each output / prompt token (None: none); ``model``: the
    name the request chose (``check_model``): a LoRA adapter's runs under it."""
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
    vocab = runtime.engine.vocab_size
    bad = next((t for t in fields.stop_token_ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(422, f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab})", param="stop_token_ids")
    now = time.perf_counter()
    seq = Sequence(
        speculation=speculation(runtime, fields.speculative),
        lora_id=lora_id(runtime, model),
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


def lora_id(runtime: Runtime, model: str | None) -> int:
    """The LoRA adapter ``model`` names (``Sequence.lora_id``); 0 for the base model (or None)."""
    loras = runtime.engine.loras
    return (loras.id_of(model) or 0) if loras is not None and model is not None else 0


def check_model(runtime: Runtime, model: str | None) -> str:
    """The name a request's ``model`` chose: the base model's (also for None) or a LoRA adapter's; 404 otherwise."""
    name = runtime.config.model_name
    if model is None or model == name or lora_id(runtime, model):
        return model or name
    loras = runtime.engine.loras
    adapters = f" and the LoRA adapters {', '.join(f'`{a}`' for a in loras.served)}" if loras and loras.served else ""
    raise APIError(404, f"The model `{model}` does not exist; this server serves `{name}`{adapters}", param="model")


def speculation(runtime: Runtime, fields: SpeculativeFields | None) -> SpecParams | None:
    """The request's speculative decoding over the server's default (None: the default as it is); 400 naming
    ``speculative`` for a draft model this server does not serve, or lookup lengths out of order."""
    if fields is None:
        return None
    default = runtime.config.speculative
    method = fields.method or ("draft_model" if fields.draft_model is not None else default.method)
    if method == "draft_model" or fields.draft_model is not None:
        check_draft_model(runtime, fields.draft_model, method)
    try:
        return SpecParams(
            method,
            fields.num_speculative_tokens or default.num_tokens,
            fields.prompt_lookup_min or min(default.lookup_min, fields.prompt_lookup_max or default.lookup_min),
            fields.prompt_lookup_max or max(default.lookup_max, fields.prompt_lookup_min or default.lookup_max),
        )
    except ValueError as exc:
        raise APIError(400, f"`speculative`: {exc}", param="speculative") from None


def check_draft_model(runtime: Runtime, name: str | None, method: str) -> None:
    """A request naming a draft model (or method draft_model) must name this server's (SPECULATIVE_MODEL), or none
    when it has one: else a 400 naming it."""
    served = runtime.config.speculative_model if getattr(runtime.engine, "drafter", None) is not None else ""
    if method != "draft_model":
        raise APIError(
            400, f"`speculative.draft_model` goes with method draft_model, not {method!r}", param="speculative.method"
        )
    if name is not None and name != served:
        where = f"this server's draft model is {served!r}" if served else "this server has no draft model"
        raise APIError(400, f"draft model {name!r} is not served here: {where}", param="speculative.draft_model")
    if not served:
        raise APIError(
            400,
            "`speculative.method` draft_model needs a draft model; this server has none (SPECULATIVE_MODEL)",
            param="speculative.method",
        )


# --- fair scheduling: who sent a request, and how much it may queue ----------------------------------------------
_request_keys = itertools.count(1)  # one per HTTP request: its sequences' Sequence.request_key


def client_id(runtime: Runtime, request: Request | None) -> str:
    """Who sent ``request``, as fair scheduling tells clients apart (``core/fair_queue.py``): the CLIENT_ID_HEADER
    a trusted proxy sets, else the peer's address. (API_KEY is one key for every client: it tells no one apart.)"""
    if request is None:
        return ""
    header = runtime.config.client_id_header
    if header:
        value = request.headers.get(header, "").strip()
        if value:
            return "h:" + value[:256]
    peer = request.client
    return "a:" + peer.host if peer is not None else ""


def check_sequence_count(runtime: Runtime, count: int, param: str = "n") -> None:
    """MAX_SEQUENCES_PER_REQUEST: the sequences (prompts x n) one request would queue; 422 beyond it, before any
    prompt is tokenized."""
    limit = runtime.config.max_sequences_per_request
    if count > limit:
        raise APIError(
            422,
            f"this request asks for {count} sequences (prompts x n); the limit is {limit} (MAX_SEQUENCES_PER_REQUEST)",
            param=param,
            reason="too_large",
        )


def logprob_entries(seq: Sequence) -> int:
    """The most logprob entries (a token or one of its alternatives) ``seq``'s answer can carry."""
    total = 0
    if seq.logprobs is not None:
        total += seq.max_new_tokens * (1 + seq.logprobs)
    if seq.prompt_logprobs_k is not None:
        total += seq.prompt_len * (1 + seq.prompt_logprobs_k)
    return total


def check_logprob_entries(runtime: Runtime, seqs: list[Sequence]) -> None:
    """MAX_LOGPROB_ENTRIES: what one answer may carry over all its sequences, counted before anything is queued;
    422 beyond it."""
    limit = runtime.config.max_logprob_entries
    entries = sum(logprob_entries(s) for s in seqs)
    if entries > limit:
        raise APIError(
            422,
            f"this answer could carry {entries} logprob entries (tokens x (1 + alternatives), prompt and output, over "
            f"{len(seqs)} sequences); the limit is {limit} (MAX_LOGPROB_ENTRIES)",
            param="logprobs",
            reason="too_large",
        )


def start_generation(
    runtime: Runtime, seq: Sequence, stop: list[str] | None, request: Request | None = None
) -> Generation:
    """Queue ``seq`` as its own request; 503 with Retry-After when the queue (or the client's share of it) is full."""
    return start_generations(runtime, [seq], stop, request=request)[0]


def start_generations(
    runtime: Runtime, seqs: list[Sequence], stop: list[str] | None, n: int = 1, request: Request | None = None
) -> list[Generation]:
    """Queue all of ``seqs`` at once, as one request of the client that sent ``request`` (no await between them:
    the scheduler sees them together), or none: if the queue fills part way, the ones already queued are cancelled
    and the answer is 503. ``n`` > 1: each run of ``n`` consecutive sequences holds the choices of one prompt
    (``group_choices``), so the engine prefills that prompt once and forks it to the other choices."""
    check_sequence_count(runtime, len(seqs))
    check_logprob_entries(runtime, seqs)
    loras = runtime.engine.loras
    if any(s.lora_id and not loras.is_served(s.lora_id) for s in seqs):  # unloaded while the request was prepared
        raise APIError(404, "the LoRA adapter this request chose was unloaded meanwhile", param="model")
    if n > 1:
        for i in range(0, len(seqs), n):
            group_choices(seqs[i : i + n])
    key, client = next(_request_keys), client_id(runtime, request)
    for seq in seqs:
        seq.request_key, seq.client_id = key, client
    gens: list[Generation] = []
    try:
        for seq in seqs:
            gen = Generation(seq, runtime.engine.decode, runtime.scheduler, stop)
            gen.start()
            gens.append(gen)
    except QueueFullError as exc:
        for gen in gens:
            gen.cancel()
        raise APIError(503, str(exc), "overloaded", reason="queue_full", headers={"Retry-After": "1"}) from None
    return gens


# --- structured output ----------------------------------------------------------------------------
async def attach_grammar(runtime: Runtime, seqs: list[Sequence], grammar: str | None, param: str) -> None:
    """Compile ``grammar`` once (off the event loop; a grammar compiled before comes from the cache) and give every
    sequence its own state over it; 400 naming ``param`` when the grammar is not supported, 503 while too many
    distinct grammars are in use. Nothing happens without a grammar: an unconstrained request pays nothing."""
    if grammar is None:
        return

    def build() -> CompiledGrammar:
        return compiler_for(runtime.engine).compile(grammar)

    try:
        compiled = await runtime.off_loop(build)
    except GrammarBusyError as exc:
        raise APIError(503, str(exc), "overloaded", reason="queue_full", headers={"Retry-After": "1"}) from None
    except GrammarError as exc:
        raise APIError(400, f"`{param}`: {exc}", param=param) from None
    for seq in seqs:
        seq.grammar = GrammarState(compiled)
