"""The lean decode path (models/layers.py): its compiled kernels against float64 torch, and its gates.

Kernels (``decode_ops.c``; ``rope_write_attend`` in ``paged_attention.c``) on ragged shapes at 1-3 threads.
The whole-step kernel (``decode_step.c``, ``fused_step``) is made of those kernels' loops: it must give the
per-layer lean calls' logits and KV writes bit for bit, at 1, 2 and 3 threads, short and long (partitioned)
contexts. Model gates: lean decode steps give the torch path's logits (GPT-2 and Llama; fp32 through both
linear kernels, int8, int4; batch 1 to 20, across ``LEAN_MAX_ROWS``), and greedy parity with HF ``generate``
with joins while lean steps really run (the family-generic gates in test_parity.py run lean too).
"""

from __future__ import annotations

import pytest

from conftest import PROMPTS, Reference, drive, expected, make_engine, need_kernel, seqs_for

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from models import attention  # noqa: E402
from models.kernels import decode_ops, decode_step  # noqa: E402
from models.kernels import paged_attention as pa  # noqa: E402

THREADS = [1, 2, 3]


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def need_kernels() -> None:
    need_kernel(decode_ops, "decode ops")
    need_kernel(pa, "paged attention")


def need_step_kernel() -> None:
    need_kernels()
    need_kernel(decode_step, "decode step")


# --- kernels against float64 torch --------------------------------------------------------------


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("M, C", [(1, 8), (3, 13), (7, 576), (16, 37)])
def test_norms_and_silu_mul_match_float64(threads, M, C):
    need_kernels()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(M * 100 + C)
    x = torch.randn(M, C + 5, generator=gen)[:, 2 : 2 + C] * 3  # a row stride past C
    w, b = torch.randn(C, generator=gen), torch.randn(C, generator=gen)
    xd = x.double()
    want_rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(decode_ops.rms_norm(x, w, 1e-5).double(), want_rms, rtol=1e-5, atol=1e-5)
    want_ln = torch.nn.functional.layer_norm(xd, (C,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(decode_ops.layer_norm(x, w, b, 1e-5).double(), want_ln, rtol=1e-5, atol=1e-5)
    gu = torch.cat([x * 10, x.flip(-1)], dim=1)  # gates up to +-40: both tails of the exponential
    gd = gu.double()
    want = torch.nn.functional.silu(gd[:, :C]) * gd[:, C:]
    torch.testing.assert_close(decode_ops.silu_mul(gu).double(), want, rtol=1e-5, atol=1e-5)
    h = gu * 1.5  # GELU inputs to +-60: both tails, and a row tail past the 8-wide path when C % 8
    want_gelu = torch.nn.functional.gelu(h.double(), approximate="tanh")
    torch.testing.assert_close(decode_ops.gelu_tanh(h).double(), want_gelu, rtol=1e-5, atol=1e-5)


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("H, KVH, D, bs, lens", [(4, 2, 8, 4, [1, 6, 13]), (3, 3, 16, 8, [9]), (6, 1, 32, 16, [40, 2])])
def test_rope_write_attend_matches_float64(threads, rope, H, KVH, D, bs, lens):
    """Ragged contexts over scattered blocks: the new token's k, v land in their slots (k rotated), and every
    row attends over its whole context, the new token included."""
    need_kernels()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(H * 7 + D + len(lens))
    B, max_len, n_blocks = len(lens), 64, 24
    pool_k = torch.randn(n_blocks, KVH, bs, D, generator=gen)  # head-major physically, like PagedKVCache
    pool_v = torch.randn(n_blocks, KVH, bs, D, generator=gen)
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    tables, cursor = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[cursor : cursor + need])
        cursor += need
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    pos = torch.tensor([n - 1 for n in lens])
    slot_blocks = torch.tensor([t[p // bs] for t, p in zip(tables, pos.tolist())])
    slot_offsets = pos % bs
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen)
    freqs = torch.arange(max_len)[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2) / D))[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, None, :].contiguous(), emb.sin()[:, None, :].contiguous()
    k_pool, v_pool = pool_k.transpose(1, 2), pool_v.transpose(1, 2)
    out = pa.rope_write_attend(
        qkv,
        H,
        (cos, sin) if rope else None,
        pos,
        k_pool,
        v_pool,
        slot_blocks,
        slot_offsets,
        block_tables,
        torch.tensor(lens, dtype=torch.int32),
        D**-0.5,
    )
    for b, n in enumerate(lens):
        q = qkv[b, : H * D].view(H, D).double()
        k_new = qkv[b, H * D : (H + KVH) * D].view(KVH, D).double()
        v_new = qkv[b, (H + KVH) * D :].view(KVH, D).double()
        if rope:
            c, s = cos[pos[b]].double(), sin[pos[b]].double()
            q, k_new = _rope64(q, c, s), _rope64(k_new, c, s)
        blk, off = int(slot_blocks[b]), int(slot_offsets[b])
        torch.testing.assert_close(k_pool[blk, off].double(), k_new, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v_pool[blk, off].double(), v_new, rtol=0, atol=0)
        keys = k_pool[tables[b]].reshape(-1, KVH, D)[:n].double()  # [n, KVH, D]
        values = v_pool[tables[b]].reshape(-1, KVH, D)[:n].double()
        G = H // KVH
        scores = torch.einsum("hd,nhd->hn", q, keys.repeat_interleave(G, dim=1)) * D**-0.5
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.repeat_interleave(G, dim=1))
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)


# --- the model gates ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family_dir(request, tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    if request.param == "gpt2":
        return request.getfixturevalue("tiny_model_dir")
    return build_checkpoint(str(tmp_path_factory.mktemp("llama_lean")), arch="llama", seed=2, tied=False)


@pytest.mark.model
@pytest.mark.parametrize(
    "weights, small_gemm", [("fp32", True), ("fp32", False), ("int8", True), ("int4", True)], ids=str
)
def test_lean_steps_give_the_torch_paths_logits(family_dir, weights, small_gemm):
    """Decode at batch 1..20 (lean up to LEAN_MAX_ROWS) with the lean path on, then the same step again with
    it off: the same logits (the second step rewrites the same KV slots with the same values)."""
    need_kernels()
    engine = make_engine(family_dir, 20, weights=weights, small_gemm=small_gemm)
    model = engine.model
    assert model.lean_decode
    per_seq = 4
    for B in (1, 2, 5, attention.LEAN_MAX_ROWS, attention.LEAN_MAX_ROWS + 1, 20):
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
        prompts = [[(5 * b + i) % 50 + 3 for i in range(3 + b % 7)] for b in range(B)]
        tokens = model.forward_rows([], [], [], prompts, tables).argmax(-1).tolist()
        positions = [len(p) for p in prompts]
        model.lean_decode = True
        lean = model.decode(tokens, positions, tables)
        model.lean_decode = False
        plain = model.decode(tokens, positions, tables)
        model.lean_decode = True
        torch.testing.assert_close(lean, plain, rtol=1e-4, atol=1e-4)
        assert lean.argmax(-1).tolist() == plain.argmax(-1).tolist()


@pytest.mark.model
@pytest.mark.parametrize("weights, small_gemm", [("fp32", True), ("fp32", False)], ids=str)
def test_greedy_parity_with_joins_while_lean_steps_run(family_dir, weights, small_gemm, monkeypatch):
    """20 ragged sequences, 4 joining mid-run: the batch crosses LEAN_MAX_ROWS both ways; every token is
    HF's greedy token, and lean steps (counted) did run."""
    need_kernels()
    ref = Reference(family_dir)
    engine = make_engine(family_dir, 20, weights=weights, small_gemm=small_gemm)
    lean_steps = []
    original = type(engine.model)._lean_block

    def counting(self, layer, *args, **kw):
        if layer == 0:
            lean_steps.append(1)
        return original(self, layer, *args, **kw)

    monkeypatch.setattr(type(engine.model), "_lean_block", counting)
    if engine.model.fused_step is not None:  # fp32 on small_gemm: every lean step is one whole-step call
        step_call = decode_step.StepPlan.__call__
        monkeypatch.setattr(
            decode_step.StepPlan, "__call__", lambda plan, *a: (lean_steps.append(1), step_call(plan, *a))[1]
        )
    budgets = [1 + (i * 5) % 17 for i in range(24)]
    seqs = seqs_for(ref, [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(24)], budgets, ignore_eos=True)
    drive(engine, [(0, seqs[:20]), (2, seqs[20:22]), (7, seqs[22:])])
    assert len(lean_steps) >= 5
    for seq in seqs:
        assert seq.output_token_ids == expected(ref, seq, set())


@pytest.mark.model
@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_whole_step_call_gives_the_per_layer_calls_bits(family_dir, weights):
    """One ``decode_step`` call against the per-layer lean calls: the same logits and the same K/V written into
    the same slots, bit for bit, at batch 1 to LEAN_MAX_ROWS, at 1, 2 and 3 threads (short contexts: one
    attention partition; the long one in the next test)."""
    need_step_kernel()
    engine = make_engine(family_dir, attention.LEAN_MAX_ROWS, weights=weights)
    model = engine.model
    plan = model.fused_step
    assert plan is not None
    per_seq = 4
    for B in (1, 2, 5, attention.LEAN_MAX_ROWS):
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
        prompts = [[(3 * b + i) % 50 + 3 for i in range(2 + b % 9)] for b in range(B)]
        tokens = model.forward_rows([], [], [], prompts, tables).argmax(-1).tolist()
        _same_bits_every_way(model, plan, tokens, [len(p) for p in prompts], tables)


@pytest.mark.model
def test_whole_step_call_over_partitioned_contexts(family_dir):
    """Contexts past one attention partition (512 tokens): the partials combine as paged_attention does."""
    need_step_kernel()
    engine = make_engine(family_dir, 3, weights="int8")
    model = engine.model
    lens, bs = [600, 37, 530], model.kv.block_size
    per_seq = -(-(max(lens) + 1) // bs)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(len(lens))]
    prompts = [[(11 * b + i) % 50 + 3 for i in range(n)] for b, n in enumerate(lens)]
    tokens = model.forward_rows([], [], [], prompts, tables).argmax(-1).tolist()
    _same_bits_every_way(model, model.fused_step, tokens, lens, tables)


def _runs_from_one_state(model, plan, step) -> list[tuple]:
    """``step()`` from the same KV state through the whole-step call ``plan`` at 1, 2 and 3 threads, then at 2
    threads without it (per-layer calls or the torch path); -> (logits, K pool, V pool) after each run."""
    before = model.kv.k.clone(), model.kv.v.clone()
    results = []
    for threads, fused in [(1, True), (2, True), (3, True), (2, False)]:
        model.kv.k.copy_(before[0])
        model.kv.v.copy_(before[1])
        torch.set_num_threads(threads)
        model.fused_step = plan if fused else None
        logits = torch.from_numpy(step())  # the runner's numpy logits, compared as tensors
        results.append((logits, model.kv.k.clone(), model.kv.v.clone()))
    model.fused_step = plan
    return results


def _same_bits_every_way(model, plan, tokens, positions, tables) -> None:
    """The step from the same KV state: whole-step call at 1, 2, 3 threads, and the per-layer calls at 2 threads;
    identical logits and identical pools afterwards."""
    before = model.kv.k.clone()
    results = _runs_from_one_state(model, plan, lambda: model.decode(tokens, positions, tables))
    first = results[0]
    assert not torch.equal(first[1], before)  # the step did write its K/V
    for logits, k, v in results[1:]:
        assert torch.equal(logits, first[0])
        assert torch.equal(k, first[1]) and torch.equal(v, first[2])


@pytest.mark.model
def test_no_whole_step_call_without_compiled_linears(family_dir):
    """fp32 linears on oneDNN only (no small_gemm copy): the kernel has nothing to read, lean steps stay per layer."""
    need_step_kernel()
    model = make_engine(family_dir, 4, weights="fp32", small_gemm=False).model
    assert model.lean_decode and model.fused_step is None


# --- mixed steps: decode rows and prompt chunks in the one whole-step call ------------------------------------

# (decode rows' prompt lengths, chunks as (sequence's prompt length, chunk start, chunk length, every position)),
# blocks of 4 tokens. Chunks: a whole new prompt ending mid-block, one starting mid-sequence over earlier blocks
# and ending on a block boundary, one starting mid-block with logits at every position, a one-token chunk.
MIXED_SMALL = ([5, 9], [(6, 0, 6, False), (12, 8, 4, False), (7, 3, 4, True)])  # 2 + 14 rows
MIXED_LARGE = ([5, 9, 2, 14, 7], [(40, 0, 40, False), (21, 8, 12, True), (13, 12, 1, False)])  # 5 + 53 rows
MIXED_LONG = ([600, 37], [(530, 505, 12, False)])  # partitioned contexts: a decode row and a chunk past 512


def _mixed_step(model, decode_lens: list[int], chunks: list[tuple]) -> tuple[list, dict]:
    """Prefill the decode rows' prompts and each chunk's positions before its start; -> (the mixed step's
    forward arguments, its keyword arguments)."""
    bs = model.kv.block_size
    seq_lens = list(decode_lens) + [n for n, _, _, _ in chunks]
    tables, cursor = [], 0
    for n in seq_lens:  # consecutive blocks, one past each sequence's last position
        need = n // bs + 1
        tables.append(list(range(cursor, cursor + need))[::-1])  # reversed: blocks out of order in the pool
        cursor += need
    prompts = [[(7 * i + 3 * j) % 50 + 3 for j in range(n)] for i, n in enumerate(seq_lens)]
    B = len(decode_lens)
    done = [prompts[b] for b in range(B)] + [prompts[B + i][:start] for i, (_, start, _, _) in enumerate(chunks)]
    ready = [i for i, p in enumerate(done) if p]
    out = model.forward_rows([], [], [], [done[i] for i in ready], [tables[i] for i in ready])
    tokens = out[:B].argmax(-1).tolist()
    args = (tokens, list(decode_lens), tables[:B])
    kwargs = {
        "prompts": [prompts[B + i][start : start + n] for i, (_, start, n, _) in enumerate(chunks)],
        "prompt_tables": tables[B:],
        "prompt_starts": [start for _, start, _, _ in chunks],
        "every_position": [every for *_, every in chunks] if any(c[3] for c in chunks) else (),
    }
    return args, kwargs


def _mixed_every_way(model, args, kwargs) -> None:
    """The mixed step from the same KV state: the whole-step call at 1, 2 and 3 threads gives identical logits
    and K/V; the torch path (2 threads) the same within float tolerance. The whole-step call really ran."""
    plan = model.fused_step
    rows = len(args[0]) + sum(len(p) for p in kwargs["prompts"])
    assert model._takes_fused_step(rows), rows
    results = _runs_from_one_state(model, plan, lambda: model.forward_rows(*args, **kwargs))
    first, (plain, plain_k, plain_v) = results[0], results[-1]
    n_sample = len(args[0]) + sum(
        len(p) if every else 1 for p, every in zip(kwargs["prompts"], kwargs["every_position"] or [False] * 9)
    )
    assert first[0].shape == (n_sample, plain.shape[1])
    for logits, k, v in results[1:-1]:
        assert torch.equal(logits, first[0])
        assert torch.equal(k, first[1]) and torch.equal(v, first[2])
    torch.testing.assert_close(first[0], plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[1], plain_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[2], plain_v, rtol=1e-5, atol=1e-5)
    assert first[0].argmax(-1).tolist() == plain.argmax(-1).tolist()


@pytest.mark.model
@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_mixed_step_gives_the_torch_paths_logits_at_any_thread_count(family_dir, weights):
    """Decode rows plus prompt chunks (new, mid-sequence over earlier blocks, ending mid-block and on a block
    boundary, every position, one token) in one whole-step call: the torch path's logits and K/V, and the same
    bits at 1, 2 and 3 threads. Quantized linears also past small_gemm's row limit, and past the 48 rows one pass
    of quant_gemm's direct path keeps."""
    need_step_kernel()
    engine = make_engine(family_dir, 8, weights=weights, kv_block_size=4)
    model = engine.model
    assert model.fused_step is not None
    cases = [MIXED_SMALL] + ([MIXED_LARGE] if weights != "fp32" else [])
    for decode_lens, chunks in cases:
        _mixed_every_way(model, *_mixed_step(model, decode_lens, chunks))


@pytest.mark.model
def test_mixed_step_over_partitioned_contexts(family_dir):
    """A decode row and a chunk whose rows straddle one attention partition (512 tokens)."""
    need_step_kernel()
    engine = make_engine(family_dir, 3, weights="int8")
    model = engine.model
    _mixed_every_way(model, *_mixed_step(model, *MIXED_LONG))


@pytest.mark.model
def test_fp32_steps_past_small_gemms_row_limit_keep_the_torch_path(family_dir):
    need_step_kernel()
    model = make_engine(family_dir, 4, weights="fp32").model
    assert model.fused_step.max_rows == attention.LEAN_MAX_ROWS
    assert model._takes_fused_step(2 + 14)
    assert not model._takes_fused_step(2 + 15)
    quant = make_engine(family_dir, 4, weights="int4").model
    assert quant._takes_fused_step(quant.fused_step.max_rows)
    assert not quant._takes_fused_step(quant.fused_step.max_rows + 1)


@pytest.mark.model
@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_greedy_parity_with_chunks_riding_in_whole_step_calls(family_dir, weights, monkeypatch):
    """Through the scheduler: 9 ragged prompts and budgets over 4 slots, prefill chunked 6 tokens a step, so
    newcomers join while the others decode and their chunks ride in the same whole-step calls (counted); every
    token is HF's greedy token (on the dequantized weights for int8 / int4)."""
    from test_prefix_cache import hf_engine, submit_all

    from models.quant import dequantize_hf_model_

    need_step_kernel()
    ref = Reference(family_dir)
    if weights != "fp32":
        dequantize_hf_model_(ref.model, weights)
    engine = hf_engine(family_dir, blocks=64, weights=weights, max_num_batched_tokens=6)
    mixed = []
    step_call = decode_step.StepPlan.__call__

    def counting(plan, layout, *rest):
        if len(layout.chunk_rows) and layout.n_decode:
            mixed.append(layout.n)
        return step_call(plan, layout, *rest)

    monkeypatch.setattr(decode_step.StepPlan, "__call__", counting)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(9)]
    seqs = seqs_for(ref, prompts, [1 + (i * 7) % 13 for i in range(9)], ignore_eos=True)
    submit_all(engine, [seqs])
    assert len(mixed) >= 4, mixed
    for seq in seqs:
        assert seq.output_token_ids == expected(ref, seq, set()), (weights, seq.prompt_token_ids)


# --- the step layout as the torch forward reads it ------------------------------------------------------------


def test_the_torch_batch_is_a_view_of_the_step_layout():
    """``MixedBatch.from_layout`` on the CPU: the token arrays are the layout's own memory (no copy), and what the
    torch forward reads besides is derived right: decode rows' tables and context lengths, each chunk's (first row,
    length, start, table), the sampled and the embedded rows; the layout's every-row tables (the kernel's) and
    each row's adapter slot."""
    from models.mixed_batch import MixedBatch
    from models.step_layout import StepLayout, StepLimits

    limits = StepLimits(block_size=4, num_blocks=16)
    # decode rows at positions 5 and 0; chunk 0: 3 tokens from position 6, every position; chunk 1: 2, embedded
    args = ([7, 8], [5, 0], [[1, 2], [3]], [[9, 10, 11], [12, 13]], [[4, 5, 6], [7]], [6, 0], [True, False])
    layout = StepLayout.build(limits, *args, hidden=[False, True])
    batch = MixedBatch.from_layout(layout, torch.device("cpu"))
    for tensor, array in [(batch.ids, layout.ids), (batch.pos, layout.pos), (batch.slot_blocks, layout.slot_blocks)]:
        assert tensor.data_ptr() == array.ctypes.data
    assert batch.pos.tolist() == [5, 0, 6, 7, 8, 0, 1] and batch.slot_blocks.tolist() == [2, 3, 5, 5, 6, 7, 7]
    assert batch.slot_offsets.tolist() == [1, 0, 2, 3, 0, 0, 1] and batch.n_decode == 2
    assert batch.block_tables.tolist() == [[1, 2, 0], [3, 0, 0]] and batch.context_lens.tolist() == [6, 1]
    assert [(r, n, s, t.tolist()) for r, n, s, t in batch.prompts] == [(2, 3, 6, [4, 5, 6]), (5, 2, 0, [7])]
    assert batch.sample_rows.tolist() == [0, 1, 2, 3, 4] and batch.hidden_rows.tolist() == [5, 6]
    assert layout.tables.shape == (4, 3) and layout.row_table.tolist() == [0, 1, 2, 2, 2, 3, 3]  # the kernel's
    assert layout.row_slots([5, -1, 2, 0]).tolist() == [5, -1, 2, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="one adapter slot per decode row and chunk"):
        layout.row_slots([5, -1, 2])
    with pytest.raises(ValueError, match="does not cover"):
        StepLayout.build(limits, [7], [4], [[1]], [], [], None)
    with pytest.raises(ValueError, match="block ids"):
        StepLayout.build(limits, [7], [0], [[16]], [], [], None)
