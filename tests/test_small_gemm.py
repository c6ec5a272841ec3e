"""The small-batch GEMM kernel (models/kernels/small_gemm.c) against float64 torch, and the Linear using it.

Nothing here imports torch or runs the compiler while pytest collects (``-m "not model"`` stays
torch-free): the kernel is built by the ``small_gemm`` fixture when a test first needs it.
"""

from __future__ import annotations

import sys

import pytest

from conftest import need_kernel

pytestmark = pytest.mark.model

MAX_ROWS = 16  # models.kernels.small_gemm.MAX_ROWS, checked by test_max_rows_constant


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def small_gemm(torch):
    from models.kernels import small_gemm

    need_kernel(small_gemm, "small_gemm")
    return small_gemm


def test_max_rows_constant(small_gemm):
    assert small_gemm.MAX_ROWS == MAX_ROWS


def reference(x, w, bias=None, residual=None):
    """float64 torch."""
    out = x.double() @ w.double().t()
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.double()
    return out.float()


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(1, 1), (8, 5), (13, 7), (50, 64), (200, 33)])
@pytest.mark.parametrize("with_bias, with_residual", [(False, False), (True, False), (True, True), (False, True)])
def test_matches_torch(torch, small_gemm, m, n, k, with_bias, with_residual):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    residual = torch.randn(m, n, generator=gen) if with_residual else None
    out = small_gemm.matmul(x, small_gemm.pack(w), n, bias, residual)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, reference(x, w, bias, residual), rtol=1e-5, atol=1e-5 * k)


def test_packed_layout_holds_each_output_column_in_its_panel(torch, small_gemm):
    w = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)  # 10 outputs -> 2 panels, the second padded
    packed = small_gemm.pack(w)
    assert packed.shape == (2, 3, small_gemm.PANEL)
    assert torch.equal(packed[1, :, 1], w[9]) and torch.equal(packed[0, :, 0], w[0])
    assert torch.count_nonzero(packed[1, :, 2:]) == 0


def test_strided_rows_and_residual_views(torch, small_gemm):
    """x and residual may be row views of wider tensors (ldx, ldr > K, N)."""
    wide_x, wide_r = torch.randn(5, 40), torch.randn(5, 30)
    x, residual, w = wide_x[:, 3:35], wide_r[:, :24], torch.randn(24, 32)
    out = small_gemm.matmul(x, small_gemm.pack(w), 24, None, residual)
    torch.testing.assert_close(out, reference(x, w, None, residual), rtol=1e-5, atol=1e-4)


def test_result_does_not_depend_on_thread_count(torch, small_gemm):
    """Threads split output columns; each sum runs in one order, so results are bit-identical."""
    x, w = torch.randn(8, 300), torch.randn(1000, 300)
    packed, before = small_gemm.pack(w), torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(small_gemm.matmul(x, packed, 1000))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


KC = 3072  # small_gemm.c's K slice of the large-M path (panel_gemm); X is packed 2 KC of K at a time past that


@pytest.mark.parametrize("m", [17, 18, 23, 64, 131])
@pytest.mark.parametrize("n, k", [(1, 1), (13, 7), (40, 300), (77, KC + 5), (21, 2 * KC + 100)])
@pytest.mark.parametrize("with_bias, with_residual", [(False, False), (True, True), (False, True)])
def test_large_rows_match_torch_and_the_small_kernel(torch, small_gemm, m, n, k, with_bias, with_residual):
    """Above MAX_ROWS rows ``matmul`` takes panel_gemm (6-row tiles over pairs of panels, K in KC slices): ragged
    rows, widths not a multiple of 8 (a lone last panel at 13, 21 and 77), K within a slice, past one, and past
    a packed block of X (2 KC). Each output is the small kernel's FMA chain, so 16-row calls of the small kernel
    give the same bits."""
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    residual = torch.randn(m, n, generator=gen) if with_residual else None
    packed = small_gemm.pack(w)
    out = small_gemm.matmul(x, packed, n, bias, residual)
    torch.testing.assert_close(out, reference(x, w, bias, residual), rtol=1e-5, atol=1e-5 * k)
    step = small_gemm.MAX_ROWS
    small = [
        small_gemm.matmul(x[i : i + step], packed, n, bias, None if residual is None else residual[i : i + step])
        for i in range(0, m, step)
    ]
    assert torch.equal(out, torch.cat(small))


@pytest.mark.parametrize("m, k", [(600, 300), (517, 1030)])
def test_large_rows_over_several_row_blocks_at_any_thread_count(torch, small_gemm, m, k):
    """More rows than one packed block of X holds (M x K past 128 K floats): X is packed block by block; the
    threads split pairs of panels, so 1, 2 and 3 threads give the same bits (and torch's float64 values)."""
    gen = torch.Generator().manual_seed(m + k)
    x, w, bias = torch.randn(m, k, generator=gen), torch.randn(203, k, generator=gen), torch.randn(203, generator=gen)
    residual = torch.randn(m, 203, generator=gen)
    packed, before = small_gemm.pack(w), torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(small_gemm.matmul(x, packed, 203, bias, residual))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], reference(x, w, bias, residual), rtol=1e-5, atol=1e-5 * k)


def test_large_rows_from_row_views(torch, small_gemm):
    """x and residual as row views of wider tensors (ldx, ldr > K, N) on the large-M path too."""
    wide_x, wide_r = torch.randn(40, 300), torch.randn(40, 60)
    x, residual, w = wide_x[:, 5:266], wide_r[:, 3:53], torch.randn(50, 261)
    out = small_gemm.matmul(x, small_gemm.pack(w), 50, None, residual)
    torch.testing.assert_close(out, reference(x, w, None, residual), rtol=1e-5, atol=1e-4)


def test_rows_read_back_out_of_the_panels(torch, small_gemm):
    """A tied lm_head's panels serve the token embedding: rows(pack(W), ids) is W[ids], any id, repeats included."""
    w = torch.randn(21, 10)  # 3 panels, the last padded
    ids = torch.tensor([0, 7, 8, 20, 20, 13])
    assert torch.equal(small_gemm.rows(small_gemm.pack(w), ids), w[ids])


@pytest.mark.parametrize("n, k", [(1003, 33), (1000, 64), (7, 5), (24, 768)])
def test_pack_in_chunks_releases_every_copied_row_once(torch, small_gemm, monkeypatch, n, k):
    """A weight of two chunks or more is packed chunk by chunk, each chunk of full-panel rows handed to
    ``release`` once copied (a checkpoint table's pages leave RSS as its panels fill), then the whole weight once;
    smaller ones in one copy, never released; the panels are the same either way (and the same as a padded [N, K]
    transposed)."""
    monkeypatch.setattr(small_gemm, "RELEASE_CHUNK_BYTES", 4096)
    w = torch.randn(n, k)
    released = []
    packed = small_gemm.pack(w, release=lambda rows: released.append((rows.data_ptr(), len(rows))))
    padded = torch.cat([w, torch.zeros(-n % 8, k)])
    assert torch.equal(packed, padded.view(-1, 8, k).transpose(1, 2)) and torch.equal(packed, small_gemm.pack(w))
    if n * k * 4 < 2 * 4096:
        assert released == []
    else:
        assert released[-1] == (w.data_ptr(), n)  # last, the whole weight
        released = released[:-1]
        assert len(released) > 1 and sum(count for _, count in released) == n // 8 * 8
        starts = [(ptr - w.data_ptr()) // (4 * k) for ptr, _ in released]  # each chunk follows the one before
        assert starts == [sum(count for _, count in released[:i]) for i in range(len(released))]


def test_an_fp32_linear_holds_one_copy(torch, small_gemm):
    """The panels are the only fp32 copy (no oneDNN reorder beside them); nbytes counts exactly them."""
    from models.layers import Linear, linear_factory

    make, onednn, small = linear_factory(torch.device("cpu"), 8, want_small=True)
    assert small and not onednn
    w = torch.randn(21, 10)
    lin = make(w, None)
    assert lin.weight is None and lin.quant is None and lin.small is not None
    assert lin.nbytes == lin.streamed_bytes == 3 * 8 * 10 * 4  # 21 outputs in 3 panels of 8
    held = [t for t in vars(lin).values() if isinstance(t, torch.Tensor) and t.numel() >= w.numel()]
    assert len(held) == 1 and held[0].untyped_storage().nbytes() == lin.nbytes
    tied = make(w, None, table=True)
    assert tied.table() is tied.small
    plain = Linear(w, None, onednn=True, batch_hint=8, small=False, table=True)  # no kernel: F.linear on W itself
    assert not plain.onednn and plain.table() is w and plain.nbytes == w.numel() * 4


def test_shape_mismatch_is_a_clear_error(torch, small_gemm):
    with pytest.raises(ValueError, match="does not match packed weights"):
        small_gemm.matmul(torch.randn(2, 5), small_gemm.pack(torch.randn(8, 6)), 8)
    with pytest.raises(ValueError, match="does not match packed weights"):
        small_gemm.matmul(torch.randn(2, 6), small_gemm.pack(torch.randn(8, 6)), 9)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_shares_torchs_openmp_runtime(torch, small_gemm):
    """Two OpenMP runtimes would each spin a thread team on the same cores."""
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(mapped) == 1, mapped


@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 1, 64])
def test_linear_gives_the_same_answer_on_either_kernel(torch, small_gemm, rows):
    from models.layers import Linear

    w, b = torch.randn(96, 48), torch.randn(96)
    x, residual = torch.randn(rows, 48), torch.randn(rows, 96)
    small = Linear(w, b, onednn=False, batch_hint=8, small=True)
    onednn = Linear(w, b, onednn=True, batch_hint=8, small=False)
    assert small.weight is None and onednn.small is None  # each holds one copy
    torch.testing.assert_close(small(x), onednn(x), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(small.gelu(x, "tanh"), onednn.gelu(x, "tanh"), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(small.add(x, residual), onednn.add(x, residual), rtol=1e-5, atol=1e-4)


def test_factory_falls_back_to_onednn_when_off_or_unavailable(torch, small_gemm, monkeypatch):
    from models.layers import linear_factory

    cpu = torch.device("cpu")
    make, onednn, small = linear_factory(cpu, 8, want_small=False)
    assert onednn and not small and make(torch.randn(16, 8), None).small is None
    monkeypatch.setattr(small_gemm, "load", lambda: None)
    _, _, small = linear_factory(cpu, 8, want_small=True)
    assert not small


def test_missing_compiler_is_reported(small_gemm, monkeypatch, tmp_path):
    from models.kernels import build

    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        small_gemm._load()


def test_builds_into_an_empty_cache_and_loads(small_gemm, monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    lib = small_gemm._load()
    built = list((tmp_path / "kernels").glob("small_gemm-*.so"))
    assert len(built) == 1 and hasattr(lib, "small_gemm")


def test_compiler_error_is_reported(small_gemm, monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="failed"):
        small_gemm._load()
    assert not list(tmp_path.rglob("*.so"))  # no half-built file left behind


def test_cache_dir_convention(monkeypatch, tmp_path):
    """One cache root for kernels and checkpoints: MINIBATCH_CACHE, else XDG_CACHE_HOME/minibatch-llm."""
    from models.cache_dir import cache_root

    monkeypatch.delenv("MINIBATCH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "minibatch-llm")
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "mine"))
    assert cache_root() == str(tmp_path / "mine")


@pytest.mark.parametrize("use_small_gemm", [True, False], ids=["panels", "onednn"])
def test_a_tied_model_holds_every_fp32_weight_once(torch, tiny_model_dir, use_small_gemm):
    """GPT-2 with its tied embedding: every linear holds one copy (the panels, or oneDNN's where the kernels are
    off), the token table is the lm_head's copy (rows read out of it equal HF's), and ``resident_weights`` counts
    exactly those copies plus the position table."""
    from transformers import AutoModelForCausalLM

    from models.gpt2 import GPT2
    from models.layers import embed_rows

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    table = hf.transformer.wte.weight.detach().clone()  # [V, C]
    model = GPT2(hf, 2, 64, torch.device("cpu"), use_small_gemm=use_small_gemm)
    assert model.wte is model.lm_head.table()
    for lin in model.linears():
        copies = [c for c in (lin.small, lin.weight, lin.quant) if c is not None]
        assert len(copies) == 1 and (lin.small is not None) == use_small_gemm
    ids = torch.tensor([0, 1, 7, 8, table.shape[0] - 1, 3, 3])
    assert torch.equal(embed_rows(model.wte, ids), table[ids])
    linear_bytes = sum(lin.nbytes for lin in model.linears())
    assert model.resident_weights() == {"fp32": linear_bytes + model.wpe.nbytes}
