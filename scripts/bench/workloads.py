"""Workloads: (name, tokenizer, seed, quick, capacity) -> a ``Workload``: the same seeded requests for every system.

A request is queued at t0 unless it says otherwise: ``arrival`` delays it (seconds after t0), ``after``
holds it until an earlier request has finished, and ``continues`` makes its prompt that earlier request's
prompt and output followed by its own tokens (a conversation's next turn). Systems that cannot express a
workload's timing say so (``systems.unsupported``) and are reported as skipped. ``drive`` sends a workload's
requests by those rules.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

PROMPT_TEXTS = [
    "Hello!",
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Summarize the plot of a heist movie in two sentences, focusing on the twist at the end.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his curious cat. "
    "Every morning they rowed out past the lighthouse, and every evening they came back with a story. "
    "One day the cat found a bottle with a map inside it.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "# Explain what this function returns for n = 10 and why:\n",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Translate to French: I would like a cup of coffee and a croissant, please.",
]
SWEEP_CAPACITIES = (1, 2, 4, 8, 16, 32)
MEMORY_CAPACITIES = (8, 32)
# Workloads run once per capacity (results keyed by capacity); the quick form runs the first two.
CAPACITY_WORKLOADS = {"sweep": SWEEP_CAPACITIES, "memory": MEMORY_CAPACITIES}
SYSTEM_PROMPT = (
    "You are a careful, friendly assistant for a small bookshop. Answer in plain English, in at most three "
    "sentences, and never invent a title, an author or a price. When a customer asks for a recommendation, "
    "ask one question about what they enjoyed last, then suggest two books from the shelves listed below and "
    "say in one line why each fits. Opening hours: Monday to Friday 9 to 18, Saturday 10 to 16, closed on "
    "Sunday. Orders arrive within three working days; a customer who orders before noon on Thursday gets "
    "the book on Saturday. Returns are accepted within 30 days with the receipt. "
)
SHELVES = [
    "mystery",
    "science fiction",
    "poetry",
    "cooking",
    "history",
    "travel",
    "children's books",
    "philosophy",
    "gardening",
    "graphic novels",
]


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    arrival: float = 0.0  # seconds after t0 before it is sent
    after: int | None = None  # index of an earlier request that must have finished first
    continues: bool = False  # prompt = the `after` request's prompt + output, then prompt_ids
    tag: str = ""  # a group the report breaks figures down by ("stream", "long", "turn2" ...)
    n: int = 1  # choices of this prompt (ours: one group, forked from one prefill); its tokens count all of them
    ignore_eos: bool = True  # False: the answer ends at the model's EOS (the copy workload: answers end by themselves)


@dataclass
class Workload:
    requests: list[Request]
    capacity: int
    # ours' settings for this workload, as environment variables (MAX_MODEL_LEN, KV_CACHE_MB ...)
    ours_env: dict[str, str] = field(default_factory=dict)
    slot_context: int = 0  # llama.cpp's context per slot; 0 = what the longest request needs
    only: tuple[str, ...] = ()  # when set, the only systems this workload means something for

    @property
    def timed(self) -> bool:
        """Whether any request waits for an arrival time or another request."""
        return any(r.arrival or r.after is not None for r in self.requests)


def seed_workload(tok, seed: int, quick: bool) -> Workload:
    """32 requests at t0, capacity 8, prompts from a one-liner to a paragraph and code, budgets 8-48."""
    rng = random.Random(seed)
    reqs = [Request(tok.encode(rng.choice(PROMPT_TEXTS)), rng.choice([8, 16, 32, 48])) for _ in range(32)]
    return Workload(reqs[:8] if quick else reqs, 8)


def _window(tok, rng: random.Random, length: int) -> list[int]:
    """A prompt of exactly `length` tokens cut from the prompt texts."""
    ids = tok.encode(" ".join(PROMPT_TEXTS))
    while len(ids) < length + 1:
        ids = ids + ids
    start = rng.randrange(0, len(ids) - length)
    return ids[start : start + length]


def scale_workload(tok, seed: int, quick: bool) -> Workload:
    """128 requests at t0, capacity 32, prompts 16-256 tokens, budgets 16-128."""
    rng = random.Random(seed)
    n = 32 if quick else 128
    return Workload([Request(_window(tok, rng, rng.randint(16, 256)), rng.randint(16, 128)) for _ in range(n)], 32)


def sweep_workload(tok, seed: int, quick: bool, capacity: int) -> Workload:
    """The same 32 requests (prompts 32-64 tokens, 32 new tokens each) at a given capacity; at a capacity above 32
    (``--capacities``, a GPU's curve up to 256) as many requests as the capacity, drawn the same way."""
    rng = random.Random(seed)
    n = 8 if quick else max(32, capacity)
    return Workload([Request(_window(tok, rng, rng.randint(32, 64)), 16 if quick else 32) for _ in range(n)], capacity)


def long_prompt_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 12: 8 streams (32-token prompts, 128 new tokens) decode from t0 while 4 prompts of 1500-2000
    tokens arrive 1.0-2.5 s later (8 new tokens each). A stream's worst inter-token gap is the stall a long
    prefill costs it: whole prompts in one step with chunked prefill off, a chunk per step with it on.
    Quick: 24 new tokens, prompts of 150-200 tokens arriving 0.2-0.5 s in."""
    rng = random.Random(seed)
    streams = [Request(_window(tok, rng, 32), 24 if quick else 128, tag="stream") for _ in range(8)]
    lo, hi, first, gap = (150, 200, 0.2, 0.1) if quick else (1500, 2000, 1.0, 0.5)
    longs = [Request(_window(tok, rng, rng.randint(lo, hi)), 8, arrival=first + gap * i, tag="long") for i in range(4)]
    # 12 running at once; a context that holds the longest prompt (not the model's whole window: SmolLM2's
    # 8192 would size the default pool for 12 x 8192 tokens).
    return Workload(streams + longs, 12, ours_env={"MAX_MODEL_LEN": str(hi + 64)})


def memory_workload(tok, seed: int, quick: bool, capacity: int) -> Workload:
    """Issue 12: `capacity` sequences (8 or 32) running at once with MAX_MODEL_LEN=8192 under a 512 MiB pool:
    prompts of 128 tokens, 64 new tokens each (quick: 32 + 8). Peak RSS and KV MiB against the old
    per-slot reservation (capacity x MAX_MODEL_LEN tokens). ours only: llama.cpp reserves per slot too
    (-c capacity x 8192), so it runs here as that design's peer."""
    rng = random.Random(seed)
    prompt, new = (32, 8) if quick else (128, 64)
    reqs = [Request(_window(tok, rng, prompt), new) for _ in range(capacity)]
    env = {"MAX_MODEL_LEN": "8192", "KV_CACHE_MB": "512"}
    return Workload(reqs, capacity, ours_env=env, slot_context=8192, only=("ours", "ours_server", "llamacpp"))


def single_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 14: one user, requests in turn (each sent when the previous finished): 64-token prompts, 64 new
    tokens, EOS ignored; 16 requests (quick: 4 of 8 new tokens). Single-stream latency: TTFT and ITL."""
    rng = random.Random(seed)
    n, new = (4, 8) if quick else (16, 64)
    return Workload([Request(_window(tok, rng, 64), new, after=i - 1 if i else None) for i in range(n)], 1)


def chat_prompt(tok, system: str, user: str) -> list[int]:
    """The chat template's rendering of a system and a user message, as ids (plain text where there is none)."""
    if getattr(tok, "chat_template", None):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tok.encode(system + "\n\nUser: " + user + "\nAssistant:")


def _system_prompt(tok, tokens: int) -> str:
    """SYSTEM_PROMPT and shelf lines until it is at least ``tokens`` tokens long."""
    text, i = SYSTEM_PROMPT, 0
    while len(tok.encode(text)) < tokens:
        text += f"Shelf {i + 1}: {SHELVES[i % len(SHELVES)]}, row {i // len(SHELVES) + 1}. "
        i += 1
    return text


def _user_text(tok, rng: random.Random, lo: int, hi: int) -> str:
    """A user message of about lo-hi tokens, cut from the prompt texts at word boundaries."""
    words = " ".join(PROMPT_TEXTS).split()
    want = rng.randint(lo, hi)
    start = rng.randrange(0, len(words) - 64)
    n = 1
    while n < 64 and len(tok.encode(" ".join(words[start : start + n + 1]))) <= want:
        n += 1
    return " ".join(words[start : start + n])


def shared_prefix_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 13: 32 requests at t0 sharing a ~400-token system prompt (through the chat template), each with
    8-32 tokens of its own and 16 new tokens (quick: 8 requests). What a prefix cache saves: prefill."""
    rng = random.Random(seed)
    system = _system_prompt(tok, 400)
    n = 8 if quick else 32
    return Workload([Request(chat_prompt(tok, system, _user_text(tok, rng, 8, 32)), 16) for _ in range(n)], 8)


def multi_turn_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 13: 8 conversations x 4 turns (quick: 4 x 2). Turn 1 is the shared system prompt's chat rendering
    with a user message; each later turn resends the conversation so far (the previous turn's prompt and
    output, as token ids) plus 16-32 new user tokens, and is sent when that previous turn finished. 32 new
    tokens per turn. TTFT per turn shows what resending the history costs."""
    rng = random.Random(seed)
    convs, turns, new = (4, 2, 8) if quick else (8, 4, 32)
    system = _system_prompt(tok, 100)
    reqs: list[Request] = []
    last: list[int] = []
    for _ in range(convs):
        reqs.append(Request(chat_prompt(tok, system, _user_text(tok, rng, 16, 32)), new, tag="turn1"))
        last.append(len(reqs) - 1)
    for t in range(2, turns + 1):
        for c in range(convs):
            follow = tok.encode("\nUser: " + _user_text(tok, rng, 16, 32) + "\nAssistant:")
            reqs.append(Request(follow, new, after=last[c], continues=True, tag=f"turn{t}"))
            last[c] = len(reqs) - 1
    return Workload(reqs, 8)


def n_choices_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 13: 4 requests at t0 (quick: 2), each a prompt of its own of ~300 tokens through the chat template,
    each asking for n = 4 sampled choices of 16 new tokens; capacity 16. ``ours`` forks each prompt's one
    prefill to its 4 choices; ``ours:fork=off`` sends the choices as 4 separate requests with the same prompt
    (the prefix cache still shares their full blocks; with ``prefix=off`` nothing is shared)."""
    rng = random.Random(seed)
    system = _system_prompt(tok, 300)
    reqs = [
        Request(chat_prompt(tok, f"Ticket {i + 1}. " + system, _user_text(tok, rng, 8, 32)), 16, n=4)
        for i in range(2 if quick else 4)
    ]
    return Workload(reqs, 16, only=("ours",))


# What people paste for a local model to repeat or fix: paragraphs with typos, and code to refactor.
PASTED = [
    (
        "Correct the spelling mistakes in this paragraph and return the corrected paragraph only:",
        "The commitee met on tuesday to discus the new budjet. Everyone agreed that the library needs more "
        "computers, longer opening hours and a quiet room for students who want to study in the evening. "
        "The mayor promissed to find the money before the end of the year.",
    ),
    (
        "Repeat the following text exactly, word for word:",
        "To install the package, open a terminal and run the installer. When it asks for a folder, accept the "
        "default one unless you already keep your tools somewhere else. Restart the terminal afterwards so that "
        "the new commands are found, then type the version command to check that everything works.",
    ),
    (
        "Refactor this function to use a list comprehension. Return the whole function:",
        "def squares_of_evens(numbers):\n    result = []\n    for n in numbers:\n        if n % 2 == 0:\n"
        "            result.append(n * n)\n    return result\n",
    ),
    (
        "Fix the grammar of this email and return it:",
        "Hi Sarah, I hope you is doing well. I wanted to ask if we can moved the meeting to thursday afternoon, "
        "because I has a doctor appointment in the morning. Please let me knows if that work for you. Thanks, Tom",
    ),
    (
        "Add a docstring to this function and return the whole function:",
        "def average(values):\n    total = 0\n    count = 0\n    for v in values:\n        total += v\n"
        "        count += 1\n    if count == 0:\n        return 0.0\n    return total / count\n",
    ),
    (
        "Repeat this list exactly:",
        "1. Preheat the oven to 180 degrees. 2. Mix the flour, the sugar and the butter in a large bowl. "
        "3. Add two eggs and a cup of milk, and stir until smooth. 4. Pour the batter into a tin and bake for "
        "forty minutes.",
    ),
]


def copy_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 28: one user, requests in turn, each a pasted paragraph or function to repeat, correct or refactor,
    through the chat template (the chat endpoint's prompt, sent as token ids to both systems); greedy, answers
    end at EOS, up to the pasted text's length + 48 tokens. 12 requests (quick: 3). What speculation wins on:
    the answer is mostly a copy of the prompt. Ours runs SPECULATIVE_METHOD=ngram here (``ours:spec=off`` without)."""
    rng = random.Random(seed)
    n = 3 if quick else 12
    order = [PASTED[i % len(PASTED)] for i in range(n)]
    rng.shuffle(order)
    reqs = [
        Request(
            chat_prompt(tok, "You are a helpful assistant.", f"{ask}\n\n{text}"),
            len(tok.encode(text)) + 48,
            after=i - 1 if i else None,
            ignore_eos=False,
        )
        for i, (ask, text) in enumerate(order)
    ]
    return Workload(reqs, 1, ours_env={"SPECULATIVE_METHOD": "ngram"})


def long_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 29: 8 requests at t0, each its own 1500-token prompt and 128 new tokens (quick: 150 + 16): prefill
    and decode both read long contexts, and the KV pool is most of the memory (llama.cpp gets the same context
    per slot, its default f16 KV)."""
    rng = random.Random(seed)
    prompt, new = (150, 16) if quick else (1500, 128)
    return Workload([Request(_window(tok, rng, prompt), new) for _ in range(8)], 8)


def context_workload(tok, seed: int, quick: bool, context: int) -> Workload:
    """Issue 29: one user at a long context, two requests in turn, each a prompt of its own that fills the context
    but for its 64 new tokens (quick: a 256-token context, 8 new): TTFT is the long prompt's prefill, the
    inter-token latency a decode step at that context."""
    rng = random.Random(seed)
    context, new = (256, 8) if quick else (context, 64)
    prompt = context - new - 8
    reqs = [Request(_window(tok, rng, prompt), new, after=i - 1 if i else None) for i in range(2)]
    return Workload(reqs, 1, ours_env={"MAX_MODEL_LEN": str(context)}, slot_context=context)


def scale_8k_workload(tok, seed: int, quick: bool) -> Workload:
    """Issue 29: the scale workload's requests (128 at t0, prompts 16-256, budgets 16-128; quick: 32) at 32 slots
    of 8192 tokens each under a 512 MiB pool: every token delivered while the pool holds what its dtype buys
    (fp16 2x, int8 ~3.8x fp32's tokens). ours and llama.cpp (which reserves 32 x 8192 tokens of f16 up front)."""
    base = scale_workload(tok, seed, quick)
    env = {"MAX_MODEL_LEN": "8192", "KV_CACHE_MB": "512"}
    return Workload(base.requests, 32, ours_env=env, slot_context=8192, only=("ours", "ours_server", "llamacpp"))


WORKLOADS = {
    "seed": seed_workload,
    "scale": scale_workload,
    "long-prompt": long_prompt_workload,
    "single": single_workload,
    "shared-prefix": shared_prefix_workload,
    "multi-turn": multi_turn_workload,
    "n-choices": n_choices_workload,
    "copy": copy_workload,
    "long": long_workload,
    "ctx4k": lambda tok, seed, quick: context_workload(tok, seed, quick, 4096),
    "ctx8k": lambda tok, seed, quick: context_workload(tok, seed, quick, 8192),
    "scale-8k": scale_8k_workload,
}


def build_workload(name: str, tok, seed: int, quick: bool, capacity: int = 0) -> Workload:
    if name == "sweep":
        return sweep_workload(tok, seed, quick, capacity)
    if name == "memory":
        return memory_workload(tok, seed, quick, capacity)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}")
    return WORKLOADS[name](tok, seed, quick)


def slot_context(requests: list[Request]) -> int:
    """Tokens of KV cache per slot that every request fits in (llama.cpp gets -c slots x this). A continued
    turn holds its whole conversation: the turns before it, their outputs, and its own tokens."""
    need: list[int] = []
    for r in requests:
        before = need[r.after] if r.continues and r.after is not None else 0
        need.append(before + len(r.prompt_ids) + r.max_new_tokens)
    return max(need) + 8


async def drive(requests: list[Request], send) -> list[dict]:
    """Send every request at its arrival time, once the request it waits for has finished.

    ``await send(request, prompt_ids)`` -> (output token ids, perf_counter() time of each). Returns the
    per-request dicts (times from t0); a continued request's prompt is its predecessor's prompt and output
    followed by its own tokens.
    """
    t0 = time.perf_counter()
    done = [asyncio.Event() for _ in requests]
    convo: list[list[int]] = [[] for _ in requests]  # each request's prompt + output (for continued turns)
    out: list[dict] = [{} for _ in requests]

    async def one(i: int, r: Request) -> None:
        if r.after is not None:
            await done[r.after].wait()
        delay = t0 + r.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        prompt = (convo[r.after] if r.continues else []) + r.prompt_ids
        start = time.perf_counter()
        ids, times = await send(r, prompt)
        end = time.perf_counter()
        convo[i] = prompt + list(ids)
        out[i] = {
            "tag": r.tag,
            "prompt_tokens": len(prompt),
            "tokens": len(ids),
            "start": start - t0,
            "first": (times[0] if times else end) - t0,
            "end": end - t0,
            "token_times": [t - t0 for t in times],
        }
        done[i].set()

    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return out
