"""Paged decode attention: one query token per row against K/V read in place from the block pool.

``paged_attention`` runs the compiled kernel (``paged_attention.c``) on the CPU for a pool of fp32, fp16, bf16
or int8 elements (``models/kv_dtype.py``; each read as stored and converted in registers) and the torch
fallback (gather the row's blocks, dequantize them, then SDPA: the same math) anywhere else, or when the
kernel cannot be built. ``build.py`` compiles it once per machine (AVX2 + FMA + F16C, OpenMP) into the
cache's ``kernels/`` directory, keyed by the source and flags, and loads it with ctypes; OpenMP
resolves to the libgomp torch already loaded, so it shares torch's thread team. Without a
compiler or AVX2, ``load()`` returns None, logs why once, and callers get the fallback.

Shapes: ``q`` [B, H, D] fp32; ``k_pool``, ``v_pool`` [num_blocks, block_size, KVH, D] (logical shape; any
strides with D contiguous, e.g. a head-major pool [num_blocks, KVH, block_size, D] passed as
``pool.transpose(1, 2)``) of float32, float16, bfloat16 or int8; an int8 pool's ``scales`` (k_scale, v_scale)
[num_blocks, block_size, KVH] float32, strides those of the pool divided by D; ``block_tables`` [B, max_blocks]
int32 (entries past a row's blocks are ignored); ``context_lens`` [B] int32. Query head h reads KV head
h // (H // KVH) (GQA, no expansion). ``window`` > 0 (a sliding-window layer): a row attends only its last
``window`` tokens (HF's mask: keys in (q - window, q]); its blocks before them are never read. ``softcap`` > 0:
each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
import torch.nn.functional as F

from .build import KernelLoader, build_and_load, require_cpu_flags, with_isa

log = logging.getLogger("minibatch.paged_attention")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_attention.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
MAX_HEAD_DIM = 256  # DMAX in paged_attention.c
MAX_BLOCK_SIZE = 256  # BSMAX in paged_attention.c
# torch dtype of a pool -> KV_FP32 .. KV_INT8 in paged_attention.c (models/kv_dtype.CODES)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class KVPool(ctypes.Structure):
    """paged_attention.c's KVPool: one layer's pools (strides in elements), their int8 scales or NULL."""

    _fields_ = [
        *(("k", _P), ("v", _P), ("k_scale", _P), ("v_scale", _P)),
        *(("block_stride", _L), ("token_stride", _L), ("head_stride", _L)),
        *(("dtype", _I), ("block_size", _I), ("kv_heads", _I), ("head_dim", _I)),
    ]


def _load() -> ctypes.CDLL:
    require_cpu_flags(("avx2", "fma", "f16c"), "AVX2, FMA and F16C")
    lib = build_and_load(SOURCE, FLAGS)
    P, L, N, F32 = _P, _L, _I, ctypes.c_float
    lib.paged_attention.restype = N
    lib.paged_attention.argtypes = [
        *(P, L, P),  # q, q_row_stride, pool
        *(P, N, P, P),  # block_tables, table_stride, context_lens, out
        *(N, N, F32, N, F32, N, N),  # B, H, scale, window, softcap, part_tokens, nthreads
    ]
    lib.rope_write_attend.restype = N
    lib.rope_write_attend.argtypes = [
        *(P, L, P, P, N, P, P),  # qkv, ldqkv, cos, sin, rotary dims, pos, pool
        *(P, P, P, N, P),  # slot_blocks, slot_offsets, block_tables, table_stride, context_lens
        *(P, P, N, N, F32, N, F32, N),  # q_buf, out, B, H, scale, window, softcap, nthreads
    ]
    return with_isa(lib)  # attention_isa: its AVX-512 path where the CPU has it (KERNEL_ISA), the same bits


KERNEL = KernelLoader("paged attention kernel", _load, "using the torch fallback", log)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``KERNEL.unavailable_reason`` says why; logged once)."""
    return KERNEL.load()


def kernel_supports(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the compiled kernel can serve these tensors (fp32 queries on the CPU over a pool of a dtype it reads,
    its size limits)."""
    D, block_size = q.shape[-1], k_pool.shape[1]
    return (
        q.device.type == "cpu"
        and k_pool.device.type == "cpu"
        and q.dtype == torch.float32
        and k_pool.dtype in DTYPE_CODES
        and D % 8 == 0
        and D <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK_SIZE
        and load() is not None
    )


def _check(q, k_pool, v_pool, block_tables, context_lens, scales=None) -> None:
    B, H, D = q.shape
    KVH, Dk = k_pool.shape[2:]
    if v_pool.shape != k_pool.shape or v_pool.stride() != k_pool.stride() or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ in shape or strides")
    if Dk != D or H % KVH:
        raise ValueError(f"q [{B}, {H}, {D}] does not match a pool of {KVH} KV heads of size {Dk}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"need block_tables [{B}, max_blocks] and context_lens [{B}]")
    if (k_pool.dtype == torch.int8) != (scales is not None):
        raise ValueError("an int8 pool needs its scales (k_scale, v_scale), and only an int8 pool has them")
    if scales is not None:
        want = tuple(s // D for s in k_pool.stride()[:3])
        for s in scales:
            if s.dtype != torch.float32 or s.shape != k_pool.shape[:3] or s.stride() != want:
                raise ValueError(f"int8 scales must be float32 {tuple(k_pool.shape[:3])} with strides {want}")


def kv_pool(k_pool: torch.Tensor, v_pool: torch.Tensor, scales=None) -> KVPool:
    """The kernel's description of one layer's pools (the tensors must outlive its use)."""
    if k_pool.stride(3) != 1 or any(s % k_pool.shape[3] for s in k_pool.stride()[:3]):
        raise ValueError("the pool's head dimension must be contiguous and its other strides multiples of it")
    ks, vs = (scales[0].data_ptr(), scales[1].data_ptr()) if scales is not None else (None, None)
    return KVPool(
        *(k_pool.data_ptr(), v_pool.data_ptr(), ks, vs),
        *k_pool.stride()[:3],
        *(DTYPE_CODES[k_pool.dtype], k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]),
    )


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    part_tokens: int = 0,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per row over its first context_lens[b] tokens (the last ``window`` of them, when
    set; scores soft-capped by ``softcap`` when set) -> [B, H, D] fp32.

    Uses the compiled kernel when ``kernel_supports`` (one pass over each row's blocks, in place, each element
    converted as it is loaded), else ``paged_attention_torch``. ``scales``: an int8 pool's (k_scale, v_scale).
    ``part_tokens``: tokens per partition of a long context (0: the kernel's 512; whole blocks), for tests.
    """
    _check(q, k_pool, v_pool, block_tables, context_lens, scales)
    if not kernel_supports(q, k_pool):
        return paged_attention_torch(q, k_pool, v_pool, block_tables, context_lens, scale, window, softcap, scales)
    B, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()  # the kernel reads each row's heads back to back
    pool = kv_pool(k_pool, v_pool, scales)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(B, H, D, dtype=torch.float32)
    rc = load().paged_attention(
        *(q.data_ptr(), q.stride(0), ctypes.byref(pool)),
        *(tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr()),
        *(B, H, scale, window, softcap, part_tokens, torch.get_num_threads()),
    )
    if rc != 0:
        raise MemoryError("paged attention: cannot allocate the partition workspace")
    return out


def rope_write_attend(
    qkv: torch.Tensor,
    n_head: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    pos: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One layer of a decode step in one kernel call: rotate q and k (``rope``), write k and v into their
    slots (converted to the pool's dtype), attend every row over its blocks (``paged_attention``'s ``window``
    and ``softcap``) -> [B, H, D].

    qkv: [B, (H + 2 KVH) D] rows of the fused QKV linear (q heads, then k, then v; unit stride along the
    row). rope: the (cos, sin) tables [max_len, 1, R] contiguous (R <= D: each head's first R dims rotate), or
    None (no rotation); pos, slot_blocks, slot_offsets: [B] int64; block_tables [B, max_blocks], context_lens [B]
    int32 (context_lens[b] counts the new token). Pools (and an int8 pool's scales) as for ``paged_attention``.
    The caller checks ``kernel_supports``.
    """
    B, H = qkv.shape[0], n_head
    KVH, D = k_pool.shape[2], k_pool.shape[3]
    if qkv.stride(1) != 1 or qkv.shape[1] != (H + 2 * KVH) * D or k_pool.stride() != v_pool.stride():
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match {H} query and {KVH} KV heads of size {D}")
    pool = kv_pool(k_pool, v_pool, scales)
    cos, sin = (rope[0].data_ptr(), rope[1].data_ptr()) if rope is not None else (None, None)
    rotary = rope[0].shape[-1] if rope is not None else D
    q_buf, out = torch.empty(B, H, D), torch.empty(B, H, D)
    rc = load().rope_write_attend(
        *(qkv.data_ptr(), qkv.stride(0), cos, sin, rotary, pos.data_ptr(), ctypes.byref(pool)),
        *(slot_blocks.data_ptr(), slot_offsets.data_ptr(), block_tables.data_ptr(), block_tables.stride(0)),
        *(context_lens.data_ptr(), q_buf.data_ptr(), out.data_ptr(), B, H, scale),
        *(window, softcap, torch.get_num_threads()),
    )
    if rc != 0:
        raise MemoryError("paged attention: cannot allocate the partition workspace")
    return out


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] fp32 -> (q int8 [..., D], scale fp32 [...]): ``store_row``'s int8 rule in torch, bit for bit
    (d = max |x| / 127, q = round-half-even(x * (1 / d)), d = 0 for a zero row)."""
    scale = x.abs().amax(-1) / 127.0
    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round(x * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [..., D] fp32 as a pool of ``dtype`` stores them -> (elements, int8 scales or None); the kernel's
    conversion (round to nearest even) in torch."""
    if dtype == torch.int8:
        return quantize_int8(x)
    return x.to(dtype), None


def dequantize(pool: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pool elements [..., D] as ``dtype`` (an int8 pool's values times their scales [...])."""
    if scale is None:
        return pool.to(dtype)
    return (pool.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The same math in torch for any device and dtype: gather each row's blocks into [B, KVH, L, D]
    (L = the longest context, in whole blocks) in q's dtype (an int8 pool's rows times their scales), mask
    positions past each row's length (and before its window), ``attend``."""
    _check(q, k_pool, v_pool, block_tables, context_lens, scales)
    B, H, D = q.shape
    _, block_size, KVH, _ = k_pool.shape
    lens = context_lens.to(device=q.device, dtype=torch.long)
    n_blocks = max(1, -(-int(lens.max()) // block_size)) if B else 1
    # Entries past a row's blocks may be anything (padding): clamp them to a valid id, the mask hides them.
    tables = block_tables[:, :n_blocks].to(device=q.device, dtype=torch.long).clamp(0, k_pool.shape[0] - 1)
    L = n_blocks * block_size
    k_scale, v_scale = (scales[0][tables], scales[1][tables]) if scales is not None else (None, None)
    keys = dequantize(k_pool[tables], k_scale, q.dtype).reshape(B, L, KVH, D).transpose(1, 2)  # [B, KVH, L, D]
    values = dequantize(v_pool[tables], v_scale, q.dtype).reshape(B, L, KVH, D).transpose(1, 2)
    at = torch.arange(L, device=q.device)
    mask = at < lens[:, None]  # [B, L]
    if window > 0:
        mask &= at > lens[:, None] - 1 - window
    out = attend(q.reshape(B, H, 1, D), keys, values, mask.view(B, 1, 1, L), scale, softcap)
    # A row with no context has no valid key: SDPA gives NaN there, the kernel gives zeros.
    return out.reshape(B, H, D).masked_fill((lens == 0).view(B, 1, 1), 0.0)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """Grouped-query attention: q [..., H, n, D], keys, values [..., KVH, L, D] (query head h reads K/V head
    h // (H / KVH)), mask broadcastable to [..., H, n, L] (True: attend), or None (causal, n = L) -> [..., H, n, D].
    softmax(q k^T * scale) v through SDPA; with ``softcap`` > 0, HF's eager math instead: the scores, their soft-cap
    softcap * tanh(s / softcap), the mask, an fp32 softmax."""
    H, KVH = q.shape[-3], keys.shape[-3]
    if softcap <= 0:
        if mask is None:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=KVH != H)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=KVH != H)
    *lead, _, n, D = q.shape
    L = keys.shape[-2]
    grouped = q.reshape(*lead, KVH, H // KVH, n, D)  # [..., KVH, G, n, D]
    scores = torch.matmul(grouped, keys.unsqueeze(-3).transpose(-1, -2)) * scale  # [..., KVH, G, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    else:  # [..., H, n, L] -> [..., KVH, G, n, L]
        mask = mask.expand(*lead, H, n, L).reshape(*lead, KVH, H // KVH, n, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32), values.unsqueeze(-3))
    return out.reshape(*lead, H, n, D)
