"""The KV block pool both runtimes step over (numpy, torch-free): one preallocated pool of fixed-size blocks for every
layer, written in place, its elements fp32, fp16, bf16 (stored as its raw 16 bits) or int8 (``KV_CACHE_DTYPE``,
``models/kv_dtype.py``).

Layout per array: ``[n_layer, num_blocks, n_kv_head, block_size, head_dim]`` (head-major blocks: each block of one
KV head is one contiguous ``block_size x head_dim`` run, which the attention kernels stream best;
``scripts/bench_paged_attention.py``); an int8 pool's scales (one fp32 per token and head)
``[n_layer, num_blocks, n_kv_head, block_size]`` beside it. Token at position ``p`` of a sequence with block table
``t`` lives in block ``t[p // block_size]`` at offset ``p % block_size``; which blocks a sequence holds is the block
manager's business (``core/block_manager.py``). Allocated with ``np.zeros`` (calloc): the OS commits a page when it
is first written, so the pool's RSS is the blocks used, not the pool's size.

The native runner (``models/native.py``) hands the kernel its addresses; the torch forward views the same arrays
(``models.kv_cache.PagedKVCache``, ``torch.from_numpy``) on the CPU.
"""

from __future__ import annotations

import numpy as np

from models import kv_dtype
from models.kernels import step_abi


class KVPool:
    """K and V pools (and int8's scales) of ``num_blocks`` blocks of ``block_size`` tokens over ``n_layer`` layers."""

    def __init__(
        self, n_layer: int, num_blocks: int, block_size: int, n_kv_head: int, head_dim: int, dtype: str = "fp32"
    ) -> None:
        self.dtype = kv_dtype.check(dtype)
        shape = (n_layer, num_blocks, n_kv_head, block_size, head_dim)
        elements = kv_dtype.NUMPY_DTYPES[dtype]
        self.k, self.v = np.zeros(shape, elements), np.zeros(shape, elements)
        self.k_scale = self.v_scale = None
        if kv_dtype.has_scales(dtype):  # one per (block, head, token): the pools' strides / D
            self.k_scale, self.v_scale = np.zeros(shape[:4], np.float32), np.zeros(shape[:4], np.float32)
        self.num_blocks, self.block_size = num_blocks, block_size

    def arrays(self) -> list[np.ndarray]:
        """K, V and (int8) their scales."""
        return [a for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool: K and V, and int8's scales."""
        return sum(a.nbytes for a in self.arrays())

    @staticmethod
    def bytes_per_block(n_layer: int, block_size: int, n_kv_head: int, head_dim: int, dtype: str = "fp32") -> int:
        """K and V of one block over every layer (int8: with its scales)."""
        return block_size * kv_dtype.bytes_per_token(dtype, n_layer, n_kv_head, head_dim)

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src``, K and V (and int8's scales), every layer (a forked sequence's
        own copy of its parent's partial last block, which it then writes past)."""
        if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks):
            raise ValueError(f"blocks {src}, {dst} outside the pool of {self.num_blocks}")
        for a in self.arrays():
            a[:, dst] = a[:, src]

    def geometry(self) -> step_abi.PoolGeometry:
        """Every layer's pools as the kernels read them, [num_blocks, block_size, KVH, D]: their strides (elements)
        and element code."""
        _, _, KVH, bs, D = self.k.shape
        return step_abi.PoolGeometry(bs, KVH * bs * D, D, bs * D, kv_dtype.CODES[self.dtype])

    def layer_addresses(self, layer: int) -> tuple[int, int, int | None, int | None]:
        """Addresses of layer ``layer``'s K and V pools and (int8) their scales."""

        def at(a: np.ndarray | None) -> int | None:
            return None if a is None else a.ctypes.data + layer * a.strides[0]

        return at(self.k), at(self.v), at(self.k_scale), at(self.v_scale)
