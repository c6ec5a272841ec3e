"""The quantized-weight GEMM (models/kernels/quant_gemm.c): packing, kernels against float64, determinism."""

from __future__ import annotations

import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from models.kernels import build  # noqa: E402
from models.kernels import quant_gemm as qg  # noqa: E402

from conftest import need_kernel, needs_avx512  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    """Builds the kernel on first use (never at collection); skips the kernel tests where it cannot build."""
    return need_kernel(qg, "quantized GEMM")


def random_weight(fmt: str, n: int, k: int, seed: int) -> qg.QuantWeight:
    """Random q and fp16 scales (and mins) of every group, partial groups included."""
    gen = torch.Generator().manual_seed(seed)
    g = -(-k // qg.GROUP)
    d = (torch.rand(n, g, generator=gen) * 0.05 + 0.001).half()
    if fmt == "int8":
        return qg.pack("int8", torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), d)
    m = (torch.randn(n, g, generator=gen) * 0.3).half()
    return qg.pack("int4", torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), d, m)


def reference(x, w: qg.QuantWeight, bias=None, residual=None):
    out = x.double() @ qg.dequantize(w).double().t()
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.double()
    return out


def check_close(out, ref, k):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-6 * k)


def with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


FORMATS = ["int8", "int4"]
SHAPES = [(1, 1), (8, 32), (13, 7), (17, 100), (50, 64), (200, 33), (9, 65)]  # (n, k): ragged n, partial groups


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("n, k", SHAPES)
def test_matches_float64_on_dequantized_weights(kernel, fmt, m, n, k):
    w = random_weight(fmt, n, k, seed=m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    check_close(qg.matmul(x, w), reference(x, w), k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("with_bias, with_residual", [(True, False), (False, True), (True, True)])
def test_bias_and_residual_epilogues(kernel, fmt, m, with_bias, with_residual):
    n, k = 29, 71
    gen = torch.Generator().manual_seed(m)
    w, x = random_weight(fmt, n, k, seed=m), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    residual = torch.randn(m, n, generator=gen) if with_residual else None
    check_close(qg.matmul(x, w, bias, residual), reference(x, w, bias, residual), k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_paths_and_every_batch_size_give_the_same_bits(kernel, fmt):
    """The direct (in-register) and tile (L2 buffer) paths sum in the same order: a row's result never depends on M."""
    n, k = 37, 99
    w, x = random_weight(fmt, n, k, seed=5), torch.randn(40, k)
    bias, residual = torch.randn(n), torch.randn(40, n)
    direct = qg.matmul(x, w, bias, residual, direct_rows=64)
    tile = qg.matmul(x, w, bias, residual, direct_rows=0)
    assert torch.equal(direct, tile)
    for i in (0, 17, 39):
        assert torch.equal(qg.matmul(x[i : i + 1], w, bias, residual[i : i + 1]), direct[i : i + 1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_direct_path_over_more_rows_than_one_pass_keeps_the_bits(kernel, fmt):
    """The direct path keeps 48 rows' sums per pass over a panel pair; 100 rows take three passes, an odd panel
    count leaves a single last panel, K = 95 ends in an odd partial group: still the tile path's bits."""
    n, k = 43, 95
    w, x = random_weight(fmt, n, k, seed=7), torch.randn(100, k)
    bias, residual = torch.randn(n), torch.randn(100, n)
    direct = qg.matmul(x, w, bias, residual, direct_rows=128)
    assert torch.equal(direct, qg.matmul(x, w, bias, residual, direct_rows=0))
    check_close(direct, reference(x, w, bias, residual), k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 8, 16, 40])
def test_result_does_not_depend_on_thread_count(kernel, fmt, m):
    """Threads split output panels; each output is summed by one thread in one order."""
    w, x, bias = random_weight(fmt, 1000, 300, seed=m), torch.randn(m, 300), torch.randn(1000)
    outs = [with_threads(t, lambda: qg.matmul(x, w, bias)) for t in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_avx512
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", [*SHAPES, (43, 95), (1000, 300)])
def test_avx512_kernels_give_the_avx2_bits(kernel, kernel_isa, fmt, n, k):
    """Lane j of a panel pair's AVX-512 register does what lane j % 8 of its panel's AVX2 register does: the same
    bits at every row count (the register kernels' one- and two-pair passes, the L1 path's 12- and 6-row tiles,
    several 48-row passes, the tile path's 12- and 3-row tiles), odd panel counts (a thread's last single panel
    runs AVX2), and 1-3 threads."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w, x = random_weight(fmt, n, k, seed=n + k), torch.randn(100, k, generator=gen)
    bias, residual = torch.randn(n, generator=gen), torch.randn(100, n, generator=gen)
    for m in (1, 2, 3, 5, 8, 9, 13, 25, 100):
        for threads in (1, 2, 3):
            outs = []
            for choice in ("avx2", "auto"):
                kernel_isa(choice)
                for direct_rows in (128, 0):  # the direct path (registers, L1 blocks), the tile path
                    outs.append(
                        with_threads(threads, lambda: qg.matmul(x[:m], w, bias, residual[:m], direct_rows=direct_rows))
                    )
            assert all(torch.equal(outs[0], out) for out in outs), (m, threads)
    check_close(outs[1], reference(x, w, bias, residual), k)


@needs_avx512
def test_switching_the_isa_during_calls_never_mixes_the_two(kernel, kernel_isa):
    """KERNEL_ISA may change while another thread is inside a call (the engine steps in its own thread): each call
    reads the ISA once, so an AVX-512 tile size never reaches an AVX2 kernel, and every result keeps its bits."""
    w, x = random_weight("int8", 64, 200, seed=3), torch.randn(40, 200)
    want = qg.matmul(x, w, direct_rows=64)
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            kernel_isa("avx2")
            kernel_isa("auto")

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(200):
            for direct_rows in (64, 0):  # the L1 path's and the tile path's tiles
                assert torch.equal(qg.matmul(x, w, direct_rows=direct_rows), want)
    finally:
        stop.set()
        flipper.join()


def test_the_kernel_isa_can_be_chosen(kernel, kernel_isa):
    """``avx2`` runs the AVX2 kernels on any CPU; ``auto`` the AVX-512 ones exactly where the CPU has AVX-512F."""
    kernel_isa("avx2")
    assert build.kernel_isa() == "avx2" and kernel.kernel_isa(-1) == 0
    kernel_isa("auto")
    assert build.kernel_isa() == ("avx512" if build.has_avx512() else "avx2")
    with pytest.raises(ValueError, match="kernel ISA must be one of auto, avx2"):
        kernel_isa("avx512")


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_fallback_computes_the_same_product(kernel, fmt, monkeypatch):
    n, k = 300, 70  # more than one fallback chunk of 256 outputs
    w, x, bias, residual = random_weight(fmt, n, k, seed=3), torch.randn(6, k), torch.randn(n), torch.randn(6, n)
    compiled = qg.matmul(x, w, bias, residual)
    monkeypatch.setattr(qg, "load", lambda: None)
    fallback = qg.matmul(x, w, bias, residual)
    check_close(fallback, reference(x, w, bias, residual), k)
    torch.testing.assert_close(fallback, compiled, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_residual_views(kernel):
    """x and residual may be row views of wider tensors (ldx, ldr > K, N)."""
    wide_x, wide_r = torch.randn(20, 80), torch.randn(20, 40)
    x, residual = wide_x[:, 3:67], wide_r[:, :24]
    for fmt in FORMATS:
        w = random_weight(fmt, 24, 64, seed=1)
        for rows in (3, 20):  # the direct path, then the tile path
            out = qg.matmul(x[:rows], w, None, residual[:rows])
            check_close(out, reference(x[:rows], w, None, residual[:rows]), 64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_unpack_round_trip_and_bytes(fmt):
    w = random_weight(fmt, 13, 70, seed=2)  # 2 panels (one partial), 3 groups (one partial)
    assert w.data.shape == (2, 3, qg.BLOCK_BYTES[fmt])
    assert w.nbytes == 2 * 3 * (272 if fmt == "int8" else 160)
    q, d, m = qg.unpack(w)
    again = qg.pack(fmt, q, d, m)
    assert torch.equal(again.data, w.data)
    deq = qg.dequantize(w)
    expect = q.float() * d.float().repeat_interleave(qg.GROUP, dim=1)[:, :70]
    if m is not None:
        expect = expect + m.float().repeat_interleave(qg.GROUP, dim=1)[:, :70]
    assert torch.equal(deq, expect)


def test_int4_layout_packs_k_pairs_into_nibbles():
    """Block byte [t * 8 + c] holds q[2t] (low nibble) and q[2t + 1] (high) of column c, after d and m."""
    q = torch.zeros(8, 32, dtype=torch.uint8)
    q[3, 4], q[3, 5] = 7, 9  # column 3, k-pair 2
    d, m = torch.ones(8, 1).half(), torch.zeros(8, 1).half()
    data = qg.pack("int4", q, d, m).data[0, 0]
    assert data[32 + 2 * 8 + 3].item() == 7 | (9 << 4)
    assert torch.count_nonzero(data[32:]).item() == 1


def test_dequantize_rows_reads_single_rows():
    for fmt in FORMATS:
        w = random_weight(fmt, 21, 40, seed=4)
        rows = torch.tensor([20, 0, 9, 9, 8])
        assert torch.equal(qg.dequantize_rows(w, rows), qg.dequantize(w)[rows])


def test_bad_inputs_are_clear_errors():
    w = random_weight("int8", 8, 6, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        qg.matmul(torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="fp32"):
        qg.matmul(torch.randn(2, 6, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="unknown weight format"):
        qg.pack("int3", torch.zeros(8, 6, dtype=torch.int8), torch.zeros(8, 1).half())
    with pytest.raises(ValueError, match="scales must be"):
        qg.pack("int4", torch.zeros(8, 6, dtype=torch.uint8), torch.zeros(8, 1).half())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_shares_torchs_openmp_runtime(kernel):
    """Two OpenMP runtimes would each spin a thread team on the same cores."""
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(mapped) == 1, mapped


def test_missing_compiler_is_reported(monkeypatch, tmp_path):
    from models.kernels import build

    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        qg._load()


def test_builds_into_an_empty_cache_and_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    lib = qg._load()
    assert len(list((tmp_path / "kernels").glob("quant_gemm-*.so"))) == 1 and hasattr(lib, "quant_gemm")


def test_compiler_error_is_reported_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="failed"):
        qg._load()
    assert not list(tmp_path.rglob("*.so"))
