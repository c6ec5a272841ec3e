"""Packed Q4_K and Q6_K weights (models/kernels/int_packed.c, kernels/packing.py): rows repacked at load into panels
of 32 columns for the integer path.

The packed kernel against the unpacked one (int_dot.c's row and panel paths, themselves checked against a float64
evaluation in tests/test_int_dot.py) bit for bit, and against that float64 reference too: every ISA the CPU has
(one it lacks is reported, never silently skipped), 1-13 rows, 1-3 threads, bias and residual, several panels
split unevenly over the threads. The packing rearranges values and changes none; shapes it cannot take are refused. A
whole model packed at load steps to the same logits, bit for bit, as the same image unpacked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_int_dot import check, isa, random_weight, reference  # noqa: F401  (isa: the fixture)

from models.kernels import int_dot, packing

from conftest import need_kernel

Q4_K, Q6_K = int_dot.FORMATS["Q4_K"], int_dot.FORMATS["Q6_K"]


@pytest.fixture(autouse=True)
def _kernel():
    need_kernel(int_dot, "integer-dot")


SHAPES = [(32, 256), (96, 768), (544, 512)]  # (N, K): one panel; three; 17 (odd splits over 2 and 3 threads)


@pytest.mark.parametrize("fmt", int_dot.PACKABLE)
@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_is_the_unpacked_bits_and_the_float64_reference(isa, fmt, n, k):  # noqa: F811  (isa: the fixture)
    w, q, d, m = random_weight(fmt, n, k, seed=n + k)
    p = int_dot.pack(w, threads=2)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 4, 5, 8, 13):
        x = torch.randn(rows, k, generator=gen)
        residual = torch.randn(rows, n, generator=gen)
        y, scale = reference(x, q, d, m, bias, residual)
        for threads in (1, 2, 3):
            want = int_dot.gemm(x, w, bias, residual, threads=threads)
            got = int_dot.gemm_packed(x, p, fmt, n, bias, residual, threads=threads)
            assert torch.equal(got, want), (isa, fmt, n, k, rows, threads)
        check(got, y, scale)
        assert torch.equal(int_dot.gemm_packed(x, p, fmt, n), int_dot.gemm(x, w)), "no bias, no residual"


def test_packing_moves_bytes_and_refuses_what_it_cannot_take():
    lib = int_dot.load()
    w, *_ = random_weight("Q4_K", 32, 512, seed=3)
    src = w.data.numpy().reshape(-1)
    p = int_dot.pack(w)
    assert p.nbytes == src.nbytes and not np.array_equal(p, src)
    # the same nibbles, rearranged: each value's count among the 4-bit weights and the header bytes is unchanged
    nibbles = lambda b: np.bincount(np.concatenate([b & 15, b >> 4]), minlength=16)  # noqa: E731
    quants, header = src.reshape(32, 2, 144)[:, :, 16:], src.reshape(32, 2, 144)[:, :, :16]
    packed_sb = p.reshape(2, 4608)  # one panel, its two super-blocks
    assert np.array_equal(nibbles(packed_sb[:, 512:].ravel()), nibbles(quants.ravel()))
    assert np.array_equal(np.sort(packed_sb[:, :512].ravel()), np.sort(header.ravel()))
    # panel 0, super-block 0: d of column c at 2 c; the first quad's byte 4 c + j: column c's weight j | c + 16's
    block = src.reshape(32, 2, 144)[:, 0]  # [column, block bytes] of super-block 0
    assert np.array_equal(p[:64].reshape(32, 2), block[:, :2])
    low = block[:, 16:20] & 15  # [column, k 0-3]: sub-block 0's first 4 weights (low nibbles of qs[0..3])
    assert np.array_equal(p[512:576].reshape(16, 4), low[:16] | low[16:] << 4)
    assert lib.int_dot_packable(Q4_K, 32, 512) == lib.int_dot_packable(Q6_K, 32, 512) == 1
    for fmt, n, k in [
        (Q4_K, 48, 512),
        (Q4_K, 32, 384),
        (Q4_K, 0, 256),
        (Q6_K, 32, 300),
        (int_dot.FORMATS["Q8_0"], 32, 512),
    ]:
        assert lib.int_dot_packable(fmt, n, k) == 0
        assert lib.int_dot_pack(fmt, src.ctypes.data, p.ctypes.data, n, k, 1) == -1


def test_q6_k_packing_keeps_every_field():
    """A Q6_K panel: d of column c at 2 c, scale s at 64 + 32 s + c, then per group 8 quads of low nibbles (column c
    low, c + 16 high) and 4 pairs of high fields (bits 2 t + 4 j: column c's, then c + 16's, of quad 2 j + t)."""
    w, *_ = random_weight("Q6_K", 32, 512, seed=5)
    src = w.data.numpy().reshape(32, 2, 210)  # [column, super-block, block bytes]
    p = int_dot.pack(w).reshape(2, 6720)
    assert p.nbytes == src.nbytes
    for b in range(2):
        blk = src[:, b]
        assert np.array_equal(p[b, :64].reshape(32, 2), blk[:, 208:210])
        assert np.array_equal(p[b, 64:576].reshape(16, 32), blk[:, 192:208].T)
        # weight k of column c as quants/q6_k.h reads it: half h, quarter c4, element l
        k = np.arange(256)
        h, c4, el = k // 128, k % 128 // 32, k % 32
        low = np.where(c4 < 2, blk[:, 64 * h + 32 * (c4 % 2) + el] & 15, blk[:, 64 * h + 32 * (c4 % 2) + el] >> 4)
        high = blk[:, 128 + 32 * h + el] >> (2 * c4) & 3  # [column, k]
        groups = p[b, 576:].reshape(8, 768)
        quads = groups[:, :512].reshape(8, 8, 16, 4)  # [group, quad, column c < 16, k % 4]
        pairs = groups[:, 512:].reshape(8, 4, 16, 4)  # [group, pair, column, k % 4]
        k_of = lambda g, q, j: 32 * g + 4 * q + j  # noqa: E731
        for g, q, c, j in [(0, 0, 0, 0), (3, 5, 7, 2), (7, 7, 15, 3), (5, 2, 9, 1)]:
            kk = k_of(g, q, j)
            assert quads[g, q, c, j] == low[c, kk] | low[c + 16, kk] << 4
            field = pairs[g, q // 2, c, j] >> 4 * (q % 2) & 15
            assert field == high[c, kk] | high[c + 16, kk] << 2


@pytest.mark.parametrize("fmt", int_dot.PACKABLE)
def test_a_packed_row_reads_back_as_the_file_row(fmt):
    """int_dot_unpack_row (a packed tied lm_head's token lookup) gives every row's blocks exactly as the file holds
    them; a type or width that cannot be packed is refused."""
    lib = int_dot.load()
    n, k = 64, 768
    w, *_ = random_weight(fmt, n, k, seed=11)
    src = w.data.numpy().reshape(n, -1)
    p = int_dot.pack(w)
    row = np.empty(src.shape[1], np.uint8)
    for r in range(n):
        assert lib.int_dot_unpack_row(int_dot.FORMATS[fmt], p.ctypes.data, k, r, row.ctypes.data) == 0
        assert np.array_equal(row, src[r]), r
    assert lib.int_dot_unpack_row(int_dot.FORMATS["Q8_0"], p.ctypes.data, k, 0, row.ctypes.data) == -1
    assert lib.int_dot_unpack_row(int_dot.FORMATS[fmt], p.ctypes.data, 300, 0, row.ctypes.data) == -1


def test_when_models_are_packed():
    """PACK_WEIGHTS=auto packs where the integer path runs AVX-512 VNNI, each type it takes int8 from one row; off
    never."""
    lib = int_dot.load()
    best = int_dot.force_isa("avx512vnni")
    try:
        int_dot.set_activations("int8")
        assert packing.wanted(lib) == (("Q4_K", "Q6_K") if best == "avx512vnni" else ())
        int_dot.set_activations("auto")
        saved = dict(int_dot.AUTO_ROWS["vnni"])
        int_dot.AUTO_ROWS["vnni"].update(Q4_K=1, Q6_K=4)  # a type auto takes from 4 rows only is not packed
        try:
            assert packing.wanted(lib) == (("Q4_K",) if best == "avx512vnni" else ())
        finally:
            int_dot.AUTO_ROWS["vnni"].update(saved)
        int_dot.set_activations("int8")
        int_dot.force_isa("avx2")
        assert not packing.wanted(lib)
        int_dot.force_isa("avx512vnni")
        int_dot.set_activations("fp32")
        assert not packing.wanted(lib)
        int_dot.set_activations("int8")
        packing.set_packing("off")
        assert not packing.wanted(lib)
        with pytest.raises(ValueError, match="PACK_WEIGHTS"):
            packing.set_packing("always")
    finally:
        packing.set_packing("auto")
        int_dot.set_activations("auto")
        int_dot.force_isa("avx512vnni")


@pytest.mark.model
@pytest.mark.parametrize("fmt,tied", [("Q4_K", False), ("Q6_K", True)])
def test_a_packed_model_steps_to_the_unpacked_bits(tmp_path, fmt, tied, monkeypatch):
    """A Llama GGUF whose matrices are all of a packable type, served packed and unpacked under ACTIVATIONS=int8: a
    40-row prompt (the panel path unpacked) and 2 decode rows (the row path) give the same logits bit for bit, at 1
    and 3 threads. Tied: the packed lm_head is the token table too, its rows read back from the panels. Parts are
    packed a panel at a time (a small CHUNK_BYTES: many chunks, as a big file's parts)."""
    from gguf_files import write_gguf

    from models import image
    from models.native import NativeModel
    from scripts.make_test_model import build_checkpoint

    hf = build_checkpoint(
        str(tmp_path / "hf"),
        arch="llama",
        seed=7,
        tied=tied,
        overrides={"hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024},
    )
    path = write_gguf(hf, str(tmp_path / "w.gguf"), lambda name, shape: fmt)
    image.write_image(path, "auto", str(tmp_path / "image"))
    prompt, table = list(range(5, 45)), list(range(12))

    def run(model, threads: int) -> np.ndarray:
        model.threads = threads
        model.kv.k[...] = 0
        model.kv.v[...] = 0
        first = model.forward_rows([], [], [], [prompt], [table], [0], [True])
        step = model.forward_rows([7, 9], [40, 3], [table, [12]])
        return np.concatenate([first, step])

    monkeypatch.setattr(packing, "CHUNK_BYTES", 1)  # one panel a chunk
    int_dot.set_activations("int8")
    try:
        plain = NativeModel(str(tmp_path / "image"), 64, 4, threads=2, pack=False)
        packed_model = NativeModel(str(tmp_path / "image"), 64, 4, threads=2, pack=True)
        assert plain.packed_bytes == 0 and packed_model.packed_bytes > 0
        n_layer = plain.meta["kv"]["n_layer"]
        assert len(packed_model.packed_buffers) >= 4 * n_layer + 1  # every layer's q/k/v/o, gate/up, down, lm_head
        type_id = int_dot.FORMATS[fmt]
        assert plain.structs.model.embed_fmt == type_id
        assert packed_model.structs.model.embed_fmt == (type_id | int_dot.PACKED if tied else type_id)
        for threads in (1, 3):
            assert np.array_equal(run(packed_model, threads), run(plain, threads)), threads
    finally:
        int_dot.set_activations("auto")
