"""What every model runtime shares once a model and its tokenizer exist (``ModelEngine``): tokenizing, chat templates,
one forward over a plan's decode rows and prompt chunks (laid out once as a ``models.step_layout.StepLayout``, handed
to the ``model_runner.ModelRunner``), verifying drafts, prompt logprobs, embeddings' hidden states, and sampling the
logits on numpy (``core/sampling.py``: the same code whichever runtime made them). The runtimes themselves are
``models/runtime.py``. No torch.
"""

from __future__ import annotations

import copy
import logging

from config import Config
from core.pooling import pool_chunk
from core.sampling import NonFiniteLogits, apply_token_bitmask, grammar_bitmask, logprobs, sample
from core.sequence import Sequence
from core.speculative import verify_run
from core.step import BatchLimits, BatchPlan, RowFailure
from engine import ChatTemplateError, InferenceEngine
from model_runner import ModelRunner
from models.loading import ModelLoadError
from models.native_memory import HeapTrimmer
from models.runtime_config import configure_speculation, kv_cache_dtype, kv_pool_blocks
from models.step_layout import StepLayout

log = logging.getLogger("minibatch.engine")

NON_FINITE_LOGITS = "the model's output for this sequence was not finite (NaN or inf); it was stopped"
SAMPLING_FAILED = "sampling the next token for this sequence failed; it was stopped"


class ModelEngine(InferenceEngine):
    """A real model behind the bookkeeping: what every model runtime shares once its model and tokenizer exist.

    Subclasses build ``self.model`` (a ``model_runner.ModelRunner``: decode rows and prompt chunks in, numpy logits
    rows out, whichever runtime) and ``self.tokenizer`` (encode / decode / apply_chat_template), then call
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
        limits = BatchLimits(
            config.max_batch_size,
            max_context,
            frozenset(stops | set(config.stop_token_ids)),
            num_blocks,
            block_size,
            config.max_num_batched_tokens,
            config.prefix_caching,
            config.max_prefill_tokens_while_decoding,
            kv_window,
        )
        InferenceEngine.__init__(self, limits)
        self.model_name = config.model_id
        self.kv_cache_dtype = kv_cache_dtype(config)  # the pool's elements (what /metrics' kv_cache_info says)
        configure_speculation(self.planner, config)
        self._heap = HeapTrimmer()
        return num_blocks

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
        layout = StepLayout.build(  # the step's rows, as both runtimes read them
            self.model.step_limits,
            [decode[i].last_token_id for i in plain],
            [decode[i].num_tokens - 1 for i in plain],
            [plan.tables[i] for i in plain],
            [[decode[i].last_token_id, *drafts[i]] for i in verify]
            + [(s.prompt_token_ids + s.output_token_ids)[start:end] for s, start, end in chunks],
            [plan.tables[i] for i in verify] + plan.tables[n:],
            [decode[i].num_tokens - 1 for i in verify] + [start for _, start, _ in chunks],
            full if any(full) else (),
            [False] * len(verify) + pooled if any(pooled) else (),
        )
        out = self.model.forward(layout, self._lora_rows(plan, plain, verify))
        # [plain rows + (k + 1) per verified row + one row per chunk (every position of a scoring chunk), V]
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

    def _lora_rows(self, plan: BatchPlan, plain: list[int], verify: list[int]) -> list[int] | None:
        """The forward's ``loras`` argument (each row's adapter slot, in the order ``_forward`` feeds the rows), or
        None when every row is the base model's."""
        ids, n = plan.loras, len(plan.decode)
        return self.loras.rows([ids[i] for i in plain + verify] + ids[n:]) if self.loras is not None else None

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
        raw = logits if rows == list(range(logits.shape[0])) else logits[rows]  # one verifying row: no copy
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
        emitted = [owners[r] for r in emitted_rows]
        if any(s.logprobs is not None for s in emitted):  # else no copy of the emitted rows
            self._add_logprobs(raw[emitted_rows], emitted, tokens)
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
