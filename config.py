"""Server configuration: one validated dataclass, read once from the environment.

Every knob has a default that serves ``distilgpt2`` on a small CPU box. A bad value
fails at startup with a ``ConfigError`` that names the variable, never later at
request time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from core.fair_queue import POLICIES  # torch-free
from core.speculative import MAX_SPEC_TOKENS, SPEC_METHODS, SpecParams  # torch-free
from models.kernels.build import KERNEL_ISAS  # torch-free
from models.kernels.int_dot import ACTIVATIONS  # torch-free
from models.kernels.packing import CHOICES as PACK_CHOICES  # torch-free
from models.kv_dtype import KV_DTYPES  # torch-free

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
WEIGHT_FORMATS = ("auto", "fp32", "int8", "int4")  # models/quant.py serves each
POOLINGS = ("mean", "last")  # EMBEDDING_POOLING
RUNTIMES = ("auto", "torch", "native")  # models.runtime.build_engine picks the engine by it
# A CORS origin: "*", or scheme://host[:port] with no path (what browsers send in Origin).
_ORIGIN = re.compile(r"\*|https?://[A-Za-z0-9.\-\[\]:]+")
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")  # an RFC 9110 token


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""


@dataclass(frozen=True)
class Config:
    # Model: a hub id, a local checkpoint directory, or "fake" (FakeEngine, no torch).
    model_id: str = "distilgpt2"
    # Most sequences running at once (decoded together in one step); KV memory is KV_CACHE_MB's business.
    max_batch_size: int = 8
    # Most requests waiting for a slot; one more gets a 503.
    max_queue_depth: int = 1024
    # Upper bound a request may ask for in max_new_tokens.
    max_new_tokens_limit: int = 512
    # "auto" picks cuda when available, else cpu; or "cpu", "cuda", "cuda:N".
    device: str = "auto"
    # Longest sequence (prompt + generated tokens). 0 = the model's context window.
    max_model_len: int = 0
    # --- KV cache: one pool of blocks (see core/block_manager.py) ---
    # Tokens per KV block (measured fastest for decode attention: 32; scripts/bench_paged_attention.py).
    kv_block_size: int = 32
    # KV pool size in MiB. 0 = enough for MAX_BATCH_SIZE sequences of MAX_MODEL_LEN tokens, capped at a
    # quarter of the machine's RAM.
    kv_cache_mb: float = 0.0
    # Element type of the KV pool: "fp32" (exact: what the parity gates run), "fp16" or "bf16" (half the bytes per
    # token: KV_CACHE_MB holds 2x the tokens), "int8" (q8_0-like, one scale per token and head: ~3.8x), or "auto":
    # fp32 beside fp32 weights, int8 beside quantized ones (a GGUF, WEIGHTS=int8 / int4). Read in place by the
    # attention kernels on both runtimes. docs/kv-cache.md has the quality and speed measured per dtype.
    kv_cache_dtype: str = "auto"
    # Chunked prefill: most tokens one engine step feeds (decode rows first, then prompt chunks), so a long
    # prompt loads over several steps while running streams keep getting tokens. 0 = off (whole prompts).
    # 256: half 512's worst stall at the same throughput (docs/performance.md "The KV pool, measured").
    max_num_batched_tokens: int = 256
    # While any stream decodes, most prompt tokens one step carries (within MAX_NUM_BATCHED_TOKENS): a newcomer's
    # prompt loads over a few short steps, so the running streams' inter-token gaps stay short. 0 = no cap of its
    # own. docs/performance.md "Inter-token latency while newcomers join".
    max_prefill_tokens_while_decoding: int = 0
    # Automatic prefix caching: full KV blocks stay cached by the hash of their tokens and prefix, and a new
    # sequence shares the longest cached prefix of its prompt instead of computing it (core/block_manager.py).
    prefix_caching: bool = True
    # --- speculative decoding (core/speculative.py, docs/speculative.md) ---
    # The default of requests that do not choose (the API's `speculative` field): "off", "ngram" (prompt lookup:
    # drafts are what followed the sequence's last tokens earlier in its prompt or output, verified in one forward;
    # the output is the output without drafts, token for token), or "draft_model" (SPECULATIVE_MODEL proposes them).
    speculative_method: str = "off"
    # A draft model (a MODEL_ID: alias, hub id, directory or .gguf) with the target's tokenizer, served in the same
    # process on the same runtime kind with its own KV pool (KV_CACHE_MB as the target's), proposing the drafts of
    # requests that choose "draft_model". "" = none (a request asking for one gets a 400). models/draft_model.py.
    speculative_model: str = ""
    # Most draft tokens a sequence verifies per step, and the n-gram lengths prompt lookup matches (longest first).
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No drafts while this many sequences or more decode (0 = never off): a busy batch is compute-bound, and a
    # draft's verify row costs real time there.
    speculative_disable_by_batch_size: int = 4
    # Each sequence's draft length follows its measured acceptance (up to NUM_SPECULATIVE_TOKENS), and a busier batch
    # asks more of a draft (core/speculative.py DraftLength); false: always NUM_SPECULATIVE_TOKENS where a draft exists.
    speculative_adaptive: bool = True
    # Torch intra-op threads. 0 = the physical cores of this machine (measured fastest at 1 and 8 streams
    # with OpenMP's passive wait, which the engine sets before torch loads; docs/performance.md "Threads").
    num_threads: int = 0
    # Decode-step linears through the small-batch AVX2 kernel (small_gemm.c, compiled once with the
    # system C compiler); off, or where it cannot build, every linear uses oneDNN.
    small_gemm: bool = True
    # Weight precision (see models/quant.py): "auto" serves a .gguf at its own quantization and a
    # safetensors checkpoint in fp32; "fp32", "int8" (per 32-group, = GGUF Q8_0) or "int4" (per
    # 32-group scale + min, = GGUF Q4_1) for any checkpoint. int8 and int4 run on the CPU only.
    weights: str = "auto"
    # What runs the model: "torch" (our torch forward, any device and weights), "native" (a model image built once
    # in a torch child process, run by the compiled step kernel in a process that never imports torch: CPU only,
    # a fraction of the memory), or "auto": native for quantized weights (a GGUF at WEIGHTS=auto, or int8 / int4)
    # where the kernel builds, else torch. docs/performance.md "Memory".
    runtime: str = "auto"
    # Instruction set of the quantized kernels: "auto" runs their AVX-512 paths where the CPU has AVX-512 F/BW/VL
    # (the same bits as AVX2), "avx2" their AVX2 paths everywhere. docs/quantization.md.
    kernel_isa: str = "auto"
    # Activations of the quantized linears (every GGUF type but F32 / F16 / BF16; WEIGHTS=int8 / int4 make
    # Q8_0 / Q4_1): "fp32"
    # multiplies fp32 activations (bit for bit HF's math on the file's weights), "int8" rounds them to int8 per
    # 32-block (as llama.cpp does) for integer dot products (VNNI / AVX2) in every step, "auto" does so from the
    # step size measured to gain (models/kernels/int_dot.py AUTO_ROWS). The float types always multiply fp32
    # activations. docs/integer-dot.md.
    activations: str = "auto"
    # Q4_K linears repacked at load into panels of 32 columns that the integer path streams linearly (the same bytes,
    # moved; the same results bit for bit): "auto" where that path runs AVX-512 VNNI and ACTIVATIONS takes Q4_K
    # int8 from one row (the native runtime), "off" never. docs/integer-dot.md "Packed Q4_K".
    pack_weights: str = "auto"
    # --- LoRA adapters (models/lora.py, docs/api.md "LoRA adapters") ---
    # Adapters served from startup, as name=path pairs (comma-separated), each path a PEFT adapter directory
    # (adapter_config.json + adapter_model.safetensors). A request chooses one by its name in `model`.
    lora_modules: str = ""
    # Most adapters resident at once (LORA_MODULES and POST /v1/load_lora_adapter together). 0 = LoRA off.
    max_loras: int = 4
    # Highest rank an adapter may have (an adapter above it is refused by name).
    max_lora_rank: int = 64
    # Extra token ids that end a sequence besides the tokenizer's EOS (comma-separated).
    stop_token_ids: tuple[int, ...] = ()
    # Name the OpenAI endpoints answer to (GET /v1/models, the "model" field). "" = MODEL_ID.
    served_model_name: str = ""
    # Chat template (Jinja) for models without one, as text or a path to a file. "" = the tokenizer's own.
    chat_template: str = ""
    # Tools for a model whose chat template does not render them: described in a system preamble, calls answered as
    # a JSON object (guided/tools.py GENERIC, docs/api.md "Tool calling"); false: such requests get a 400.
    generic_tools: bool = True
    # POST /v1/embeddings: how a prompt's final hidden states (after the final norm) become one vector, L2-normalized:
    # "mean" over its positions or its "last" position's.
    embedding_pooling: str = "mean"
    # Seconds a request may wait in the queue / live in total before it ends with a 504. 0 = no limit. 600 s total:
    # the openai SDK's own default timeout, past which its caller has given up (and retried); 300 s waiting for a
    # first slot: an overload no client waits out (docs/operations.md "Fair scheduling").
    max_queue_time_s: float = 300.0
    request_timeout_s: float = 600.0
    # Admission order (core/fair_queue.py): "fair" (between clients, then between requests; a client or request owed
    # its share of the slots preempts one of the most-served) or "fcfs" (arrival order: one request's sequences can
    # hold every slot).
    scheduling_policy: str = "fair"
    # Most sequences (prompts x n) one request may queue; beyond it, 422.
    max_sequences_per_request: int = 256
    # Fraction of MAX_QUEUE_DEPTH one client's waiting sequences may fill; beyond it that client gets a 503 while the
    # others still get in. 1 = no share of its own.
    max_client_queue_share: float = 0.5
    # Request header that names the client for fair scheduling, set by a trusted proxy in front (e.g. X-User-Id or
    # X-Forwarded-For). "" = the peer's address.
    client_id_header: str = ""
    # Most top logprobs a request may ask for.
    max_logprobs: int = 5
    # Most logprob entries (tokens x (1 + alternatives), prompt and output, all choices) one answer may carry; beyond
    # it, 422. 500,000: ~13 MB of JSON.
    max_logprob_entries: int = 500_000
    # Most choices (n) one /v1 request may ask for; beyond it, 422.
    max_n: int = 8
    # Most prompts one /v1/completions request may carry (a list of texts or of token-id lists); beyond it, 422.
    max_prompts_per_request: int = 32
    host: str = "127.0.0.1"
    port: int = 8000
    # --- operations (see api/ops.py) ---
    # Level of the server's logs (one key=value line per finished request at INFO).
    log_level: str = "INFO"
    # When set, every endpoint but /health, /ready and /metrics needs "Authorization: Bearer <key>".
    api_key: str = field(default="", repr=False)
    # Largest request body in bytes; beyond it, 413.
    max_body_bytes: int = 1_048_576
    # Longest prompt in characters (after the chat template), checked before tokenizing; beyond it, 422. 0 = no limit.
    max_prompt_chars: int = 100_000
    # Most HTTP requests in flight at once (probes excluded); beyond it, 429. 0 = no limit.
    max_concurrent_requests: int = 2048
    # Seconds in-flight requests get to finish after SIGTERM before the rest are aborted.
    drain_timeout_s: float = 30.0
    # MODEL_ID=fake only (tests, demos): seconds each decode step sleeps; every Nth decode step raises (0 = never).
    fake_step_delay_s: float = 0.0
    fake_step_fault_every: int = 0
    # MODEL_ID=fake only: KV blocks (of KV_BLOCK_SIZE tokens) in the fake's pool, to exercise admission by
    # memory and preemption without a model. 0 = enough for every slot at the fake's context.
    fake_kv_blocks: int = 0
    # --- slow clients and connections (see api/ops.py, api/transport.py) ---
    # Seconds a request body may take to arrive once its headers have; then 408. 0 = no limit.
    body_timeout_s: float = 10.0
    # Seconds a connection may take to send a request's headers (fresh, or between keep-alive requests); then closed.
    header_timeout_s: float = 10.0
    # Seconds an idle keep-alive connection stays open after its last response.
    timeout_keep_alive_s: float = 5.0
    # Most open connections plus running request tasks (uvicorn's limit_concurrency); beyond it uvicorn
    # answers 503. 0 = no limit.
    limit_concurrency: int = 4096
    # Largest request head (request line + headers) in bytes; beyond it, 400 (uvicorn's h11_max_incomplete_event_size).
    max_header_bytes: int = 65536
    # Threads that tokenize, detokenize and render chat templates, off the event loop.
    tokenizer_threads: int = 2
    # Origins browsers may call the API from (CORS), comma-separated, or "*"; "" = CORS off (no CORS headers).
    cors_allow_origins: str = ""

    def __post_init__(self) -> None:
        _check(self.model_id.strip() != "", "MODEL_ID", "must not be empty")
        _check(1 <= self.max_batch_size <= 1024, "MAX_BATCH_SIZE", "must be in [1, 1024]")
        _check(1 <= self.max_queue_depth <= 1_000_000, "MAX_QUEUE_DEPTH", "must be in [1, 1000000]")
        _check(1 <= self.max_new_tokens_limit <= 1_000_000, "MAX_NEW_TOKENS_LIMIT", "must be in [1, 1000000]")
        _check(self.max_model_len >= 0, "MAX_MODEL_LEN", "must be >= 0 (0 = the model's context window)")
        _check(0 <= self.num_threads <= 1024, "NUM_THREADS", "must be in [0, 1024]")
        _check(1 <= self.kv_block_size <= 256, "KV_BLOCK_SIZE", "must be in [1, 256]")
        _check(
            0 <= self.kv_cache_mb <= 1 << 24,
            "KV_CACHE_MB",
            "must be a number in [0, 16777216] (0 = sized from MAX_BATCH_SIZE)",
        )
        _check(
            self.kv_cache_dtype in ("auto", *KV_DTYPES),
            "KV_CACHE_DTYPE",
            f"must be one of auto, {', '.join(KV_DTYPES)} (got {self.kv_cache_dtype!r})",
        )
        _check(
            0 <= self.max_num_batched_tokens <= 1 << 20, "MAX_NUM_BATCHED_TOKENS", "must be in [0, 1048576] (0 = off)"
        )
        _check(
            0 <= self.max_prefill_tokens_while_decoding <= 1 << 20,
            "MAX_PREFILL_TOKENS_WHILE_DECODING",
            "must be in [0, 1048576] (0 = no cap while streams decode)",
        )
        _check(
            self.speculative_method in SPEC_METHODS,
            "SPECULATIVE_METHOD",
            f"must be one of {', '.join(SPEC_METHODS)} (got {self.speculative_method!r})",
        )
        _check(
            self.speculative_method != "draft_model" or self.speculative_model != "",
            "SPECULATIVE_METHOD",
            "draft_model needs SPECULATIVE_MODEL, the draft model (a MODEL_ID with the target's tokenizer)",
        )
        _check(
            1 <= self.num_speculative_tokens <= MAX_SPEC_TOKENS,
            "NUM_SPECULATIVE_TOKENS",
            f"must be in [1, {MAX_SPEC_TOKENS}]",
        )
        _check(1 <= self.prompt_lookup_min <= 32, "PROMPT_LOOKUP_MIN", "must be in [1, 32]")
        _check(
            self.prompt_lookup_min <= self.prompt_lookup_max <= 32,
            "PROMPT_LOOKUP_MAX",
            f"must be in [PROMPT_LOOKUP_MIN, 32] (PROMPT_LOOKUP_MIN is {self.prompt_lookup_min})",
        )
        _check(
            0 <= self.speculative_disable_by_batch_size <= 1 << 20,
            "SPECULATIVE_DISABLE_BY_BATCH_SIZE",
            "must be >= 0 (0 = never off)",
        )
        _check(self.fake_kv_blocks >= 0, "FAKE_KV_BLOCKS", "must be >= 0 (0 = enough for every slot)")
        _check(all(t >= 0 for t in self.stop_token_ids), "STOP_TOKEN_IDS", "must be non-negative integers")
        _check(1 <= self.port <= 65535, "PORT", "must be in [1, 65535]")
        _check(0 <= self.max_queue_time_s < float("inf"), "MAX_QUEUE_TIME_S", "must be a finite number >= 0")
        _check(0 <= self.request_timeout_s < float("inf"), "REQUEST_TIMEOUT_S", "must be a finite number >= 0")
        _check(
            self.scheduling_policy in POLICIES,
            "SCHEDULING_POLICY",
            f"must be one of {', '.join(POLICIES)} (got {self.scheduling_policy!r})",
        )
        _check(1 <= self.max_sequences_per_request <= 1 << 20, "MAX_SEQUENCES_PER_REQUEST", "must be in [1, 1048576]")
        _check(0 < self.max_client_queue_share <= 1, "MAX_CLIENT_QUEUE_SHARE", "must be a number in (0, 1]")
        _check(
            self.client_id_header == "" or _HEADER_NAME.fullmatch(self.client_id_header) is not None,
            "CLIENT_ID_HEADER",
            f"must be an HTTP header name (got {self.client_id_header!r})",
        )
        _check(0 <= self.max_logprobs <= 20, "MAX_LOGPROBS", "must be in [0, 20]")
        _check(1 <= self.max_logprob_entries <= 100_000_000, "MAX_LOGPROB_ENTRIES", "must be in [1, 100000000]")
        _check(1 <= self.max_n <= 128, "MAX_N", "must be in [1, 128]")
        _check(1 <= self.max_prompts_per_request <= 1024, "MAX_PROMPTS_PER_REQUEST", "must be in [1, 1024]")
        _check(
            self.log_level.upper() in _LOG_LEVELS,
            "LOG_LEVEL",
            f"must be one of {', '.join(_LOG_LEVELS)} (got {self.log_level!r})",
        )
        _check(self.api_key == self.api_key.strip(), "API_KEY", "must not start or end with whitespace")
        _check(1024 <= self.max_body_bytes <= 2**31, "MAX_BODY_BYTES", "must be in [1024, 2147483648]")
        _check(
            0 <= self.max_prompt_chars <= 100_000_000, "MAX_PROMPT_CHARS", "must be in [0, 100000000] (0 = no limit)"
        )
        _check(
            0 <= self.max_concurrent_requests <= 1_000_000,
            "MAX_CONCURRENT_REQUESTS",
            "must be in [0, 1000000] (0 = no limit)",
        )
        _check(0 <= self.drain_timeout_s <= 3600, "DRAIN_TIMEOUT_S", "must be a number in [0, 3600]")
        _check(0 <= self.fake_step_delay_s <= 60, "FAKE_STEP_DELAY_S", "must be a number in [0, 60]")
        _check(self.fake_step_fault_every >= 0, "FAKE_STEP_FAULT_EVERY", "must be >= 0 (0 = never)")
        _check(0 <= self.body_timeout_s <= 3600, "BODY_TIMEOUT_S", "must be a number in [0, 3600] (0 = no limit)")
        _check(0 < self.header_timeout_s <= 3600, "HEADER_TIMEOUT_S", "must be a number in (0, 3600]")
        _check(0 < self.timeout_keep_alive_s <= 3600, "TIMEOUT_KEEP_ALIVE_S", "must be a number in (0, 3600]")
        _check(
            0 <= self.limit_concurrency <= 10_000_000, "LIMIT_CONCURRENCY", "must be in [0, 10000000] (0 = no limit)"
        )
        _check(1024 <= self.max_header_bytes <= 16 << 20, "MAX_HEADER_BYTES", "must be in [1024, 16777216]")
        _check(1 <= self.tokenizer_threads <= 64, "TOKENIZER_THREADS", "must be in [1, 64]")
        _check(
            self.weights in WEIGHT_FORMATS,
            "WEIGHTS",
            f"must be one of {', '.join(WEIGHT_FORMATS)} (got {self.weights!r})",
        )
        _check(
            self.embedding_pooling in POOLINGS,
            "EMBEDDING_POOLING",
            f"must be one of {', '.join(POOLINGS)} (got {self.embedding_pooling!r})",
        )
        _check(self.runtime in RUNTIMES, "RUNTIME", f"must be one of {', '.join(RUNTIMES)} (got {self.runtime!r})")
        _check(
            self.kernel_isa in KERNEL_ISAS,
            "KERNEL_ISA",
            f"must be one of {', '.join(KERNEL_ISAS)} (got {self.kernel_isa!r})",
        )
        _check(
            self.activations in ACTIVATIONS,
            "ACTIVATIONS",
            f"must be one of {', '.join(ACTIVATIONS)} (got {self.activations!r})",
        )
        _check(
            self.pack_weights in PACK_CHOICES,
            "PACK_WEIGHTS",
            f"must be one of {', '.join(PACK_CHOICES)} (got {self.pack_weights!r})",
        )
        _check(
            self.runtime != "native" or self.device in ("auto", "cpu"),
            "RUNTIME",
            f"native runs on the CPU only (DEVICE is {self.device}); use RUNTIME=torch",
        )
        bad_origin = next((o for o in self.cors_origins if not _ORIGIN.fullmatch(o)), None)
        _check(
            bad_origin is None,
            "CORS_ALLOW_ORIGINS",
            f'must be "*" or comma-separated origins like https://app.example.com:8443 (got {bad_origin!r})',
        )
        _check(len(self.cors_origins) <= 1 or "*" not in self.cors_origins, "CORS_ALLOW_ORIGINS", '"*" stands alone')
        _check(0 <= self.max_loras <= 64, "MAX_LORAS", "must be in [0, 64] (0 = LoRA off)")
        _check(1 <= self.max_lora_rank <= 512, "MAX_LORA_RANK", "must be in [1, 512]")
        self.lora_module_list  # noqa: B018 (parsed: raises ConfigError naming LORA_MODULES)
        dev = self.device
        _check(
            dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
            "DEVICE",
            f"must be auto, cpu, cuda or cuda:N (got {dev!r})",
        )

    @property
    def cors_origins(self) -> list[str]:
        """CORS_ALLOW_ORIGINS as a list (empty: CORS off)."""
        return [o.strip() for o in self.cors_allow_origins.split(",") if o.strip()]

    @property
    def lora_module_list(self) -> list[tuple[str, str]]:
        """LORA_MODULES as (name, path) pairs, in order; ConfigError for a malformed or repeated one, a name that is
        the base model's, or more than MAX_LORAS."""
        pairs = []
        for item in (x.strip() for x in self.lora_modules.split(",")):
            if not item:
                continue
            name, eq, path = (x.strip() for x in item.partition("="))
            _check(
                bool(eq and name and path), "LORA_MODULES", f"must be name=path pairs, comma-separated (got {item!r})"
            )
            _check(name not in (n for n, _ in pairs), "LORA_MODULES", f"names adapter {name!r} twice")
            _check(name != self.model_name, "LORA_MODULES", f"adapter {name!r} has the base model's name")
            pairs.append((name, path))
        _check(
            len(pairs) <= self.max_loras,
            "LORA_MODULES",
            f"names {len(pairs)} adapters; MAX_LORAS is {self.max_loras} (0 = LoRA off)",
        )
        return pairs

    @property
    def speculative(self) -> SpecParams:
        """The server's default speculation (a request's ``speculative`` field overrides it)."""
        return SpecParams(
            self.speculative_method, self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        )

    @property
    def is_fake(self) -> bool:
        return self.model_id == "fake"

    @property
    def model_name(self) -> str:
        """The name clients use for this model."""
        return self.served_model_name or self.model_id

    def chat_template_text(self) -> str | None:
        """CHAT_TEMPLATE as template text: a file's contents when it names a file, else itself."""
        if not self.chat_template:
            return None
        if os.path.isfile(self.chat_template):
            with open(self.chat_template, encoding="utf-8") as f:
                return f.read()
        return self.chat_template

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Build the config from environment variables (upper-case field names)."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            name = f.name.upper()
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                continue
            values[f.name] = _parse(name, raw.strip(), f.default)
        return cls(**values)


def _check(ok: bool, var: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{var} {message}")


def _parse(var: str, raw: str, default: object) -> object:
    """Parse one variable to the type of its default."""
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            value = float(raw)
            if value != value:  # NaN
                raise ValueError(raw)
            return value
        if isinstance(default, tuple):
            return tuple(int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        kind = {
            tuple: "a comma-separated list of integers",
            float: "a number",
            bool: "true or false (or 1/0, yes/no)",
        }.get(type(default), "an integer")
        raise ConfigError(f"{var} must be {kind} (got {raw!r})") from None
    return raw
