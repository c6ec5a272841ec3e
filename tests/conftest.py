"""Shared helpers and fixtures, the one copy of each: bounded async runs, the in-process app client
(``serving``), FakeEngine's expected answers (``fake_text``/``fake_ids``) and its recording and failing variants
(``RecordingEngine``, ``Boom``), the error-shape check (``assert_error``, ``assert_error_body``), SSE reading
(``sse_events``), metrics scraping (``scrape``, ``metric``), engine construction (``make_engine``), the
kernel-availability gate (``need_kernel``, ``need_native``: a skip, or a failure under ``REQUIRE_KERNELS=1``), and
the test checkpoints built once per session. Real-socket servers are in ``live.py``."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from contextlib import asynccontextmanager, contextmanager

import pytest

from api.errors import error_code
from engine import FakeEngine  # torch-free
from models.kernels.build import has_avx512  # torch-free

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One cache root for the run (compiled kernels, model images, converted checkpoints; the fetched SmolLM2 is there
# too): the kernels take minutes of compiling on 2 cores, once per root. A test that needs a root of its own shares
# this one's kernels (``private_cache_root``). A developer's own MINIBATCH_CACHE wins.
os.environ.setdefault("MINIBATCH_CACHE", os.path.join(ROOT, "weights", "cache"))


def private_cache_root(root: str) -> str:
    """Make ``root`` a cache root of a test's own (images, checkpoints) whose ``kernels`` are the run's."""
    from models.kernels.build import kernel_dir

    shared = kernel_dir()
    os.makedirs(shared, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    os.symlink(shared, os.path.join(root, "kernels"))
    return root


@pytest.fixture(autouse=True, scope="session")
def _exact_activations():
    """Under ACTIVATIONS=auto the tests run every quantized linear on fp32 activations (the exact path): the parity
    gates compare with HF token for token, which int8 activations are not (docs/integer-dot.md). The integer path
    and the measured defaults are tested where they are asked for (tests/test_int_dot.py); servers started by
    ``live.ProcessServer`` get ACTIVATIONS=fp32 unless a test sets it."""
    from models.kernels import int_dot  # torch-free

    saved = {kind: dict(rows) for kind, rows in int_dot.AUTO_ROWS.items()}
    for rows in int_dot.AUTO_ROWS.values():
        rows.update(dict.fromkeys(rows))
    int_dot.set_activations(int_dot.activations())  # kernels loaded already follow too
    yield
    for kind, rows in saved.items():
        int_dot.AUTO_ROWS[kind].update(rows)


SERVING_AUTO_KV = {}  # what KV_CACHE_DTYPE=auto gives quantized weights when served ("dtype"), saved by _exact_kv_pool


@pytest.fixture(autouse=True, scope="session")
def _exact_kv_pool():
    """Under KV_CACHE_DTYPE=auto the tests give quantized weights an fp32 pool (served, they get int8:
    docs/kv-cache.md): the parity gates compare with HF token for token, which a narrower pool is not. The narrow
    pools and the served default are tested where they are asked for (tests/test_kv_dtype.py); servers started by
    ``live.ProcessServer`` get KV_CACHE_DTYPE=fp32 unless a test sets it."""
    from models import runtime_config  # torch-free

    SERVING_AUTO_KV["dtype"] = runtime_config.AUTO_QUANTIZED_KV
    runtime_config.AUTO_QUANTIZED_KV = "fp32"
    yield
    runtime_config.AUTO_QUANTIZED_KV = SERVING_AUTO_KV["dtype"]


def run(coro):
    """Run a coroutine to completion on a fresh event loop (no pytest-asyncio needed)."""
    return asyncio.run(coro)


TIMEOUT = 20.0  # seconds any single async test may take


def randn(seed: int, *shape: int, scale: float = 1.0):
    """Standard normal float32 logits [*shape] from a fixed seed (numpy)."""
    import numpy as np

    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def fake_text(prompt: str, n: int) -> str:
    """FakeEngine's default answer to ``prompt`` after ``n`` tokens, computed independently of its
    letter_token: the n-th letter is chosen by the prompt's byte sum and n."""
    s = sum(b + 1 for b in prompt.encode("utf-8"))
    return "".join(chr(ord("a") + (s * 7 + i * 3) % 26) for i in range(n))


def fake_ids(prompt: str, n: int) -> list[int]:
    """The token ids behind ``fake_text`` (FakeEngine's byte-level ids: byte + 1)."""
    return [ord(c) + 1 for c in fake_text(prompt, n)]


class Gate:
    """A switch the engine's worker thread waits on (pass ``gate.wait`` as a FakeEngine fault hook)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()

    def wait(self, *_):
        self.entered.set()
        assert self.open.wait(TIMEOUT), "gate never opened"


@asynccontextmanager
async def serving(engine=None, **config):
    """An httpx client on the app (FakeEngine by default) with its lifespan running; client.app is the app.
    ``config``: Config fields (MAX_NEW_TOKENS_LIMIT 64 unless given)."""
    import httpx

    from config import Config
    from engine import FakeEngine
    from server import create_app

    config.setdefault("max_new_tokens_limit", 64)
    app = create_app(config=Config(model_id="fake", **config), engine=engine or FakeEngine(capacity=4))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def runtime_knobs(runtime: str) -> dict:
    """Config fields that serve a test checkpoint on ``runtime``: "torch" (fp32, the torch forward) or "native"
    (int8, the torch-free model image; skips where its kernel cannot build). Use with ``RUNTIMES``."""
    if runtime == "torch":
        return {}
    need_native()
    return {"weights": "int8", "runtime": "native", "kv_cache_dtype": "fp32"}  # auto would be int8: parity needs fp32


RUNTIMES = ("torch", "native")  # parametrize a real-server test over both runtimes (``runtime_knobs``)


needs_avx512 = pytest.mark.skipif(
    not has_avx512(), reason="the CPU has no AVX-512 F/BW/VL: only the AVX2 kernels run here"
)


@pytest.fixture
def kernel_isa():
    """``set_kernel_isa`` for one test (``auto`` or ``avx2``); the kernels are back at ``auto`` after it."""
    from models.kernels.build import set_kernel_isa

    yield set_kernel_isa
    set_kernel_isa("auto")


def assert_runtime(engine, runtime: str) -> None:
    """The server really runs ``runtime`` (no silent fallback)."""
    assert (type(engine).__name__ == "NativeEngine") == (runtime == "native"), type(engine).__name__


def assert_pool_full(engine) -> None:
    """The KV pool is full again (after load, faults, aborts, drain): every block free, no sequence holding a
    block table, nothing active. ``engine``: an engine, or the ``engine`` stats of a server's ``/health``
    (a server in another process). The one definition of "full": a prefix cache may count cached blocks as free.
    """
    if isinstance(engine, dict):
        assert engine["kv_free_blocks"] == engine["kv_blocks"] and engine["num_prefilling"] == 0, engine
        return
    bm = engine.blocks
    bm.check()  # every block free xor held by a table, counts consistent
    assert engine.active_sequences() == [], [s.seq_id for s in engine.active_sequences()]
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} of {bm.num_blocks} KV blocks still held"


def bounded(coro_fn, timeout: float = TIMEOUT):
    return run(asyncio.wait_for(coro_fn(), timeout))


async def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` on the event loop until true; fail naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.001)


def assert_error(r, status: int, kind: str | None = None, contains: str | None = None) -> dict:
    """A response that is an error answer: ``status``, OpenAI's error shape (``assert_error_body``)."""
    assert r.status_code == status, r.text
    return assert_error_body(r.json(), status, *([contains] if contains is not None else []), kind=kind)


def assert_error_body(body: dict | bytes | str, status: int, *words: str, kind: str | None = None) -> dict:
    """An error body (a dict, or its JSON text) in OpenAI's shape, code ``status``, its message holding each of
    ``words``, its type ``kind`` when given; -> the ``error`` object."""
    if isinstance(body, (bytes, str)):
        body = json.loads(body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["code"] == error_code(status, err["param"]) and err["type"] and err["message"].strip(), err
    if kind is not None:
        assert err["type"] == kind, err
    for word in words:
        assert word in err["message"], err
    return err


def sse_events(body: str) -> list:
    """The data payloads of a server-sent-events body, in order: each JSON payload parsed, and "[DONE]"."""
    out = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def read_sse(response) -> list:
    """The data payloads of a streamed httpx response (``client.stream(...)``), read to its end: each JSON payload
    parsed, and "[DONE]" (``sse_events`` for a body read whole)."""
    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def scrape(client) -> str:
    """``GET /metrics`` through ``client`` (an httpx client): the Prometheus text, after checking its content type."""
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    return r.text


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text (``labels`` like ``finished_reason="stop"``)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(key)


# --- engines -----------------------------------------------------------------------------------------------
def make_engine(model_id: str, capacity: int = 4, **config):
    """An ``HFEngine`` on ``model_id`` with ``capacity`` slots and 2 threads; ``config``: other Config fields (an fp32
    KV pool unless they say otherwise: the parity gates' exact one, also beside quantized weights)."""
    from config import Config
    from models.runtime import HFEngine

    config.setdefault("kv_cache_dtype", "fp32")
    return HFEngine(Config(model_id=model_id, max_batch_size=capacity, num_threads=2, **config))


class Boom(RuntimeError):
    """The fault tests inject (an engine call, a hook) and expect to see contained."""


class RecordingEngine(FakeEngine):
    """A FakeEngine that logs, as each step's output is applied (``planner.update_from_output``), its admissions,
    its finishes and ``num_active`` after it, and keeps the messages its chat template was last given (``seen``)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.active_log: list[int] = []
        self.admitted: list[int] = []  # seq_ids in admission order
        self.admit_groups: list[list[int]] = []
        self.events: list[tuple[str, int]] = []
        self.seen: list[dict] | None = None
        update = self.planner.update_from_output

        def recorded(plan, output, now=None):
            result = update(plan, output, now)
            ids = [s.seq_id for s in plan.newcomers]
            if ids:
                self.admitted += ids
                self.admit_groups.append(ids)
            self.events += [("admit", i) for i in ids] + [("finish", s.seq_id) for s in result.finished]
            self.active_log.append(self.num_active())
            return result

        self.planner.update_from_output = recorded

    def apply_chat_template(self, messages, tools=None):
        self.seen = messages
        return super().apply_chat_template(messages, tools)


# --- compiled kernels: skipped where they cannot run, a failure in CI ------------------------------------
REQUIRE_KERNELS = os.environ.get("REQUIRE_KERNELS") == "1"  # .ci/run sets it: CI must test every kernel


def kernel_unavailable(what: str, reason: str | None) -> None:
    """``what`` (a compiled kernel, the native runtime) cannot run here: skip the test, or, with
    ``REQUIRE_KERNELS=1``, fail it, so a run without a C compiler or AVX2 cannot go green having tested neither."""
    message = f"{what} unavailable: {reason or 'unknown reason'}"
    if REQUIRE_KERNELS:
        pytest.fail(f"{message} (REQUIRE_KERNELS=1)", pytrace=False)
    pytest.skip(message)


def need_kernel(module, what: str):
    """The loaded library of a kernel module (``models.kernels.*``: its ``load()`` and ``KERNEL``), built on first
    use; ``kernel_unavailable`` where it cannot be built or run."""
    lib = module.load()
    if lib is None:
        kernel_unavailable(f"{what} kernel", module.KERNEL.unavailable_reason)
    return lib


def need_native() -> None:
    """The torch-free native runtime can run here (its step kernel builds), else ``kernel_unavailable``."""
    from models.native import unavailable_reason

    reason = unavailable_reason()
    if reason:
        kernel_unavailable("the native runtime", reason)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random GPT-2 (initializer_range 0.15) with a trained BPE tokenizer; pad unset."""
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny")), shape="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_pad_model_dir(tmp_path_factory) -> str:
    """Same shape, other weights, and a tokenizer whose pad id differs from EOS."""
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny_pad")), shape="tiny", seed=1, with_pad=True)


# --- parity helpers: the model gates (test_parity.py, test_llama.py) -------------------------------

PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "def fibonacci(n):\n    a, b = 0, 1\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman",
    "Numbers: 0 1 2 3 4 5",
]
EOS_PROMPTS = [*PROMPTS, "The capital of France is", "import torch; x =", "Prices rose by 12%", "café naïve"]


def checkpoint_eos(model, tokenizer) -> set[int]:
    """EOS as the checkpoint declares it (HF generation config, else the tokenizer): never the engine's."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {eos}


class Reference:
    """Standalone greedy HF ``generate``, one prompt at a time: the ground truth of the model gates.

    Greedy decoding is deterministic and a stop only cuts it short, so each prompt is generated once, for the
    longest budget asked so far, with no stops; ``generate`` trims that run to the budget and stop set it is asked
    for (what ``generate`` with those would return). Modify ``model`` (e.g. dequantize it) before the first
    ``generate`` only."""

    def __init__(self, model_dir: str) -> None:
        import torch
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = checkpoint_eos(self.model, self.tokenizer)
        self._greedy: dict[tuple[int, ...], list[int]] = {}  # prompt -> its longest greedy run without stops

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generate(self, prompt: list[int], max_new_tokens: int, stops: set[int], processors=None) -> list[int]:
        """Greedy tokens after ``prompt``, ending at (and keeping) the first of ``stops``; ``processors``: HF
        logits processors applied before the argmax (not cached)."""
        import torch

        from models.hf_baseline import trim

        key = tuple(prompt)
        if processors is None and len(self._greedy.get(key, ())) >= max_new_tokens:
            return trim(self._greedy[key], max_new_tokens, stops)
        ids = torch.tensor([prompt])
        with torch.inference_mode(), small_model_threads(self.model):
            out = self.model.generate(
                input_ids=ids,  # only input_ids and attention_mask: no token_type_ids
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=(sorted(stops) or None) if processors is not None else None,
                pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0,
                logits_processor=processors,
            )
        tokens = out[0, len(prompt) :].tolist()
        if processors is None:
            self._greedy[key] = tokens
        return trim(tokens, max_new_tokens, stops)


@contextmanager
def small_model_threads(model, below: int = 20_000_000):
    """One torch thread while a model of fewer than ``below`` parameters runs: a test model's ops are too small to
    split, and a second thread only spins (on a busy 2-core box it cost 14x the CPU time of one)."""
    import torch

    before = torch.get_num_threads()
    if sum(p.numel() for p in model.parameters()) < below:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def drive(engine, batches: list, fused: bool = True) -> None:
    """Step the engine; admit each (step_no, seqs) group at that step (when capacity allows).

    fused: a group joining a running batch is prefilled in the decode step's forward
    (``admit_and_step``, as the scheduler does); else ``admit`` then ``step``.
    """
    pending = sorted(batches, key=lambda b: b[0])
    step = 0
    while pending or engine.num_active():
        joining = []
        while (
            pending
            and pending[0][0] <= step
            and engine.num_active() + len(joining) + len(pending[0][1]) <= engine.capacity
        ):
            joining += pending.pop(0)[1]
        if fused and joining and engine.num_active():
            engine.admit_and_step(joining)
        else:
            engine.admit(joining)
            engine.step()
        step += 1
        assert step < 10_000


def schedule_all(engine, seqs: list, max_steps: int = 2000) -> None:
    """The scheduler's loop, synchronous and bounded: each step the planner admits what fits of the queue (FCFS)
    and reserves the running sequences' slots, the engine executes the plan, the planner applies its output, and
    the preempted go back to the front of the queue; until every one of ``seqs`` has finished."""
    waiting = list(seqs)
    for _ in range(max_steps):
        plan = engine.planner.schedule(waiting)
        admitted = {id(s) for s in plan.newcomers}
        waiting = plan.preempted + [s for s in waiting if id(s) not in admitted]
        engine.planner.update_from_output(plan, engine.execute(plan))
        if all(s.is_finished for s in seqs):
            return
    raise AssertionError("sequences did not finish")


def seqs_for(ref: Reference, prompts: list[str], budgets: list[int], **kw) -> list:
    from core.sequence import Sequence

    return [Sequence(prompt_token_ids=ref.encode(p), max_new_tokens=n, **kw) for p, n in zip(prompts, budgets)]


def expected(ref: Reference, seq, stops: set[int]) -> list[int]:
    """HF's greedy output for ``seq``, ending at ``stops`` unless the sequence ignores EOS (as the engine does)."""
    return ref.generate(seq.prompt_token_ids, seq.max_new_tokens, set() if seq.ignore_eos else stops)


def repoint_eos(src_dir: str, out_dir: str, prompts: list[str], n_tokens: int = 16, min_hits: int = 3) -> int:
    """Copy a checkpoint, making its EOS a token that its greedy output really emits mid-sequence.

    Random weights almost never produce their tokenizer's EOS, so the default-EOS gates would not
    test stopping at all. This picks the token that first appears at an index in [2, n_tokens - 2)
    of the most prompts' greedy outputs and declares it EOS in the saved generation config (the
    checkpoint's own EOS, which both HF and the engine read). Returns the new EOS id.
    """
    return next(iter(repointed_reference(src_dir, out_dir, prompts, n_tokens, min_hits).eos))


def repointed_reference(
    src_dir: str, out_dir: str, prompts: list[str], n_tokens: int = 16, min_hits: int = 3
) -> Reference:
    """``repoint_eos``, returning the ``Reference`` of the new checkpoint (its greedy runs of ``prompts`` done)."""
    import shutil
    from collections import Counter

    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    ref = Reference(out_dir)
    hits: Counter = Counter()
    for prompt in prompts:
        out = ref.generate(ref.encode(prompt), n_tokens, set())
        firsts = {t: i for i, t in reversed(list(enumerate(out)))}  # token -> index of its first occurrence
        hits.update(t for t, i in firsts.items() if 2 <= i < n_tokens - 2)
    token, count = hits.most_common(1)[0]
    assert count >= min_hits, f"no token ends {min_hits} greedy outputs mid-way: {hits.most_common(3)}"
    ref.model.generation_config.eos_token_id = token
    ref.model.config.eos_token_id = token
    ref.model.save_pretrained(out_dir)
    ref.eos = {token}
    return ref


# --- KV pool gates (test_kv_pool.py, test_prefix_cache.py) ----------------------------------------------


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def pressure_model(request, tmp_path_factory) -> str:
    """Tiny random GPT-2, and a tiny random Llama (GQA: 4 query heads over 2 K/V heads)."""
    if request.param == "gpt2":
        return request.getfixturevalue("tiny_model_dir")
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("llama_pool")), arch="llama", seed=2, tied=False)


def pool_mb(model_dir: str, blocks: int, block_size: int, kv_dtype: str = "fp32") -> float:
    """KV_CACHE_MB that buys exactly ``blocks`` blocks of ``block_size`` tokens for this checkpoint (a pool of
    ``kv_dtype`` elements)."""
    import transformers

    from models import families

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    return families()[cfg.model_type].kv_bytes_per_token(cfg, kv_dtype) * block_size * blocks / 2**20


# --- LoRA adapters (test_lora.py, test_lora_http.py) -----------------------------------------------------

# Three random adapters per base, written by PEFT: every linear at rank 8; attention only, rank 16, rsLoRA; the MLP
# only, rank 4 (GPT-2's c_proj is both its attention output and its MLP's down linear).
LORA_ADAPTERS = {
    "llama": {
        "all8": {"rank": 8, "seed": 1},
        "qv16": {"rank": 16, "alpha": 8, "seed": 2, "modules": ["q_proj", "v_proj"], "use_rslora": True},
        "mlp4": {"rank": 4, "seed": 3, "modules": ["gate_proj", "up_proj", "down_proj"]},
    },
    "gpt2": {
        "all8": {"rank": 8, "seed": 1},
        "qv16": {"rank": 16, "alpha": 8, "seed": 2, "modules": ["c_attn"], "use_rslora": True},
        "mlp4": {"rank": 4, "seed": 3, "modules": ["c_fc", "c_proj"]},
    },
}


@pytest.fixture(scope="session")
def lora_checkpoints(tmp_path_factory):
    """arch ("llama" or "gpt2") -> (a tiny random checkpoint, {adapter name: its PEFT directory}), built once."""
    built: dict[str, tuple[str, dict[str, str]]] = {}

    def get(arch: str) -> tuple[str, dict[str, str]]:
        if arch not in built:
            from scripts.make_test_adapter import build_adapter
            from scripts.make_test_model import build_checkpoint

            root = tmp_path_factory.mktemp(f"lora_{arch}")
            model_dir = build_checkpoint(str(root / "base"), arch=arch, seed=2, tied=False)
            adapters = {
                name: build_adapter(model_dir, str(root / name), **kw) for name, kw in LORA_ADAPTERS[arch].items()
            }
            built[arch] = model_dir, adapters
        return built[arch]

    return get


def peft_reference(model_dir: str, adapter_dir: str | None = None, weights: str = "fp32") -> Reference:
    """``Reference`` of HF + PEFT's ``generate`` with the adapter in ``adapter_dir`` (None: the base alone), over the
    base's weights as the engine multiplies by them under ``WEIGHTS=weights`` (int8 / int4: dequantized)."""
    ref = Reference(model_dir)
    if weights != "fp32":
        from models.quant import dequantize_hf_model_

        dequantize_hf_model_(ref.model, weights)
    if adapter_dir is not None:
        from peft import PeftModel

        ref.model = PeftModel.from_pretrained(ref.model, adapter_dir).eval()
    return ref


def lora_modules(adapters: dict[str, str]) -> str:
    """LORA_MODULES serving every adapter of ``adapters`` ({name: path})."""
    return ",".join(f"{name}={path}" for name, path in adapters.items())
