"""Attention over a mixed batch, shared by every family: grouped-query attention (GPT-2 is the case of one query head
per K/V head) with decode rows over their KV blocks in place and each prompt chunk causally over itself and its
earlier blocks (``mixed_attention``), and the lean decode step's one-call RoPE + KV write + paged attention
(``lean_attention``).

Shapes: N = B + T tokens, H = query heads, KVH = K/V heads, G = H / KVH, D = head_dim.
"""

from __future__ import annotations

import torch

from .kernels import decode_ops, small_gemm
from .kernels import paged_attention as attention_kernel
from .kernels.paged_attention import attend, paged_attention
from .kv_cache import PagedKVCache
from .mixed_batch import MixedBatch


def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKVCache,
    layer: int,
    batch: MixedBatch,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Grouped-query attention over a mixed batch; writes this layer's new K/V into their slots first.

    q: [N, H, D], k, v: [N, KVH, D] (H = KVH x G; G = 1 is plain multi-head attention, GPT-2)
    -> [N, H, D]. Decode rows attend over their blocks in place (``paged_attention``: the compiled
    kernel on the CPU, no gather; query head ``h = kvh * G + g`` reads K/V head ``kvh``). A prompt
    chunk attends causally over itself, plus its sequence's earlier positions (gathered once from its
    blocks) when it does not start at 0. ``window`` > 0 (a sliding-window layer): a token at position p
    sees keys in (p - window, p] only (HF's mask), and a chunk gathers only the blocks its window reaches;
    ``softcap`` > 0: scores are soft-capped (``attention_kernel.attend``).
    With an fp16 / bf16 / int8 pool a chunk attends over what the pool holds, its own tokens as stored included
    (``_stored_chunk_attention``), so a prompt gives the same K/V to every later token whether it was prefilled at
    once, in chunks or found in the prefix cache.
    """
    N, H, D = q.shape
    B = batch.n_decode
    kv.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
    out = torch.empty(N, H, D, device=q.device, dtype=q.dtype)
    k_pool, v_pool, scales = kv.pools(layer)
    if B:
        tables, lens = batch.block_tables[:B], batch.context_lens
        out[:B] = paged_attention(q[:B], k_pool, v_pool, tables, lens, scale, window, softcap, scales)
    for row, n, start, table in batch.prompts:
        span = slice(row, row + n)
        if kv.dtype != "fp32":
            out[span] = _stored_chunk_attention(q[span], kv, layer, table, start, scale, window, softcap)
            continue
        qp, kp, vp = q[span].transpose(0, 1), k[span].transpose(0, 1), v[span].transpose(0, 1)  # [H or KVH, n, D]
        first = max(0, start - window + 1) if window > 0 else 0  # the earliest key any of the chunk's queries sees
        if start == 0 and (window <= 0 or n <= window):
            att = attend(qp, kp, vp, None, scale, softcap)  # causal over the chunk: every key within its window
        else:
            keys, values = kp, vp
            if start > first:
                past_k, past_v = kv.gather(layer, table, start, first)  # [KVH, start - first, D]
                keys, values = torch.cat([past_k, keys], dim=1), torch.cat([past_v, values], dim=1)
            # Query i sits at position start + i and sees keys [first, start + i] (within its window).
            at, pos = torch.arange(first, start + n, device=q.device), start + torch.arange(n, device=q.device)[:, None]
            mask = at <= pos
            if window > 0:
                mask &= at > pos - window
            att = attend(qp, keys, values, mask, scale, softcap)
        out[span] = att.transpose(0, 1)  # [n, H, D]
    return out


def _stored_chunk_attention(
    q: torch.Tensor,
    kv: PagedKVCache,
    layer: int,
    table: torch.Tensor,
    start: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A prompt chunk's queries q [n, H, D] (positions start .. start + n - 1) over its sequence's stored K/V
    [0, start + n) (written already; within each query's ``window`` when set) -> [n, H, D]. On the CPU the paged
    kernel reads the pool in place, each row a query with its own context (what the whole-step kernel does with a
    chunk's rows); elsewhere the blocks the chunk's windows reach are gathered dequantized and masked."""
    n, H, D = q.shape
    k_pool, v_pool, scales = kv.pools(layer)
    if attention_kernel.kernel_supports(q, k_pool):
        tables = table.to(torch.int32).expand(n, -1)
        lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        return paged_attention(q, k_pool, v_pool, tables, lens, scale, window, softcap, scales)
    first = max(0, start - window + 1) if window > 0 else 0  # the earliest key any of the chunk's queries sees
    keys, values = kv.gather(layer, table, start + n, first, q.dtype)  # [KVH, start + n - first, D]
    at, pos = torch.arange(first, start + n, device=q.device), start + torch.arange(n, device=q.device)[:, None]
    mask = at <= pos
    if window > 0:
        mask &= at > pos - window
    return attend(q.transpose(0, 1), keys, values, mask, scale, softcap).transpose(0, 1)


LEAN_MAX_ROWS = small_gemm.MAX_ROWS  # decode steps up to this batch take the lean path (dispatch-bound there)


def lean_decode_supported(
    device: torch.device, head_dim: int, block_size: int, pool_dtype: torch.dtype = torch.float32
) -> bool:
    """Whether this model can run lean decode steps: CPU, and the compiled kernels it needs load here."""
    if device.type != "cpu" or decode_ops.load() is None:
        return False
    probe_q, probe_pool = torch.empty(1, 1, head_dim), torch.empty(1, block_size, 1, head_dim, dtype=pool_dtype)
    return attention_kernel.kernel_supports(probe_q, probe_pool)


def lean_attention(
    qkv: torch.Tensor,
    n_head: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    pools: tuple,
    batch: MixedBatch,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A lean decode step's attention: qkv [B, (H + 2 KVH) D] -> [B, H D]; RoPE (the full cos, sin tables, or
    None), the K/V write into this layer's ``pools`` (``PagedKVCache.pools``: K, V, int8's scales) and the paged
    attention (its ``window`` and ``softcap``) in one kernel call."""
    k_pool, v_pool, scales = pools
    out = attention_kernel.rope_write_attend(
        qkv,
        n_head,
        rope,
        batch.pos,
        k_pool,
        v_pool,
        batch.slot_blocks,
        batch.slot_offsets,
        batch.block_tables,
        batch.context_lens,
        scale,
        window,
        softcap,
        scales,
    )
    return out.view(qkv.shape[0], -1)
