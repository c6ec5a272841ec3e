"""The KV cache: one preallocated pool of fixed-size blocks for every layer, written in place (on the CPU its pages
are committed as blocks are first written), its elements fp32, fp16, bf16 or int8 (``KV_CACHE_DTYPE``,
``models/kv_dtype.py``).

Layout per tensor: ``[n_layer, num_blocks, n_kv_head, block_size, head_dim]`` (head-major blocks:
each block of one KV head is one contiguous ``block_size x head_dim`` run, which the decode
kernel streams best; ``scripts/bench_paged_attention.py``); an int8 pool's scales (one fp32 per token and head)
``[n_layer, num_blocks, n_kv_head, block_size]`` beside it. Which blocks a sequence holds is
the block manager's business (``block_manager.py``, torch-free); this class only stores and
reads: token at position ``p`` of a sequence with block table ``t`` lives in block
``t[p // block_size]`` at offset ``p % block_size``. A token's K/V are converted once, when written (round to
nearest even; int8: q8_0's rule, ``paged_attention.quantize_int8``), and read in place by the attention kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from . import kv_dtype
from .kernels.paged_attention import dequantize, to_pool_dtype

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def _zeros(shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed pool. On the CPU, numpy's calloc: the OS hands out zero pages as they are first written, so the
    pool's RSS is the blocks used, not the pool's size (``torch.zeros`` writes every page at start)."""
    if torch.device(device).type == "cpu":
        if dtype == torch.bfloat16:  # numpy has no bf16: its 16 bits, viewed
            return torch.from_numpy(np.zeros(shape, np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(np.zeros(shape, torch.empty(0, dtype=dtype).numpy().dtype))
    return torch.zeros(shape, device=device, dtype=dtype)


class PagedKVCache:
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
        shape = (n_layer, num_blocks, n_kv_head, block_size, head_dim)
        self.dtype = kv_dtype.check(dtype)
        elements = TORCH_DTYPES[dtype]
        self.k, self.v = _zeros(shape, device, elements), _zeros(shape, device, elements)
        self.k_scale = self.v_scale = None
        if kv_dtype.has_scales(dtype):
            self.k_scale = _zeros(shape[:4], device, torch.float32)
            self.v_scale = _zeros(shape[:4], device, torch.float32)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the pool: K and V, and int8's scales."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @staticmethod
    def bytes_per_block(n_layer: int, block_size: int, n_kv_head: int, head_dim: int, dtype: str = "fp32") -> int:
        """K and V of one block over every layer (int8: with its scales)."""
        return block_size * kv_dtype.bytes_per_token(dtype, n_layer, n_kv_head, head_dim)

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
