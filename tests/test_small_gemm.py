"""The small-batch GEMM kernel (models/kernels/small_gemm.c) against float64 torch, and the Linear using it.

Nothing here imports torch or runs the compiler while pytest collects (``-m "not model"`` stays
torch-free): the kernel is built by the ``small_gemm`` fixture when a test first needs it.
"""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.model

MAX_ROWS = 16  # models.kernels.small_gemm.MAX_ROWS, checked by test_max_rows_constant


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def small_gemm(torch):
    from models.kernels import small_gemm

    if small_gemm.load() is None:
        pytest.skip(f"kernel unavailable: {small_gemm.KERNEL.unavailable_reason}")
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
    small = Linear(w, b, onednn=True, batch_hint=8, small=True)
    onednn = Linear(w, b, onednn=True, batch_hint=8, small=False)
    assert small._use_small(x) == (rows <= small_gemm.MAX_ROWS)
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
