"""The KV cache: one preallocated pool of fixed-size blocks for every layer, written in place (on the CPU its pages
are committed as blocks are first written).

Layout per tensor: ``[n_layer, num_blocks, n_kv_head, block_size, head_dim]`` (head-major blocks:
each block of one KV head is one contiguous ``block_size x head_dim`` run, which the decode
kernel streams best; ``scripts/bench_paged_attention.py``). Which blocks a sequence holds is
the block manager's business (``block_manager.py``, torch-free); this class only stores and
reads: token at position ``p`` of a sequence with block table ``t`` lives in block
``t[p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

import numpy as np
import torch


def _zeros(shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed pool. On the CPU, numpy's calloc: the OS hands out zero pages as they are first written, so the
    pool's RSS is the blocks used, not the pool's size (``torch.zeros`` writes every page at start)."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.from_numpy(np.zeros(shape, np.float32))
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
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (n_layer, num_blocks, n_kv_head, block_size, head_dim)
        self.k, self.v = _zeros(shape, device, dtype), _zeros(shape, device, dtype)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_block(n_layer: int, block_size: int, n_kv_head: int, head_dim: int, element_size: int = 4) -> int:
        """K and V of one block over every layer."""
        return 2 * n_layer * block_size * n_kv_head * head_dim * element_size

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store N tokens' keys/values. blocks, offsets: [N] slots; k, v: [N, n_kv_head, head_dim]."""
        self.k[layer][blocks, :, offsets] = k  # advanced indices around a slice: the selection is [N, KVH, D]
        self.v[layer][blocks, :, offsets] = v

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src``, K and V, every layer (a forked sequence's own copy of
        its parent's partial last block, which it then writes past)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's pools in the attention kernel's logical shape [num_blocks, block_size, KVH, D] (views)."""
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)

    def gather(self, layer: int, table: torch.Tensor, length: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [first, length) of a sequence with block table ``table`` ([>= ceil(length /
        block_size)] long; entries before ``first``'s block are not read: a sliding window's released blocks): each
        [KVH, length - first, D], a copy (prefill chunks read their earlier blocks once)."""
        b0, n = first // self.block_size, -(-length // self.block_size)
        blocks = table[b0:n]
        span = (n - b0) * self.block_size
        k = self.k[layer][blocks].transpose(0, 1).reshape(self.k.shape[2], span, -1)  # [KVH, (n - b0) bs, D]
        v = self.v[layer][blocks].transpose(0, 1).reshape(self.v.shape[2], span, -1)
        lo = first - b0 * self.block_size
        return k[:, lo : lo + length - first], v[:, lo : lo + length - first]
