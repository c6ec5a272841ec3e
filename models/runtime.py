"""The model runtimes behind the engine seam, and the one that MODEL_ID and RUNTIME choose (``build_engine``).

``HFEngine`` builds the model through torch (``models.families()``), ``NativeEngine`` maps a model image and steps it
with the compiled whole-step kernel, never importing torch; both are ``models.model_engine.ModelEngine``s (what they
share once a model and its tokenizer exist), configured through ``models/runtime_config.py``. ``attach_draft_model``
gives either a draft model (SPECULATIVE_MODEL). This module imports no torch: ``HFEngine`` imports it when built."""

from __future__ import annotations

import logging
import os

from config import Config
from engine import FakeEngine, InferenceEngine
from models.kernels import int_dot, packing
from models.kernels.build import kernel_isa, set_kernel_isa
from models.kv_dtype import bytes_per_token as bytes_per_kv_token
from models.loading import ModelLoadError
from models.model_engine import ModelEngine
from models.runtime_config import (
    _check_kv_dtype,
    configure_speculation,
    engine_threads,
    exact_row_limit,
    kv_cache_dtype,
    resolve_device,
    thread_environment,
    uses_native_runtime,
)

log = logging.getLogger("minibatch.engine")


class HFEngine(ModelEngine):
    """A Hugging Face checkpoint on our hand-written torch forward over a preallocated KV cache.

    ``models.loading.load_checkpoint`` loads tokenizer and model (hub id, local directory or
    ``.gguf``); the weights are copied into the family's forward (``models.families()``, keyed by
    ``config.model_type``) and the HF module is dropped.
    """

    def __init__(self, config: Config) -> None:
        from models.native_memory import bound_native_caches, memory_mib

        bound_native_caches()  # before torch runs its first oneDNN op
        thread_environment()  # before torch loads libgomp, which reads its wait policy once, at load
        import torch  # deferred: the server stack must stay importable without torch

        from models import families
        from models.loading import eos_ids, load_checkpoint  # deferred: they import transformers when called

        torch.set_num_threads(engine_threads(config))
        set_kernel_isa(config.kernel_isa)
        int_dot.set_activations(config.activations)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            _check_kv_dtype(config)
        self.tokenizer, hf_model = load_checkpoint(config.model_id, config.weights)
        hf_config = hf_model.config
        supported = families()
        if hf_config.model_type not in supported:
            raise ModelLoadError(
                f"model architecture {hf_config.model_type!r} of {config.model_id!r} is not supported; "
                f"supported: {', '.join(sorted(supported))}"
            )
        family = supported[hf_config.model_type]
        stops = eos_ids(hf_model, self.tokenizer)
        try:
            kv_window = family.kv_window(hf_config)
        except ValueError as exc:  # a config option our forward does not implement
            raise ModelLoadError(f"MODEL_ID {config.model_id}: {exc}") from exc
        bytes_per_token = family.kv_bytes_per_token(hf_config, kv_cache_dtype(config))
        num_blocks = self._init_batching(config, family.context_window(hf_config), stops, bytes_per_token, kv_window)
        max_context, block_size = self.max_context, self.planner.blocks.block_size
        self.vocab_size = hf_config.vocab_size
        self.chat_template = config.chat_template_text() or getattr(self.tokenizer, "chat_template", None)
        weights = "fp32" if config.weights == "auto" else config.weights  # a GGUF's "auto" is in hf_model already
        try:
            self.model = family(
                hf_model.eval(),
                config.max_batch_size,
                max_context,
                self.device,
                use_small_gemm=config.small_gemm,
                num_blocks=num_blocks,
                block_size=block_size,
                weights=weights,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        except ValueError as exc:  # a config option our forward does not implement (RoPE type, activation...)
            raise ModelLoadError(f"MODEL_ID {config.model_id}: {exc}") from exc
        self._init_loras(config, self.model.lora_targets())
        if hasattr(hf_model, "describe"):  # a GGUF read at its own precision: say what each tensor became
            log.info("GGUF %s (WEIGHTS=%s): %s", config.model_id, config.weights, hf_model.describe())
        del hf_model
        self._heap.trim()  # the load's transient copies (state dict, unfused parts) back to the OS
        self.hidden_size = self.model.n_embd  # an embedding's width (/v1/embeddings)
        resident = self.model.resident_weights()
        self.planner.spec_row_limit = exact_row_limit(config.activations, resident)
        memory = memory_mib()
        log.info(
            "loaded %s on %s: up to %d sequences of up to %d tokens; KV cache %s, %d blocks x %d tokens = %d tokens, "
            "%.1f MiB; weights resident, one copy each: %s (%.1f MiB); fp32 linears on %s, quantized kernels %s, "
            "%d threads; RSS %.0f MiB (peak %.0f MiB)",
            config.model_id,
            self.device,
            self.capacity,
            max_context,
            self.kv_cache_dtype,
            num_blocks,
            block_size,
            num_blocks * block_size,
            self.model.kv_nbytes / 2**20,
            ", ".join(f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in sorted(resident.items())),
            sum(resident.values()) / 2**20,
            "small_gemm panels" if self.model.small_gemm else "oneDNN" if self.model.onednn else "torch",
            kernel_isa(),
            torch.get_num_threads(),
            memory.get("VmRSS", 0),
            memory.get("VmHWM", 0),
        )


class NativeEngine(ModelEngine):
    """A model image (``models.image``) on the compiled whole-step kernel: the serving process never imports torch.

    The checkpoint is compiled once, in a child process that has torch, into an image: every weight in the
    kernel's packed format in one file, the tokenizer, and what the kernel needs to know of the model
    (``models.image.ensure_image``, cached). Here the file is memory-mapped (the mapping is the resident weights,
    nothing is copied), the KV pool is numpy, each step is one or more calls of ``decode_step.c``
    (``models.native.NativeModel``), the tokenizer is ``text.tokenizer`` and sampling is numpy. A server holds
    the weights, its KV pool and Python, not torch's ~185 MB of libraries (docs/performance.md "Memory").
    """

    def __init__(self, config: Config, image_dir: str | None = None) -> None:
        from models.native_memory import memory_mib

        environment = thread_environment()  # before libgomp loads with the kernel
        set_kernel_isa(config.kernel_isa)
        int_dot.set_activations(config.activations)
        packing.set_packing(config.pack_weights)
        from models.image import TOKENIZER_DIR, ImageError, check_image, ensure_image
        from models.native import NativeModel
        from text.tokenizer import TextTokenizer

        _check_kv_dtype(config)
        image_dir = image_dir or ensure_image(config.model_id, config.weights)
        try:
            meta = check_image(image_dir)
            self.tokenizer = TextTokenizer.from_dir(os.path.join(image_dir, TOKENIZER_DIR))
            kv = meta["kv"]
            bytes_per_token = bytes_per_kv_token(kv_cache_dtype(config), kv["n_layer"], kv["n_kv_head"], kv["head_dim"])
            num_blocks = self._init_batching(
                config, meta["context_window"], set(meta["eos_ids"]), bytes_per_token, meta["kv_window"]
            )
            block_size = self.planner.blocks.block_size
            self.model = NativeModel(image_dir, num_blocks, block_size, engine_threads(config), self.kv_cache_dtype)
        except (ImageError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"MODEL_ID {config.model_id}: its model image cannot be served: {exc}") from exc
        self.vocab_size = meta["vocab_size"]
        self._init_loras(config, self.model.lora_targets())
        self.chat_template = config.chat_template_text() or self.tokenizer.chat_template
        self.hidden_size = self.model.n_embd  # an embedding's width (/v1/embeddings)
        resident = self.model.resident_weights()
        self.planner.spec_row_limit = exact_row_limit(config.activations, resident)
        memory = memory_mib()
        log.info(
            "loaded %s without torch (image %s): up to %d sequences of up to %d tokens; KV cache %s, %d blocks x %d "
            "tokens, %.1f MiB; weights resident (mapped), one copy each: %s (%.1f MiB); quantized kernels %s; "
            "%d threads (%s); RSS %.0f MiB (peak %.0f MiB)",
            config.model_id,
            image_dir,
            self.capacity,
            self.max_context,
            self.kv_cache_dtype,
            num_blocks,
            self.planner.blocks.block_size,
            self.model.kv_nbytes / 2**20,
            ", ".join(f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in sorted(resident.items())),
            sum(resident.values()) / 2**20,
            kernel_isa(),
            self.model.threads,
            ", ".join(f"{k}={v}" for k, v in environment.items()),
            memory.get("VmRSS", 0),
            memory.get("VmHWM", 0),
        )
        log.info("quantized linears: %s", int_dot.describe(config.activations))
        if self.model.packed_bytes:
            log.info("packed for the integer path (PACK_WEIGHTS): %.1f MiB of Q4_K", self.model.packed_bytes / 2**20)


def build_engine(config: Config) -> InferenceEngine:
    """The engine MODEL_ID and RUNTIME ask for: ``fake`` -> FakeEngine, else NativeEngine or HFEngine
    (``uses_native_runtime``).

    Raises ``ModelLoadError`` (a one-line message saying why and what to do) when MODEL_ID cannot be served.
    """
    if config.is_fake:
        if config.speculative_model:
            raise ModelLoadError("SPECULATIVE_MODEL needs a real MODEL_ID: MODEL_ID=fake has no model to draft for")
        engine = FakeEngine(
            capacity=config.max_batch_size,
            stop_token_ids=(FakeEngine.EOS, *config.stop_token_ids),
            num_blocks=config.fake_kv_blocks,
            block_size=config.kv_block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefix_caching=config.prefix_caching,
            max_prefill_while_decoding=config.max_prefill_tokens_while_decoding,
        )
        configure_speculation(engine.planner, config)
        return engine
    engine = NativeEngine(config) if uses_native_runtime(config) else HFEngine(config)
    if config.speculative_model:
        attach_draft_model(engine, config)
    return engine


def attach_draft_model(engine: ModelEngine, config: Config) -> None:
    """SPECULATIVE_MODEL: the draft model, loaded as a target is (``models/loading``) on ``engine``'s runtime kind
    with its own KV pool, checked to share ``engine``'s tokenizer, proposes the drafts of the requests choosing
    ``draft_model`` (``models/draft_model.py``). ModelLoadError, naming both models, when it cannot."""
    import dataclasses

    from models.draft_model import DraftModel

    name, native = config.speculative_model, isinstance(engine, NativeEngine)
    draft_config = dataclasses.replace(
        config,
        model_id=name,
        runtime="native" if native else "torch",
        max_model_len=engine.max_context,
        speculative_method="off",
        speculative_model="",
        served_model_name="",
        chat_template="",
        lora_modules="",  # a draft model proposes from its base weights: the target verifies under the adapter
        max_loras=0,
    )
    try:
        draft = NativeEngine(draft_config) if native else HFEngine(draft_config)
    except ModelLoadError as exc:
        raise ModelLoadError(f"SPECULATIVE_MODEL {name}: {exc}") from None
    problem = tokenizer_mismatch(engine, draft)
    if problem:
        raise ModelLoadError(
            f"SPECULATIVE_MODEL {name} cannot draft for MODEL_ID {config.model_id}: {problem}; a draft model must "
            "share the target's tokenizer"
        )
    engine.attach_drafter(DraftModel(draft, name, config.max_num_batched_tokens))
    log.info("draft model %s proposes the drafts of requests choosing draft_model", name)


TOKENIZER_PROBE = "Hello, world! The quick brown fox jumps over 13 lazy dogs: naïve café, 東京, def f(x): return x**2\n"


def tokenizer_mismatch(target: InferenceEngine, draft: InferenceEngine) -> str | None:
    """Why ``draft`` does not share ``target``'s tokenizer (its vocabulary size, or how it tokenizes a probe text),
    or None."""
    if draft.vocab_size != target.vocab_size:
        return f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}"
    if draft.encode(TOKENIZER_PROBE) != target.encode(TOKENIZER_PROBE):
        return "it tokenizes text differently"
    return None
