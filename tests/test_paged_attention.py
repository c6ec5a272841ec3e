"""Paged decode attention (models/kernels/paged_attention.c and its torch fallback) against float64 torch.

The kernel is built inside the ``kernel`` fixture, never at collection time, so deselected runs
(``-m "not model"``) do not invoke the compiler.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from models.kernels import build  # noqa: E402
from models.kernels import paged_attention as pa  # noqa: E402

from conftest import need_kernel, needs_avx512  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def kernel():
    need_kernel(pa, "paged attention")
    return pa


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]  # KV_CACHE_DTYPE fp32, fp16, bf16, int8


def make_case(lens, H, KVH, D, block_size, head_major=False, seed=0, spare_blocks=5, dtype=torch.float32):
    """Random q and pools (of ``dtype``: converted as the engine stores them); each row's blocks scattered at random
    over the pool, table padded with -1. -> q, k, v, tables, lens, scales (an int8 pool's (k_scale, v_scale), else
    None)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + spare_blocks
    shape = (num_blocks, KVH, block_size, D) if head_major else (num_blocks, block_size, KVH, D)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    (k, ks), (v, vs) = pa.to_pool_dtype(k, dtype), pa.to_pool_dtype(v, dtype)
    scales = (ks, vs) if ks is not None else None
    if head_major:  # the kernel's logical shape is [blocks, block_size, KVH, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        scales = (ks.transpose(1, 2), vs.transpose(1, 2)) if scales is not None else None
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(per_row + [1])), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(per_row):
        tables[row, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(lens), H, D, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), scales


def reference(q, k, v, tables, lens, scale, window=0, softcap=0.0, scales=None):
    """float64 softmax attention per row over its tokens (its last ``window``, when set; scores soft-capped when
    ``softcap`` is set; the pool's elements dequantized), read through the block table one by one."""
    B, H, D = q.shape
    block_size, KVH = k.shape[1], k.shape[2]
    k = pa.dequantize(k, scales[0] if scales else None, torch.float64)
    v = pa.dequantize(v, scales[1] if scales else None, torch.float64)
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        first = max(0, n - window) if window else 0
        at = torch.arange(first, n)
        blocks = tables[b, at // block_size].long()
        offsets = at % block_size
        keys = k[blocks, offsets]  # [n, KVH, D]
        values = v[blocks, offsets]
        qg = q[b].double().view(KVH, H // KVH, D)  # query head h = kv * G + g
        scores = torch.einsum("kgd,nkd->kgn", qg, keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.einsum("kgn,nkd->kgd", scores.softmax(-1), values).reshape(H, D)
    return out


def attend(kernel, case, scale, **kw):
    q, k, v, tables, lens, scales = case
    return kernel.paged_attention(q, k, v, tables, lens, scale, scales=scales, **kw)


def ref_of(case, scale):
    return reference(*case[:5], scale, scales=case[5])


def assert_matches(out, ref):
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


RAGGED = [1, 15, 16, 17, 33, 100, 700, 1100]  # single token, partial / exact blocks, several partitions


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_matches_float64(kernel, group, block_size, head_major):
    KVH = 2
    seed = group * 100 + block_size
    case = make_case(RAGGED, KVH * group, KVH, 64, block_size, head_major, seed=seed)
    out = attend(kernel, case, 0.125)
    assert out.shape == case[0].shape
    assert_matches(out, ref_of(case, 0.125))


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=["fp16", "bf16", "int8"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 5])
def test_each_dtype_matches_float64_over_its_elements(kernel, dtype, group, block_size):
    """fp16, bf16 and int8 pools read in place (the engine's head-major layout): ragged contexts, partial blocks,
    several partitions, GQA groups 1 / 3 / 4, against float64 attention over the same elements dequantized."""
    KVH = 2
    case = make_case(RAGGED, KVH * group, KVH, 64, block_size, True, seed=group * 10 + block_size, dtype=dtype)
    assert case[1].dtype == dtype
    assert_matches(attend(kernel, case, 0.125), ref_of(case, 0.125))


@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (12, 12, 64), (18, 2, 32), (16, 1, 128), (4, 4, 8), (8, 2, 256)])
def test_kernel_head_shapes(kernel, H, KVH, D):
    """SmolLM2 and GPT-2 shapes, more query heads per KV head than one pass holds (G = 9, 16), and
    the head-size limits."""
    for dtype in (torch.float32, torch.int8):
        case = make_case([3, 40, 520], H, KVH, D, 16, seed=H + D, dtype=dtype)
        assert_matches(attend(kernel, case, D**-0.5), ref_of(case, D**-0.5))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
def test_result_does_not_depend_on_thread_count(kernel, dtype):
    """Each (row, partition) is one thread's work and partitions are fixed by the context length, so results are
    bit-identical at any thread count, for every dtype."""
    case = make_case([5, 1300, 64, 513, 2], 12, 4, 64, 16, True, seed=7, dtype=dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(attend(kernel, case, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_matches(outs[0], ref_of(case, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_split_context_matches_the_unsplit_one(kernel, dtype):
    """Split-K (flash-decoding): one row's long context in partitions, each a partial softmax, merged in order,
    against the same context as one partition; a single row at 1.5k tokens (the batch-1 case it is for)."""
    case = make_case([1500], 9, 3, 64, 32, True, seed=21, dtype=dtype)
    whole = attend(kernel, case, 0.125, part_tokens=4096)
    for part in (32, 100, 512):  # 100: rounded up to whole blocks (128)
        torch.testing.assert_close(attend(kernel, case, 0.125, part_tokens=part), whole, rtol=1e-5, atol=1e-6)
    assert_matches(whole, ref_of(case, 0.125))


def test_strided_queries_and_empty_rows(kernel):
    """q may be a view into a wider projection output (GPT-2's fused qkv); a row with no context gives zeros."""
    q, k, v, tables, lens, _ = make_case([0, 20, 0, 600], 6, 3, 64, 16, seed=3)
    qkv = torch.randn(4, 3, 6, 64)
    qkv[:, 0] = q
    out = kernel.paged_attention(qkv[:, 0], k, v, tables, lens, 0.125)  # row stride 3 * H * D
    assert_matches(out, reference(q, k, v, tables, lens, 0.125))
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("head_major", [False, True])
def test_torch_fallback_matches_float64(head_major, dtype):
    case = make_case([0, *RAGGED], 12, 3, 64, 16, head_major, seed=11, dtype=dtype)
    assert_matches(pa.paged_attention_torch(*case[:5], 0.125, scales=case[5]), ref_of(case, 0.125))


def test_unsupported_shapes_use_the_fallback(kernel):
    """A head size the kernel does not take (D % 8 != 0) and fp64 tensors go through torch, same math."""
    q, k, v, tables, lens, _ = make_case([7, 30], 4, 2, 12, 16, seed=5)
    assert not kernel.kernel_supports(q, k)
    assert_matches(kernel.paged_attention(q, k, v, tables, lens, 0.3), reference(q, k, v, tables, lens, 0.3))
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert not kernel.kernel_supports(q64, k64)
    out = kernel.paged_attention(q64, k64, v64, tables, lens, 0.3)
    assert out.dtype == torch.float64
    assert_matches(out, reference(q, k, v, tables, lens, 0.3))


def test_mismatched_shapes_are_a_clear_error():
    q, k, v, tables, lens, _ = make_case([4], 6, 3, 64, 16)
    with pytest.raises(ValueError, match="KV heads"):
        pa.paged_attention(q[:, :5], k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="differ"):
        pa.paged_attention(q, k, v[:-1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        pa.paged_attention(q, k, v, tables, lens.repeat(2), 1.0)
    q, k, v, tables, lens, scales = make_case([4], 6, 3, 64, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="needs its scales"):
        pa.paged_attention(q, k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="scales must be float32"):
        pa.paged_attention(q, k, v, tables, lens, 1.0, scales=(scales[0].double(), scales[1]))


def release_before_windows(tables, lens, window, block_size):
    """Table entries of blocks wholly before each row's window set to -1 (a released block: a read of one would
    fault or read garbage)."""
    tables = tables.clone()
    for b, n in enumerate(lens.tolist()):
        tables[b, : max(0, n - window) // block_size] = -1
    return tables


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 600])
@pytest.mark.parametrize("block_size", [16, 5])
def test_sliding_window_reads_only_the_window(kernel, window, block_size, dtype):
    """A row attends its last ``window`` tokens: windows inside a block, on block boundaries, across partitions;
    every block before the window is released (-1 in the table) and never read (nor its int8 scales), every dtype."""
    seed = window + block_size
    q, k, v, tables, lens, scales = make_case(RAGGED, 8, 2, 64, block_size, head_major=True, seed=seed, dtype=dtype)
    tables = release_before_windows(tables, lens, window, block_size)
    out = kernel.paged_attention(q, k, v, tables, lens, 0.125, window=window, scales=scales)
    assert_matches(out, reference(q, k, v, tables.clamp(min=0), lens, 0.125, window, scales=scales))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
def test_soft_capped_scores(kernel, softcap, dtype):
    q, k, v, tables, lens, scales = make_case(RAGGED, 8, 4, 32, 16, seed=int(softcap * 10), dtype=dtype)
    q = q * 4  # scores well past the cap
    out = kernel.paged_attention(q, k, v, tables, lens, 0.25, softcap=softcap, scales=scales)
    assert_matches(out, reference(q, k, v, tables, lens, 0.25, softcap=softcap, scales=scales))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
def test_window_and_soft_cap_do_not_depend_on_thread_count(kernel, dtype):
    q, k, v, tables, lens, scales = make_case([5, 1300, 64, 513, 2], 12, 4, 64, 16, True, seed=9, dtype=dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel.paged_attention(q, k, v, tables, lens, 0.125, 700, 2.0, scales=scales))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_matches(outs[0], reference(q, k, v, tables, lens, 0.125, 700, 2.0, scales=scales))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("window, softcap", [(7, 0.0), (0, 2.0), (40, 1.5)])
def test_torch_fallback_windows_and_soft_caps(window, softcap, dtype):
    q, k, v, tables, lens, scales = make_case([0, *RAGGED], 12, 3, 64, 16, True, seed=13, dtype=dtype)
    tables = release_before_windows(tables, lens, window, 16) if window else tables
    out = pa.paged_attention_torch(q, k, v, tables, lens, 0.125, window, softcap, scales)
    assert_matches(out, reference(q, k, v, tables.clamp(min=0), lens, 0.125, window, softcap, scales))


def rope_reference(x, cos, sin):
    """HF's rotation of each head's first R dims (R = cos.shape[-1]), the rest passed through: x [B, h, D]."""
    R = cos.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("rotary", [64, 32, 16])
@pytest.mark.parametrize("window", [0, 9])
def test_rope_write_attend_partial_rotary_and_window(kernel, rotary, window, dtype):
    """One decode step's fused call with a partial rotary (Phi-3: the first R of D dims rotate) and a window: the
    rotated k lands in its slot (as the pool's dtype stores it), the rest of the head is copied, and attention
    matches float64."""
    B, H, KVH, D, bs = 3, 4, 2, 64, 8
    gen = torch.Generator().manual_seed(rotary + window)
    lens = [1, 13, 30]
    q0, k, v, tables, lens_t, scales = make_case(lens, H, KVH, D, bs, head_major=True, seed=rotary, dtype=dtype)
    pos = torch.tensor([n - 1 for n in lens])
    slot_blocks = tables[torch.arange(B), pos // bs].long()
    slot_offsets = pos % bs
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen)
    angles = torch.randn(64, rotary // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].contiguous()  # [P, 1, R]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].contiguous()
    out = kernel.rope_write_attend(
        qkv, H, (cos, sin), pos, k, v, slot_blocks, slot_offsets, tables, lens_t, 0.125, window, 0.0, scales
    )
    c, s_ = cos[pos], sin[pos]  # [B, 1, R]
    q = rope_reference(qkv[:, : H * D].view(B, H, D), c, s_)
    new_k = rope_reference(qkv[:, H * D : (H + KVH) * D].view(B, KVH, D), c, s_)
    (kq, kscale), (vq, vscale) = (
        pa.to_pool_dtype(new_k, dtype),
        pa.to_pool_dtype(qkv[:, (H + KVH) * D :].view(B, KVH, D), dtype),
    )
    torch.testing.assert_close(k[slot_blocks, slot_offsets], kq, rtol=1e-6, atol=0 if dtype == torch.int8 else 1e-6)
    torch.testing.assert_close(v[slot_blocks, slot_offsets], vq)
    if scales is not None:
        torch.testing.assert_close(scales[0][slot_blocks, slot_offsets], kscale)
        torch.testing.assert_close(scales[1][slot_blocks, slot_offsets], vscale)
    assert_matches(out, reference(q, k, v, tables, lens_t, 0.125, window, scales=scales))


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as if never loaded, building into an empty cache dir (restored afterwards)."""
    monkeypatch.setattr(pa, "KERNEL", pa.KernelLoader(pa.KERNEL.what, pa._load, pa.KERNEL.instead, pa.log))
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_failed_build_falls_back_cleanly(fresh_loader, monkeypatch):
    broken = fresh_loader / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(pa, "SOURCE", str(broken))
    assert pa.load() is None and "failed" in pa.KERNEL.unavailable_reason
    assert not list((fresh_loader / "cache").glob("**/*.so"))  # no half-written library left behind
    q, k, v, tables, lens, _ = make_case([9, 40], 6, 2, 64, 16, seed=2)
    assert_matches(pa.paged_attention(q, k, v, tables, lens, 0.125), reference(q, k, v, tables, lens, 0.125))


def test_no_compiler_falls_back_cleanly(fresh_loader, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert pa.load() is None and "no C compiler" in pa.KERNEL.unavailable_reason
    q, k, v, tables, lens, _ = make_case([3], 3, 3, 64, 16, seed=4)
    assert_matches(pa.paged_attention(q, k, v, tables, lens, 0.125), reference(q, k, v, tables, lens, 0.125))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
def test_the_kernel_stores_what_torch_converts(kernel, dtype):
    """The compiled conversion (store_row: rope_write_attend's and decode_step.c's K/V writes) stores the bits of the
    torch conversion (kv_cache.py's writes): round to nearest even, int8's scale per token and head; rows of zeros,
    ties and fp16's overflow included."""
    N, H, KVH, D, bs = 7, 3, 3, 64, 4
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(N, KVH, D, generator=gen) * 3, torch.randn(N, KVH, D, generator=gen)
    k[0, 1] = 0.0  # a zero row: scale 0
    k[1, 0, :4] = torch.tensor([70000.0, -1e6, 0.5 + 2**-12, 1 + 2**-8])  # fp16 overflow, fp16 and bf16 ties
    v[2, 2] = torch.linspace(-127, 127, D) / 127 * 2.5  # exact halves in int8
    qkv = torch.cat([torch.randn(N, H * D, generator=gen), k.reshape(N, -1), v.reshape(N, -1)], dim=1)
    num_blocks = 3
    k_pool = torch.zeros(num_blocks, KVH, bs, D, dtype=dtype).transpose(1, 2)  # head-major, as the engine's
    v_pool = torch.zeros_like(k_pool)
    scales = None
    if dtype == torch.int8:
        scales = tuple(torch.zeros(num_blocks, KVH, bs).transpose(1, 2) for _ in range(2))
    blocks, offsets = torch.tensor([2, 0, 1, 0, 2, 1, 0]), torch.tensor([1, 3, 0, 0, 2, 3, 1])
    tables = torch.tensor([[b] for b in blocks.tolist()], dtype=torch.int32)
    lens = (offsets + 1).to(torch.int32)
    kernel.rope_write_attend(
        qkv,
        H,
        None,
        torch.zeros(N, dtype=torch.long),
        k_pool,
        v_pool,
        blocks,
        offsets,
        tables,
        lens,
        0.125,
        scales=scales,
    )  # no rotation: k and v stored as given
    (kq, kscale), (vq, vscale) = pa.to_pool_dtype(k, dtype), pa.to_pool_dtype(v, dtype)
    assert torch.equal(k_pool[blocks, offsets].view(torch.uint8), kq.view(torch.uint8))
    assert torch.equal(v_pool[blocks, offsets].view(torch.uint8), vq.view(torch.uint8))
    if scales is not None:
        assert torch.equal(scales[0][blocks, offsets], kscale) and torch.equal(scales[1][blocks, offsets], vscale)
        assert kscale[0, 1] == 0 and torch.count_nonzero(kq[0, 1]) == 0
        err = (pa.dequantize(kq, kscale) - k).abs().amax(-1)
        assert torch.all(err <= kscale / 2 * (1 + 1e-6))  # q8_0's bound: half a step


# Head shapes for the ISA comparison: GQA groups 1, 3, 4, 6, 8 and 9 (two passes of GMAX), head sizes with D % 16 == 8
SHAPES = [(9, 3, 64, 32), (12, 12, 64, 16), (12, 3, 128, 5), (12, 2, 24, 16), (16, 2, 40, 7), (18, 2, 64, 32)]


@needs_avx512
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16", "int8"])
def test_avx512_gives_the_avx2_bits(kernel, kernel_isa, dtype):
    """KERNEL_ISA=auto (AVX-512 here) and avx2 give the same bits for every dtype, head shape and ragged context
    (tails of every tile size, partitions), with and without a sliding window and a soft-cap, at 1 and 3 threads;
    both match float64."""
    lens = [1, 3, 4, 5, 8, 9, 17, 33, 100, 600]
    before = torch.get_num_threads()
    try:
        for i, (H, KVH, D, bs) in enumerate(SHAPES):
            case = make_case(lens, H, KVH, D, bs, True, seed=40 + i, dtype=dtype)
            window, softcap = (0, 0.0) if i % 2 else (11 + 7 * i, 1.5)  # a window that starts inside a block
            outs = []
            for choice, threads in (("avx2", 1), ("auto", 1), ("auto", 3)):
                kernel_isa(choice)
                torch.set_num_threads(threads)
                assert (build.kernel_isa() == "avx512") == (choice == "auto")
                outs.append(attend(kernel, case, D**-0.5, window=window, softcap=softcap))
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (H, KVH, D, bs)
            assert_matches(outs[1], reference(*case[:5], D**-0.5, window, softcap, case[5]))
    finally:
        torch.set_num_threads(before)
