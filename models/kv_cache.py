"""The KV cache as the torch forward reads and writes it: the block pool (``models.kv_pool.KVPool``: layout
``[n_layer, num_blocks, n_kv_head, block_size, head_dim]``, int8's scales beside it; elements ``KV_CACHE_DTYPE``) as
torch tensors. On the CPU they are views of the numpy pool the native runner uses too (``torch.from_numpy``: no copy,
and the pool's pages are committed as blocks are first written); on another device, device tensors of the same
layout. A token's K/V are converted once, when written (round to nearest even; int8: q8_0's rule,
``paged_attention.quantize_int8``), and read in place by the attention kernel.
"""

from __future__ import annotations

import torch

from . import kv_dtype
from .kernels.paged_attention import dequantize, to_pool_dtype
from .kv_pool import KVPool

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def _view(a, dtype: torch.dtype) -> torch.Tensor | None:
    """A numpy pool array as a torch tensor of ``dtype`` sharing its memory (bf16: its raw 16 bits, viewed)."""
    if a is None:
        return None
    t = torch.from_numpy(a)
    return t.view(dtype) if t.dtype != dtype else t


class PagedKVCache:
    """The pool's K, V (and int8's scales) as torch tensors (``k``, ``v``, ``k_scale``, ``v_scale``); ``pool``: the
    ``KVPool`` they view on the CPU, else None."""

    def __init__(
        self,
        n_layer: int,
        num_blocks: int,
        block_size: int,
        n_kv_head: int,
        head_dim: int,
        device: torch.device,
        dtype: str = "fp32",
    ) -> None:
        self.dtype = kv_dtype.check(dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        elements = TORCH_DTYPES[dtype]
        self.pool = None
        if torch.device(device).type == "cpu":
            self.pool = KVPool(n_layer, num_blocks, block_size, n_kv_head, head_dim, dtype)
            self.k, self.v = _view(self.pool.k, elements), _view(self.pool.v, elements)
            self.k_scale = _view(self.pool.k_scale, torch.float32)
            self.v_scale = _view(self.pool.v_scale, torch.float32)
            return
        shape = (n_layer, num_blocks, n_kv_head, block_size, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=elements)
        self.v = torch.zeros(shape, device=device, dtype=elements)
        self.k_scale = self.v_scale = None
        if kv_dtype.has_scales(dtype):
            self.k_scale = torch.zeros(shape[:4], device=device, dtype=torch.float32)
            self.v_scale = torch.zeros(shape[:4], device=device, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool: K and V, and int8's scales."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store N tokens' keys/values, converted to the pool's dtype. blocks, offsets: [N] slots; k, v: [N, n_kv_head,
        head_dim] (the bits the attention kernel's own writes give)."""
        (kq, ks), (vq, vs) = to_pool_dtype(k, self.k.dtype), to_pool_dtype(v, self.v.dtype)
        self.k[layer][blocks, :, offsets] = kq  # advanced indices around a slice: the selection is [N, KVH, D]
        self.v[layer][blocks, :, offsets] = vq
        if ks is not None:
            self.k_scale[layer][blocks, :, offsets] = ks
            self.v_scale[layer][blocks, :, offsets] = vs

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src``, K and V (and int8's scales), every layer (a forked sequence's
        own copy of its parent's partial last block, which it then writes past)."""
        if self.pool is not None:  # the CPU: the numpy pool these tensors view
            self.pool.copy_block(src, dst)
            return
        for t in self._tensors():
            t[:, dst] = t[:, src]

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """This layer's pools in the attention kernel's logical shape [num_blocks, block_size, KVH, D] (views), and an
        int8 pool's scales [num_blocks, block_size, KVH] (views), else None."""
        scales = None
        if self.k_scale is not None:
            scales = (self.k_scale[layer].transpose(1, 2), self.v_scale[layer].transpose(1, 2))
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2), scales

    def gather(
        self, layer: int, table: torch.Tensor, length: int, first: int = 0, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [first, length) of a sequence with block table ``table`` ([>= ceil(length /
        block_size)] long; entries before ``first``'s block are not read: a sliding window's released blocks): each
        [KVH, length - first, D] in ``dtype`` (dequantized), a copy (prefill chunks read their earlier blocks once)."""
        b0, n = first // self.block_size, -(-length // self.block_size)
        blocks = table[b0:n]
        span, KVH = (n - b0) * self.block_size, self.k.shape[2]
        lo = first - b0 * self.block_size

        def one(pool: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
            x = dequantize(pool[layer][blocks], None if scale is None else scale[layer][blocks], dtype)
            return x.transpose(0, 1).reshape(KVH, span, -1)[:, lo : lo + length - first]  # [KVH, length - first, D]

        return one(self.k, self.k_scale), one(self.v, self.v_scale)
