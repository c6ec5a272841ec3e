"""Paged decode attention (models/kernels/paged_attention.c and its torch fallback) against float64 torch.

The kernel is built inside the ``kernel`` fixture, never at collection time, so deselected runs
(``-m "not model"``) do not invoke the compiler.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from models.kernels import build  # noqa: E402
from models.kernels import paged_attention as pa  # noqa: E402

from conftest import need_kernel  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def kernel():
    need_kernel(pa, "paged attention")
    return pa


def make_case(lens, H, KVH, D, block_size, head_major=False, seed=0, spare_blocks=5):
    """Random q and pools; each row's blocks scattered at random over the pool, table padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_row) + spare_blocks
    shape = (num_blocks, KVH, block_size, D) if head_major else (num_blocks, block_size, KVH, D)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if head_major:  # the kernel's logical shape is [blocks, block_size, KVH, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(per_row + [1])), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(per_row):
        tables[row, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(lens), H, D, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def reference(q, k, v, tables, lens, scale, window=0, softcap=0.0):
    """float64 softmax attention per row over its tokens (its last ``window``, when set; scores soft-capped when
    ``softcap`` is set), read through the block table one by one."""
    B, H, D = q.shape
    block_size, KVH = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        first = max(0, n - window) if window else 0
        at = torch.arange(first, n)
        blocks = tables[b, at // block_size].long()
        offsets = at % block_size
        keys = k[blocks, offsets].double()  # [n, KVH, D]
        values = v[blocks, offsets].double()
        qg = q[b].double().view(KVH, H // KVH, D)  # query head h = kv * G + g
        scores = torch.einsum("kgd,nkd->kgn", qg, keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.einsum("kgn,nkd->kgd", scores.softmax(-1), values).reshape(H, D)
    return out


def assert_matches(out, ref):
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=2e-5)


RAGGED = [1, 15, 16, 17, 33, 100, 700, 1100]  # single token, partial / exact blocks, several partitions


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("head_major", [False, True])
def test_kernel_matches_float64(kernel, group, block_size, head_major):
    KVH = 2
    seed = group * 100 + block_size
    q, k, v, tables, lens = make_case(RAGGED, KVH * group, KVH, 64, block_size, head_major, seed=seed)
    out = kernel.paged_attention(q, k, v, tables, lens, scale=0.125)
    assert out.shape == q.shape
    assert_matches(out, reference(q, k, v, tables, lens, 0.125))


@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (12, 12, 64), (18, 2, 32), (16, 1, 128), (4, 4, 8), (8, 2, 256)])
def test_kernel_head_shapes(kernel, H, KVH, D):
    """SmolLM2 and GPT-2 shapes, more query heads per KV head than one pass holds (G = 9, 16), and
    the head-size limits."""
    q, k, v, tables, lens = make_case([3, 40, 520], H, KVH, D, 16, seed=H + D)
    scale = D**-0.5
    assert_matches(kernel.paged_attention(q, k, v, tables, lens, scale), reference(q, k, v, tables, lens, scale))


def test_result_does_not_depend_on_thread_count(kernel):
    """Each (row, KV head, partition) is one thread's work and partitions are fixed by the context length,
    so results are bit-identical at any thread count."""
    q, k, v, tables, lens = make_case([5, 1300, 64, 513, 2], 12, 4, 64, 16, seed=7)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel.paged_attention(q, k, v, tables, lens, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_matches(outs[0], reference(q, k, v, tables, lens, 0.125))


def test_strided_queries_and_empty_rows(kernel):
    """q may be a view into a wider projection output (GPT-2's fused qkv); a row with no context gives zeros."""
    q, k, v, tables, lens = make_case([0, 20, 0, 600], 6, 3, 64, 16, seed=3)
    qkv = torch.randn(4, 3, 6, 64)
    qkv[:, 0] = q
    out = kernel.paged_attention(qkv[:, 0], k, v, tables, lens, 0.125)  # row stride 3 * H * D
    assert_matches(out, reference(q, k, v, tables, lens, 0.125))
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("head_major", [False, True])
def test_torch_fallback_matches_float64(head_major):
    q, k, v, tables, lens = make_case([0, *RAGGED], 12, 3, 64, 16, head_major, seed=11)
    out = pa.paged_attention_torch(q, k, v, tables, lens, 0.125)
    assert_matches(out, reference(q, k, v, tables, lens, 0.125))


def test_unsupported_shapes_use_the_fallback(kernel):
    """A head size the kernel does not take (D % 8 != 0) and fp64 tensors go through torch, same math."""
    q, k, v, tables, lens = make_case([7, 30], 4, 2, 12, 16, seed=5)
    assert not kernel.kernel_supports(q, k)
    assert_matches(kernel.paged_attention(q, k, v, tables, lens, 0.3), reference(q, k, v, tables, lens, 0.3))
    q64, k64, v64 = q.double(), k.double(), v.double()
    assert not kernel.kernel_supports(q64, k64)
    out = kernel.paged_attention(q64, k64, v64, tables, lens, 0.3)
    assert out.dtype == torch.float64
    assert_matches(out, reference(q, k, v, tables, lens, 0.3))


def test_mismatched_shapes_are_a_clear_error():
    q, k, v, tables, lens = make_case([4], 6, 3, 64, 16)
    with pytest.raises(ValueError, match="KV heads"):
        pa.paged_attention(q[:, :5], k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="differ"):
        pa.paged_attention(q, k, v[:-1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        pa.paged_attention(q, k, v, tables, lens.repeat(2), 1.0)


def release_before_windows(tables, lens, window, block_size):
    """Table entries of blocks wholly before each row's window set to -1 (a released block: a read of one would
    fault or read garbage)."""
    tables = tables.clone()
    for b, n in enumerate(lens.tolist()):
        tables[b, : max(0, n - window) // block_size] = -1
    return tables


@pytest.mark.parametrize("window", [1, 5, 16, 37, 600])
@pytest.mark.parametrize("block_size", [16, 5])
def test_sliding_window_reads_only_the_window(kernel, window, block_size):
    """A row attends its last ``window`` tokens: windows inside a block, on block boundaries, across partitions;
    every block before the window is released (-1 in the table) and never read."""
    q, k, v, tables, lens = make_case(RAGGED, 8, 2, 64, block_size, head_major=True, seed=window + block_size)
    tables = release_before_windows(tables, lens, window, block_size)
    out = kernel.paged_attention(q, k, v, tables, lens, 0.125, window=window)
    assert_matches(out, reference(q, k, v, tables.clamp(min=0), lens, 0.125, window))


@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
def test_soft_capped_scores(kernel, softcap):
    q, k, v, tables, lens = make_case(RAGGED, 8, 4, 32, 16, seed=int(softcap * 10))
    q = q * 4  # scores well past the cap
    out = kernel.paged_attention(q, k, v, tables, lens, 0.25, softcap=softcap)
    assert_matches(out, reference(q, k, v, tables, lens, 0.25, softcap=softcap))


def test_window_and_soft_cap_do_not_depend_on_thread_count(kernel):
    q, k, v, tables, lens = make_case([5, 1300, 64, 513, 2], 12, 4, 64, 16, seed=9)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel.paged_attention(q, k, v, tables, lens, 0.125, window=700, softcap=2.0))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert_matches(outs[0], reference(q, k, v, tables, lens, 0.125, 700, 2.0))


@pytest.mark.parametrize("window, softcap", [(7, 0.0), (0, 2.0), (40, 1.5)])
def test_torch_fallback_windows_and_soft_caps(window, softcap):
    q, k, v, tables, lens = make_case([0, *RAGGED], 12, 3, 64, 16, True, seed=13)
    tables = release_before_windows(tables, lens, window, 16) if window else tables
    out = pa.paged_attention_torch(q, k, v, tables, lens, 0.125, window, softcap)
    assert_matches(out, reference(q, k, v, tables.clamp(min=0), lens, 0.125, window, softcap))


def rope_reference(x, cos, sin):
    """HF's rotation of each head's first R dims (R = cos.shape[-1]), the rest passed through: x [B, h, D]."""
    R = cos.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat([rot * cos + torch.cat([-x2, x1], dim=-1) * sin, rest], dim=-1)


@pytest.mark.parametrize("rotary", [64, 32, 16])
@pytest.mark.parametrize("window", [0, 9])
def test_rope_write_attend_partial_rotary_and_window(kernel, rotary, window):
    """One decode step's fused call with a partial rotary (Phi-3: the first R of D dims rotate) and a window: the
    rotated k lands in its slot, the rest of the head is copied, and attention matches float64."""
    B, H, KVH, D, bs = 3, 4, 2, 64, 8
    gen = torch.Generator().manual_seed(rotary + window)
    lens = [1, 13, 30]
    q0, k, v, tables, lens_t = make_case(lens, H, KVH, D, bs, head_major=True, seed=rotary)
    pos = torch.tensor([n - 1 for n in lens])
    slot_blocks = tables[torch.arange(B), pos // bs].long()
    slot_offsets = pos % bs
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen)
    angles = torch.randn(64, rotary // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].contiguous()  # [P, 1, R]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].contiguous()
    out = kernel.rope_write_attend(
        qkv, H, (cos, sin), pos, k, v, slot_blocks, slot_offsets, tables, lens_t, 0.125, window, 0.0
    )
    c, s_ = cos[pos], sin[pos]  # [B, 1, R]
    q = rope_reference(qkv[:, : H * D].view(B, H, D), c, s_)
    new_k = rope_reference(qkv[:, H * D : (H + KVH) * D].view(B, KVH, D), c, s_)
    torch.testing.assert_close(k[slot_blocks, slot_offsets], new_k)
    torch.testing.assert_close(v[slot_blocks, slot_offsets], qkv[:, (H + KVH) * D :].view(B, KVH, D))
    assert_matches(out, reference(q, k, v, tables, lens_t, 0.125, window))


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
    q, k, v, tables, lens = make_case([9, 40], 6, 2, 64, 16, seed=2)
    assert_matches(pa.paged_attention(q, k, v, tables, lens, 0.125), reference(q, k, v, tables, lens, 0.125))


def test_no_compiler_falls_back_cleanly(fresh_loader, monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert pa.load() is None and "no C compiler" in pa.KERNEL.unavailable_reason
    q, k, v, tables, lens = make_case([3], 3, 3, 64, 16, seed=4)
    assert_matches(pa.paged_attention(q, k, v, tables, lens, 0.125), reference(q, k, v, tables, lens, 0.125))
