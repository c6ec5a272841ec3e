"""What the config decides for a model runtime, before and beside the model: the KV pool's blocks and element type
(``kv_pool_blocks``, ``kv_cache_dtype``), the device, the thread settings (``thread_environment``, before torch
loads), which runtime serves (``uses_native_runtime``), and the planner's speculation settings. No torch.
"""

from __future__ import annotations

import logging
import os

from config import Config
from models.kernels import int_dot
from models.kv_dtype import unavailable_reason as kv_dtype_unavailable
from models.loading import ModelLoadError

log = logging.getLogger("minibatch.engine")


def _check_kv_dtype(config: Config) -> None:
    """KV_CACHE_DTYPE must be one this CPU runs (fp16 needs F16C): a one-line startup error otherwise."""
    reason = kv_dtype_unavailable(kv_cache_dtype(config))
    if reason:
        raise ModelLoadError(reason)


def kv_pool_blocks(config: Config, max_context: int, block_bytes: int) -> int:
    """Blocks in the KV pool: ``KV_CACHE_MB`` of them, or by default enough for ``MAX_BATCH_SIZE`` sequences
    at the full context, capped at ``KV_CACHE_RAM_FRACTION`` of the machine's memory."""
    if config.kv_cache_mb:
        blocks = int(config.kv_cache_mb * 2**20) // block_bytes
        if blocks < 1:
            raise ValueError(f"KV_CACHE_MB={config.kv_cache_mb} holds no KV block ({block_bytes} bytes each)")
        return blocks
    blocks = config.max_batch_size * -(-max_context // config.kv_block_size)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return blocks
    return max(1, min(blocks, int(ram * KV_CACHE_RAM_FRACTION) // block_bytes))


KV_CACHE_RAM_FRACTION = 0.25  # the default pool never takes more of the machine's RAM than this


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# What OpenMP and the tokenizer get unless the environment says otherwise (measured: docs/performance.md "Threads").
# A decode step runs ~120 OpenMP regions back to back, microseconds apart. A worker that sleeps at once
# (OMP_WAIT_POLICY=PASSIVE) costs a futex wake-up per region: SmolLM2's batch-1 step took 18 ms instead of
# 9.5. libgomp's default spin (300k iterations, ~3 ms) keeps the worker on a core long after a step, while
# the event loop needs it. GOMP_SPINCOUNT=100000 (~1 ms) spans the gaps inside a step and the short hop
# between two steps, then sleeps: served batch-1 steps within 1.05x of the bare step. (It spins only while
# libgomp's pooled threads fit the cores: ``scheduler.engine_thread`` keeps every torch call on one thread.)
# The Rust tokenizer starts its own pool of one thread per core for batch encodes: never beside torch's.
THREAD_ENV = {"GOMP_SPINCOUNT": "100000", "TOKENIZERS_PARALLELISM": "false"}


def thread_environment() -> dict[str, str]:
    """Set ``THREAD_ENV`` where the environment does not (an explicit setting wins, and an explicit
    OMP_WAIT_POLICY keeps its own spin); returns what is in effect. Must run before torch is imported:
    libgomp reads its settings once, when it is loaded."""
    import sys

    wanted = dict(THREAD_ENV)
    if "OMP_WAIT_POLICY" in os.environ:
        wanted.pop("GOMP_SPINCOUNT")  # GOMP_SPINCOUNT would override the policy the user chose
    if "torch" in sys.modules and any(k not in os.environ for k in wanted):
        log.warning("torch was imported before the thread settings: OpenMP keeps its own wait policy")
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in [*wanted, "OMP_WAIT_POLICY"] if key in os.environ}


def engine_threads(config: Config) -> int:
    """Torch intra-op threads: NUM_THREADS, or 0 = every physical core (measured fastest: docs/performance.md,
    "Threads")."""
    return config.num_threads or physical_cores()


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads share a core's FPUs)."""
    try:
        cores = set()
        cpu = phys = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    phys = value.strip()
                elif key == "core id" and cpu in os.sched_getaffinity(0):
                    cores.add((phys, value.strip()))
        if cores:
            return len(cores)
    except (OSError, ValueError, AttributeError):
        pass
    return os.cpu_count() or 1


def exact_row_limit(activations: str, resident: dict[str, int]) -> int:
    """The fewest rows of a step at which the quantized linears of these weights switch to int8 activations
    (ACTIVATIONS=auto, ``int_dot.rows_for``), or 0 where the step size changes nothing: drafts never take a step
    across it, so that a token's logits are rounded the same with drafts as without (speculation stays exact)."""
    limits = [int_dot.rows_for(activations, fmt, int_dot.isa()) for fmt in int_dot.FORMATS if fmt in resident]
    limits = [n for n in limits if n and n > 1]  # None: fp32 always; 1: int8 always
    return min(limits, default=0)


def configure_speculation(planner, config: Config) -> None:
    """The planner's speculative decoding from the config: the requests' default and the batch size it stops at."""
    planner.speculative = config.speculative
    planner.spec_disable_batch_size = config.speculative_disable_by_batch_size
    planner.spec_adaptive = config.speculative_adaptive


def quantized_weights(config: Config) -> bool:
    """Whether the model's weights are served quantized: a GGUF at WEIGHTS=auto, or WEIGHTS=int8 / int4."""
    from models.loading import is_gguf

    return config.weights in ("int8", "int4") or (config.weights == "auto" and is_gguf(config.model_id))


def kv_cache_dtype(config: Config) -> str:
    """The KV pool's elements: KV_CACHE_DTYPE, or for ``auto`` fp32 beside fp32 weights (exact, as the parity gates
    run) and ``AUTO_QUANTIZED_KV`` beside quantized ones (docs/kv-cache.md has the measurements behind it)."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return AUTO_QUANTIZED_KV if quantized_weights(config) else "fp32"


AUTO_QUANTIZED_KV = "int8"  # KV_CACHE_DTYPE=auto beside quantized weights


def uses_native_runtime(config: Config) -> bool:
    """RUNTIME=native, or RUNTIME=auto with quantized weights (a GGUF at WEIGHTS=auto, int8, int4) on the CPU
    where the whole-step kernel builds (else auto falls back to torch, and says why)."""
    if config.runtime != "auto":
        return config.runtime == "native"
    quantized = quantized_weights(config)
    if not quantized or config.device not in ("auto", "cpu"):
        return False
    from models.native import unavailable_reason

    reason = unavailable_reason()
    if reason:
        log.warning("RUNTIME=auto: quantized weights run on torch here: %s", reason)
    return reason is None
