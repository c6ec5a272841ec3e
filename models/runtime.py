"""The model runtimes behind the engine seam, and the one that MODEL_ID and RUNTIME choose (``build_engine``).

``ModelEngine`` is what both share once a model and its tokenizer exist: tokenizing, chat templates, one forward
over a plan's decode rows and prompt chunks (the ``model_runner.ModelRunner`` contract), prompt logprobs, and
sampling its logits on numpy (``core/sampling.py``: the same code whichever runtime made them). ``HFEngine`` builds
the model through torch (``models.families()``), ``NativeEngine`` maps a model image and steps it with the compiled
whole-step kernel, never importing torch. This module imports no torch: ``HFEngine`` imports it when built.
"""

from __future__ import annotations

import copy
import logging
import os

from config import Config
from core.pooling import pool_chunk
from core.sampling import NonFiniteLogits, apply_token_bitmask, grammar_bitmask, logprobs, sample
from core.sequence import Sequence
from core.speculative import verify_run
from core.step import BatchPlan, RowFailure
from engine import ChatTemplateError, FakeEngine, InferenceEngine
from model_runner import ModelRunner
from models.kernels import int_dot
from models.kernels.build import kernel_isa, set_kernel_isa
from models.kv_dtype import bytes_per_token as bytes_per_kv_token
from models.kv_dtype import unavailable_reason as kv_dtype_unavailable
from models.loading import ModelLoadError
from models.native_memory import HeapTrimmer

log = logging.getLogger("minibatch.engine")

NON_FINITE_LOGITS = "the model's output for this sequence was not finite (NaN or inf); it was stopped"
SAMPLING_FAILED = "sampling the next token for this sequence failed; it was stopped"


class ModelEngine(InferenceEngine):
    """A real model behind the bookkeeping: what every model runtime shares once its model and tokenizer exist.

    Subclasses build ``self.model`` (the forward contract of ``models.layers.MixedForward.forward``: decode rows and
    prompt chunks in, logits rows out) and ``self.tokenizer`` (encode / decode / apply_chat_template), then call
    ``_init_batching``. Here: tokenizing, chat templates, one forward over decode rows and prompt chunks, and
    sampling its logits (``sampling``, on numpy: the same code whichever runtime made them).
    """

    tokenizer: object
    model: ModelRunner
    chat_template: str | None

    def _init_batching(
        self, config: Config, window: int, stops: set[int], kv_bytes_per_token: int, kv_window: int = 0
    ) -> int:
        """Context, KV pool and batching from ``config`` for a model of ``window`` positions (and a sliding window
        of ``kv_window`` keys on every layer, 0: none); -> KV pool blocks."""
        max_context = min(window, config.max_model_len) if config.max_model_len else window
        block_size = config.kv_block_size
        num_blocks = kv_pool_blocks(config, max_context, kv_bytes_per_token * block_size)
        InferenceEngine.__init__(
            self,
            config.max_batch_size,
            max_context,
            stops | set(config.stop_token_ids),
            num_blocks,
            block_size,
            config.max_num_batched_tokens,
            config.prefix_caching,
            config.max_prefill_tokens_while_decoding,
        )
        self.model_name = config.model_id
        self.kv_cache_dtype = kv_cache_dtype(config)  # the pool's elements (what /metrics' kv_cache_info says)
        self.planner.kv_window = kv_window
        configure_speculation(self.planner, config)
        self._heap = HeapTrimmer()
        return num_blocks

    def _logits(self, *forward_args, **lora):
        """``self.model.forward(*forward_args, **lora)`` as a float32 numpy array [rows, V] (sampling runs on
        numpy), and the hidden states [rows, C] beside it when a chunk asked for them (``ModelRunner.forward``'s
        ``hidden``)."""
        return self.model.forward(*forward_args, **lora)

    def _init_loras(self, config: Config, targets: list) -> None:
        """MAX_LORAS adapter slots on the model, and LORA_MODULES in them (``ModelLoadError``, one line naming the
        adapter and why, for one this model cannot serve)."""
        if not config.max_loras:
            return
        from models.lora import LoraError, LoraManager

        self.model.enable_lora(config.max_loras)
        self.loras = LoraManager(self.model, targets, config.max_loras, config.max_lora_rank)
        for name, path in config.lora_module_list:
            try:
                loaded = self.loras.load_now(name, path)
            except LoraError as exc:
                raise ModelLoadError(f"LORA_MODULES: {exc}") from None
            log.info("LoRA adapter %s (%s): rank %d", name, path, loaded.rank)

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of the KV block pool."""
        return self.model.kv_nbytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def grammar_vocabulary(self) -> tuple:
        return self.tokenizer, self.vocab_size, self.stop_token_ids

    def control_tokens(self) -> list[str]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return []
        return [t.content for t in backend.get_added_tokens_decoder().values() if t.special]

    def encode_as_text(self, text: str) -> list[int]:
        backend = getattr(self, "_as_text", None)
        if backend is None:  # a copy of the tokenizer's pipeline that reads special-token strings as text
            source = getattr(self.tokenizer, "backend_tokenizer", None)
            if source is None:
                return self.encode(text, add_special_tokens=False)
            backend = copy.copy(source)
            backend.encode_special_tokens = True
            self._as_text = backend
        return backend.encode(text, add_special_tokens=False).ids

    def supports_tools(self) -> bool:
        from text.chat_template import template_supports_tools

        return bool(self.chat_template) and template_supports_tools(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ChatTemplateError(
                f"model {self.model_name!r} has no chat template; set CHAT_TEMPLATE to a Jinja template "
                "(text or a file path) to use /v1/chat/completions"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template that raises on these messages (e.g. role order)
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _forward(self, plan: BatchPlan) -> list[int | list[int] | RowFailure]:
        """Decode rows and prompt chunks in one forward (the weights stream once: a decode step alone is bound by
        that); tokens only where a chunk ends its sequence.

        A decode row with draft tokens (speculative decoding) is fed as a chunk of its last token and its drafts,
        with logits at every position, and gets the run it verified (``_verify``). A chunk whose sequence asked for
        prompt logprobs gets logits at every position (scored into ``seq.prompt_logprobs``); every other chunk only
        at its last, and only when it ends the sequence.
        """
        decode, chunks, n = plan.decode, plan.chunks, len(plan.decode)
        drafts = [plan.drafts_of(i) for i in range(n)]
        plain = [i for i in range(n) if not drafts[i]]
        verify = [i for i in range(n) if drafts[i]]
        every = [_scores_prompt(seq, start) for seq, start, _ in chunks]
        full = [True] * len(verify) + every
        pooled = [seq.pooling is not None for seq, _, _ in chunks]  # embeddings: final hidden states, no logits
        out = self._logits(
            [decode[i].last_token_id for i in plain],
            [decode[i].num_tokens - 1 for i in plain],
            [plan.tables[i] for i in plain],
            [[decode[i].last_token_id, *drafts[i]] for i in verify]
            + [(s.prompt_token_ids + s.output_token_ids)[start:end] for s, start, end in chunks],
            [plan.tables[i] for i in verify] + plan.tables[n:],
            [decode[i].num_tokens - 1 for i in verify] + [start for _, start, _ in chunks],
            full if any(full) else (),
            [False] * len(verify) + pooled if any(pooled) else (),
            **self._lora_rows(plan, plain, verify),
        )  # [plain rows + (k + 1) per verified row + one row per chunk (every position of a scoring chunk), V]
        logits, hidden = out if any(pooled) else (out, None)  # hidden: [embedded chunks' tokens, C]
        if chunks or verify:  # chunks bring new shapes, whose scratch the heap would otherwise keep
            self._heap.maybe_trim()
        first = dict(zip(plain, range(len(plain))))  # decode row -> its first logits row
        row = len(plain)
        for i in verify:
            first[i], row = row, row + len(drafts[i]) + 1
        keep = [first[i] for i in range(n)]
        at = 0  # the next embedded chunk's first row of ``hidden``
        for (seq, start, end), scored, pool in zip(chunks, every, pooled):
            if pool:
                pool_chunk(seq, hidden[at : at + end - start], start, end)
                at += end - start
                continue
            k = end - start if scored else 1
            if scored:
                _score_prompt(seq, logits[row : row + k], start, end)
            if end == seq.num_tokens:  # its forked choices sample from its last row too
                keep += [row + k - 1] * (1 + len(plan.forks.get(seq.seq_id, ())))
            row += k
        if verify:
            return self._verify(logits, plan.samples, keep, drafts)
        if keep != list(range(logits.shape[0])):
            logits = logits[keep]
        tokens = self._next_tokens(logits, plan.samples)
        self._add_logprobs(logits, plan.samples, tokens)
        return tokens

    def _lora_rows(self, plan: BatchPlan, plain: list[int], verify: list[int]) -> dict:
        """The forward's ``loras`` argument (each row's adapter slot, in the order ``_forward`` feeds the rows), or
        nothing when every row is the base model's."""
        ids, n = plan.loras, len(plan.decode)
        slots = self.loras.rows([ids[i] for i in plain + verify] + ids[n:]) if self.loras is not None else None
        return {} if slots is None else {"loras": slots}

    def _verify(self, logits, samples: list[Sequence], first: list[int], drafts: list[list[int]]) -> list:
        """Speculative decoding: ``samples[i]`` samples from logits row ``first[i]``, and a decode row with ``k``
        drafts from its ``k + 1`` rows from there, position ``j`` as if its first ``j`` drafts were accepted (its
        penalties, seed step and grammar mask after them). One token (or RowFailure) per plain sample; the run
        (``core.speculative.verify_run``) per verified row, cut before a position that failed (a RowFailure if
        the first did). Logprobs for the emitted tokens only."""
        drafts = drafts + [[]] * (len(samples) - len(drafts))
        rows = [r + j for r, d in zip(first, drafts) for j in range(len(d) + 1)]
        owners = [s for s, d in zip(samples, drafts) for _ in range(len(d) + 1)]
        before = [d[:j] for d in drafts for j in range(len(d) + 1)]
        raw = logits[rows]
        sampled = self._next_tokens(raw, owners, before)
        out: list = []
        emitted_rows: list[int] = []
        at = 0
        for d in drafts:
            mine = sampled[at : at + len(d) + 1]
            if not d:
                out.append(mine[0])
                emitted_rows.append(at)
            else:
                good = next((j for j, t in enumerate(mine) if isinstance(t, RowFailure)), len(mine))
                run = verify_run(mine[:good], d) if good else mine[0]
                out.append(run)
                emitted_rows += range(at, at + len(run)) if good else [at]
            at += len(d) + 1
        tokens = [t for r in out for t in (r if isinstance(r, list) else [r])]
        self._add_logprobs(raw[emitted_rows], [owners[r] for r in emitted_rows], tokens)
        return out

    def _copy_block(self, src: int, dst: int) -> None:
        self.model.copy_block(src, dst)

    def _next_tokens(self, logits, seqs: list[Sequence], drafted: list[list[int]] | None = None) -> list:
        """logits: [N, V] for seqs -> one token id each, under each sequence's SamplingParams; ``drafted[i]``: the
        draft tokens row i comes after (sampled as if they were accepted).

        A row whose logits are not finite, or whose sampling fails, gets a ``RowFailure``; the others
        are sampled as if it were not there. Logprobs are the caller's (``_add_logprobs``, from the raw logits:
        before penalties and temperature).
        """
        outputs = [
            s.output_token_ids + d if drafted and d else s.output_token_ids for s, d in zip(seqs, drafted or seqs)
        ]
        results: list[int | RowFailure] = [RowFailure(SAMPLING_FAILED)] * len(seqs)
        rows = list(range(len(seqs)))
        logits = self._constrain(logits, seqs, drafted)
        try:
            tokens = self._sample(logits, seqs, outputs)
        except NonFiniteLogits as exc:
            log.error("non-finite logits for sequences %s", [seqs[i].seq_id for i in exc.rows])
            for i in exc.rows:
                results[i] = RowFailure(NON_FINITE_LOGITS)
            rows = [i for i in rows if i not in set(exc.rows)]
            tokens = self._sample_rows(logits, seqs, rows, outputs)
        except Exception:  # a bug or an edge no range check foresaw: find the rows it belongs to
            log.exception("sampling a batch of %d failed; sampling its rows one at a time", len(seqs))
            tokens = self._sample_rows(logits, seqs, rows, outputs)
        vocab = logits.shape[-1]
        for i, token in zip(rows, tokens):
            if isinstance(token, int) and not 0 <= token < vocab:
                log.error("sampling gave token %d outside [0, %d) for sequence %d", token, vocab, seqs[i].seq_id)
                token = RowFailure(SAMPLING_FAILED)
            results[i] = token
        return results

    @staticmethod
    def _constrain(logits, seqs: list[Sequence], drafted: list[list[int]] | None = None):
        """Structured output: the logits with each grammar row's disallowed tokens at -inf (a copy), or
        ``logits`` itself when no row has a grammar (an unconstrained batch pays nothing). The masks are
        computed here, in the engine thread, one row at a time; a row after drafts gets the mask of the
        grammar's state after them."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return logits
        grammars = [_AfterDrafts(seqs[i].grammar, drafted[i] if drafted else []) for i in rows]
        mask = grammar_bitmask(grammars, logits.shape[-1])
        return apply_token_bitmask(logits, rows, mask)

    @staticmethod
    def _sample(logits, seqs: list[Sequence], outputs: list[list[int]]) -> list[int]:
        """logits: [n, V] -> one token per sequence (``sampling.sample``), ``outputs[i]`` its tokens so far."""
        return sample(logits, [s.sampling for s in seqs], [s.prompt_token_ids for s in seqs], outputs)

    def _sample_rows(self, logits, seqs: list[Sequence], rows: list[int], outputs) -> list[int | RowFailure]:
        """Each of ``rows`` alone: a row that still fails gets a RowFailure, the others their token."""
        out: list[int | RowFailure] = []
        for i in rows:
            try:
                out.append(self._sample(logits[i : i + 1], [seqs[i]], [outputs[i]])[0])
            except NonFiniteLogits:
                out.append(RowFailure(NON_FINITE_LOGITS))
            except Exception:
                log.exception("sampling sequence %d failed", seqs[i].seq_id)
                out.append(RowFailure(SAMPLING_FAILED))
        return out

    @staticmethod
    def _add_logprobs(logits, seqs: list[Sequence], tokens: list[int | RowFailure]) -> None:
        """Append each requesting row's logprobs of its chosen token (rows that failed get none)."""
        wanted = [i for i, s in enumerate(seqs) if s.logprobs is not None and not isinstance(tokens[i], RowFailure)]
        if not wanted:
            return
        k = max(seqs[i].logprobs for i in wanted)
        rows = logits if len(wanted) == len(seqs) else logits[wanted]
        for i, lp in zip(wanted, logprobs(rows, [tokens[i] for i in wanted], k)):
            seqs[i].output_logprobs.append(lp._replace(top=lp.top[: seqs[i].logprobs]))


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
            self.model.kv.nbytes / 2**20,
            ", ".join(f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in sorted(resident.items())),
            sum(resident.values()) / 2**20,
            "small_gemm panels" if self.model.small_gemm else "oneDNN" if self.model.onednn else "torch",
            kernel_isa(),
            torch.get_num_threads(),
            memory.get("VmRSS", 0),
            memory.get("VmHWM", 0),
        )

    def _logits(self, *forward_args, **lora):
        out = self.model.forward(*forward_args, **lora)  # logits [rows, V], or (logits, hidden [rows, C])
        if isinstance(out, tuple):
            return tuple(t.float().cpu().numpy() for t in out)
        return out.float().cpu().numpy()  # sampling runs on numpy

    def _copy_block(self, src: int, dst: int) -> None:
        self.model.kv.copy_block(src, dst)

    @property
    def kv_pool_bytes(self) -> int:
        return self.model.kv.nbytes


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


class _AfterDrafts:
    """A grammar as it stands after ``drafts`` (``GrammarState.fill_mask`` advanced, then rolled back)."""

    def __init__(self, grammar, drafts: list[int]) -> None:
        self.grammar, self.drafts = grammar, drafts

    def fill_mask(self, address: int, nbytes: int) -> None:
        if not self.drafts:
            self.grammar.fill_mask(address, nbytes)
            return
        self.grammar.advance(self.drafts)
        try:
            self.grammar.fill_mask(address, nbytes)
        finally:
            self.grammar.rollback(len(self.drafts))


def _scores_prompt(seq: Sequence, start: int) -> bool:
    """Whether a chunk of ``seq`` from ``start`` computes prompt logprobs: the sequence asked for them, the
    chunk has a position that predicts a prompt token, and they are not complete already (a sequence
    recomputed after a preemption keeps the ones it has)."""
    if seq.prompt_logprobs_k is None or start >= seq.prompt_len - 1:
        return False
    if start == 0:
        return len(seq.prompt_logprobs) < seq.prompt_len
    return len(seq.prompt_logprobs) == start + 1  # the earlier chunks scored positions [0, start)


def _score_prompt(seq: Sequence, logits, start: int, end: int) -> None:
    """logits: [end - start, V], position p's row predicting token p + 1 (raw logits). Appends the
    logprobs of the prompt tokens those positions predict; position 0 has nothing before it (None)."""
    if start == 0:
        seq.prompt_logprobs = [None]
    stop = min(end, seq.prompt_len - 1)  # the last prompt position predicts the first output token
    predicted = seq.prompt_token_ids[start + 1 : stop + 1]
    seq.prompt_logprobs += logprobs(logits[: stop - start], predicted, seq.prompt_logprobs_k)


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
