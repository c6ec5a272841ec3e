"""The GGUF weight types we serve, each with its block layout and its reference dequantization (numpy).

A quantized [N, K] weight of type T is held exactly as the file stores it: N rows (one per output feature), each
``K / T.block`` blocks of ``T.nbytes`` bytes in k order, so its resident bytes are the file's tensor bytes. The
kernels (``models/kernels/quants/<type>.h``, one per type) read these bytes and dequantize in registers; the
functions here are the reference they are tested against, and each is bit for bit gguf-py's
``gguf.quants.dequantize`` (``tests/test_gguf_blocks.py``), which is what transformers loads a GGUF with.

Why the values are exact in fp32 (and so why a kernel can reproduce them bit for bit): every type's weight is
``a * q`` or ``a * q + b`` where ``q`` is a small integer and ``a`` (and ``b``) an fp16 scale, or a product of an
fp16 scale and a small integer sub-scale. Those products have at most 11 + 7 + 7 significant bits < 24, so they
are exact in fp32, and ``a * q + b`` rounds once: the same value as one fused multiply-add. docs/quantization.md
has the table.

Layouts (byte offsets within one block; fp16 little-endian; "q[j]" is element j of the block):

    F32     4 B / 1        the float
    F16     2 B / 1        the half
    BF16    2 B / 1        the upper half of a float
    Q8_0   34 B / 32       d f16 | q int8[32]                                    w = d q
    Q4_0   18 B / 32       d | qs[16]: q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4 w = d (q - 8)
    Q4_1   20 B / 32       d | m | qs[16] (as Q4_0)                              w = d q + m
    Q5_0   22 B / 32       d | qh u32 (bit j: q[j]'s 5th bit) | qs[16]          w = d (q - 16)
    Q5_1   24 B / 32       d | m | qh | qs[16]                                   w = d q + m
    IQ4_NL 18 B / 32       d | qs[16] (as Q4_0)                                  w = d KVALUES[q]
    Q2_K   84 B / 256      scales[16] (lo 4 bits sc, hi 4 bits m) | qs[64] | d | dmin; 16 sub-blocks of 16:
                           sub-block s = 8 h + 2 j + g (half h, shift j, group g) has q[l] = qs[32 h + 16 g + l]
                           >> 2 j & 3                                            w = (d sc) q - (dmin m)
    Q3_K  110 B / 256      hmask[32] | qs[64] | scales[12] (16 x 6 bits, -32) | d; 16 sub-blocks of 16 as Q2_K,
                           q = (2 low bits) - 4 when hmask[16 g + l] bit 4 h + j is clear   w = (d sc) q
    Q4_K  144 B / 256      d | dmin | scales[12] (8 x (6-bit sc, 6-bit m)) | qs[128]; 8 sub-blocks of 32: s = 2 p
                           + (0 lo, 1 hi nibble) of qs[32 p + l]                 w = (d sc) q - (dmin m)
    Q5_K  176 B / 256      d | dmin | scales[12] | qh[32] (bit s: sub-block s's 5th bit) | qs[128]   as Q4_K
    Q6_K  210 B / 256      ql[128] | qh[64] | scales int8[16] | d; per 128-half h, quarter c (32 elements): low
                           nibbles ql[64 h + 32 (c % 2) + l] (lo for c < 2, hi above), 2 high bits qh[32 h + l]
                           >> 2 c; sub-block of 16 = 8 h + 2 c + l / 16           w = (d sc) (q - 32)
    IQ4_XS 136 B / 256     d | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32: sc = 4 bits of scales_l
                           | 2 bits of scales_h << 4, - 32; qs[16 s ..] as Q4_0  w = (d sc) KVALUES[q]

Torch-free (numpy only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)  # IQ4 grid


@dataclass(frozen=True)
class BlockType:
    """One GGUF type: ``block`` weights in ``nbytes`` bytes; ``type_id`` is ggml's (the kernels' ``fmt``);
    ``halves``: byte offsets of the block's fp16 scales (the rest is integer data); ``dequantize`` maps uint8
    blocks [n, nbytes] to fp32 weights [n, block]."""

    name: str
    type_id: int
    block: int
    nbytes: int
    halves: tuple[int, ...]
    dequantize: Callable[[np.ndarray], np.ndarray]

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` weights (``k`` a multiple of ``block``)."""
        return k // self.block * self.nbytes


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of each block -> fp32 [n, 1]."""
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0-15, high nibbles 16-31 (Q4_0's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits(b: np.ndarray, at: int, count: int) -> np.ndarray:
    """``count`` bits of the little-endian bytes from ``at`` -> [n, count] uint8 (bit j of the word)."""
    return np.unpackbits(b[:, at : at + count // 8], axis=1, bitorder="little")


def _f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32)


def _f16_values(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).astype(np.float32) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:]) | _bits(b, 2, 32) << 4
    return _f16(b, 0) * (q.astype(np.float32) - 16)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:]) | _bits(b, 4, 32) << 4
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * KVALUES[_nibbles(b[:, 2:])].astype(np.float32)


def _two_bit_groups(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K quants [n, 64] -> [n, 16 sub-blocks, 16]: sub-block 8 h + 2 j + g is bits 2j of qs[32h + 16g ..]."""
    n = qs.shape[0]
    shifted = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # [n, h, j, 32]
    return (shifted & 3).reshape(n, 16, 16)


def _q2_k(b: np.ndarray) -> np.ndarray:
    n, sc = b.shape[0], b[:, 0:16]
    a = _f16(b, 80) * (sc & 15).astype(np.float32)  # [n, 16]
    m = _f16(b, 82) * (sc >> 4).astype(np.float32)
    return (a[:, :, None] * _two_bit_groups(b[:, 16:80]).astype(np.float32) - m[:, :, None]).reshape(n, 256)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 signed 6-bit scales: low 4 bits from bytes 0-7 (lo nibbles, then hi), high 2 from 8-11."""
    n = s.shape[0]
    low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)  # [n, 16]
    high = (s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3  # [n, 4 shift, 4]
    return (low | high.reshape(n, 16) << 4).astype(np.float32) - 32


def _q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hbit = _bits(b, 0, 256).reshape(n, 32, 8).transpose(0, 2, 1)  # [n, bit, 32 bytes]: bit 4h + j of hmask[16g + l]
    q = _two_bit_groups(b[:, 32:96]).astype(np.float32) - 4 * (1 - hbit.reshape(n, 16, 16).astype(np.float32))
    a = _f16(b, 108) * _q3_k_scales(b[:, 96:108])  # [n, 16]
    return (a[:, :, None] * q).reshape(n, 256)


def k4_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> (sc, m) [n, 8] each, 6 bits: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    (sc) and 4-7 (m); 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-3 (sc) and 4-7 (m)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | (d >> 2 & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | (m >> 2 & 48)], axis=1)
    return sc, mn


def _k4(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: quants [n, 8, 32] -> (d sc) q - (dmin m)."""
    sc, mn = k4_scale_min(b[:, 4:16])
    a = _f16(b, 0) * sc.astype(np.float32)
    m = _f16(b, 2) * mn.astype(np.float32)
    return (a[:, :, None] * q.astype(np.float32) - m[:, :, None]).reshape(b.shape[0], 256)


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] -> [n, 8, 32]: sub-block 2p + i is nibble i (0 low, 1 high) of qs[32 p ..]."""
    n = qs.shape[0]
    return np.stack([qs.reshape(n, 4, 32) & 15, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, 8, 32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k4(b, _k4_nibbles(b[:, 16:144]))


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    high = _bits(b, 16, 256).reshape(n, 32, 8).transpose(0, 2, 1)  # [n, sub-block, l]: bit s of qh[l]
    return _k4(b, _k4_nibbles(b[:, 48:176]) | high << 4)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)  # [n, h, lo/hi, 64]
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # [n, h, c, 32]
    q = ((ql & 15).reshape(n, 8, 32) | (qh & 3).reshape(n, 8, 32) << 4).astype(np.float32) - 32
    a = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    return (a[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks -> their 8 sub-block scales [n, 8] int32: 4 bits of scales_l, 2 of scales_h, minus 32."""
    n = b.shape[0]
    low = np.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], axis=2).reshape(n, 8)
    high = (b[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
    return (low | high.astype(np.uint8) << 4).astype(np.int32) - 32


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    a = _f16(b, 0) * iq4_xs_scales(b).astype(np.float32)
    q = KVALUES[_nibbles(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)].astype(np.float32)
    return (a[:, :, None] * q).reshape(n, 256)


TYPES: dict[str, BlockType] = {
    t.name: t
    for t in (
        BlockType("F32", 0, 1, 4, (), _f32),
        BlockType("F16", 1, 1, 2, (0,), _f16_values),
        BlockType("BF16", 30, 1, 2, (), _bf16),
        BlockType("Q8_0", 8, 32, 34, (0,), _q8_0),
        BlockType("Q4_0", 2, 32, 18, (0,), _q4_0),
        BlockType("Q4_1", 3, 32, 20, (0, 2), _q4_1),
        BlockType("Q5_0", 6, 32, 22, (0,), _q5_0),
        BlockType("Q5_1", 7, 32, 24, (0, 2), _q5_1),
        BlockType("IQ4_NL", 20, 32, 18, (0,), _iq4_nl),
        BlockType("Q2_K", 10, 256, 84, (80, 82), _q2_k),
        BlockType("Q3_K", 11, 256, 110, (108,), _q3_k),
        BlockType("Q4_K", 12, 256, 144, (0, 2), _q4_k),
        BlockType("Q5_K", 13, 256, 176, (0, 2), _q5_k),
        BlockType("Q6_K", 14, 256, 210, (208,), _q6_k),
        BlockType("IQ4_XS", 23, 256, 136, (0,), _iq4_xs),
    )
}
BY_ID = {t.type_id: t for t in TYPES.values()}

# Every type ggml defines: id -> (name, weights per block, bytes per block) (gguf-py's GGML_QUANT_SIZES), so a file
# is read without importing gguf (which imports sentencepiece, and with it a second OpenMP runtime, where installed).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """A tensor's bytes (uint8 [..., row bytes]; F32 / F16 arrays may be given as floats) -> fp32 [..., K]."""
    t = TYPES[type_name]
    raw = np.ascontiguousarray(raw)
    lead = raw.shape[:-1]
    blocks = raw.view(np.uint8).reshape(-1, t.nbytes)
    return t.dequantize(blocks).reshape(*lead, -1)


def random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """``n_blocks`` valid blocks with random contents: random integer data, each fp16 scale ``scale`` times a
    random value in [-2, 2] (float types: random finite values of about ``scale``) -> uint8 [n_blocks, nbytes].
    Enough to prove a kernel exact: no quantizer involved."""
    t = TYPES[type_name]
    if t.name == "F32":
        return (rng.standard_normal(n_blocks) * scale).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if t.name == "BF16":
        w = (rng.standard_normal(n_blocks) * scale).astype(np.float32)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    out = rng.integers(0, 256, (n_blocks, t.nbytes), dtype=np.uint8)
    for at in t.halves:
        half = (rng.uniform(-2, 2, n_blocks) * scale).astype(np.float16)
        out[:, at : at + 2] = half.view(np.uint8).reshape(n_blocks, 2)
    return out
