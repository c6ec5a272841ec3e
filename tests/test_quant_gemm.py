"""The GEMM over GGUF-typed weights (models/kernels/quant_gemm.c, one header per type in quants/): every type's
weights are gguf-py's values bit for bit, the product sums in one fixed order on every path, ISA and thread count.

Weights are blocks with random valid contents written with numpy in each type's layout (``random_blocks``): enough
to prove a kernel exact, no quantizer involved. Shapes are ragged (output rows not a multiple of any group size,
float rows of any length), rows 1-100, threads 1-3, the AVX2 and AVX-512 kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

from models.gguf.blocks import TYPES, random_blocks  # noqa: E402
from models.kernels import build  # noqa: E402
from models.kernels import quant_gemm as qg  # noqa: E402

from conftest import need_kernel, needs_avx512  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = list(TYPES)
FLOATS = ("F32", "F16", "BF16")


@pytest.fixture(scope="module")
def kernel():
    """Builds the kernel on first use (never at collection); skips the kernel tests where it cannot build."""
    return need_kernel(qg, "quantized GEMM")


def isas() -> list[str]:
    return ["avx2", "auto"] if build.has_avx512() else ["avx2"]


def random_weight(kind: str, n: int, k: int, seed: int, scale: float = 0.05) -> qg.QuantWeight:
    """[n, k] of type ``kind`` with random valid blocks (k whole blocks of the type)."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(kind, n * k // TYPES[kind].block, rng, scale).reshape(n, -1)
    return qg.from_blocks(kind, raw, k)


def gguf_values(w: qg.QuantWeight) -> torch.Tensor:
    """What gguf-py (transformers' GGUF loader) dequantizes the weight's bytes to."""
    raw = w.data.numpy()
    if w.fmt in ("F32", "F16"):
        raw = raw.view(np.float32 if w.fmt == "F32" else np.float16)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[w.fmt])))


def f32_twin(w: qg.QuantWeight) -> qg.QuantWeight:
    """The same weights as an F32 weight: the kernel multiplies by exactly these floats in the same order, so a type's
    product equals its twin's bit for bit exactly when the type's kernel multiplies by gguf-py's values."""
    values = gguf_values(w).contiguous()
    return qg.QuantWeight("F32", values.view(torch.uint8).reshape(w.out_features, -1), *w.shape)


def shape_for(kind: str) -> tuple[int, int]:
    """(n, k): ragged n; two super-blocks, two 32-blocks plus one, or a float row of 77."""
    block = TYPES[kind].block
    return 13, {256: 512, 32: 96, 1: 77}[block]


def check_close(out: torch.Tensor, x: torch.Tensor, values: torch.Tensor, *extra: torch.Tensor) -> None:
    """out within fp32 summation error of the float64 product x @ values^T (+ extra terms): 1e-5 of the sum of the
    terms' magnitudes (K / 16 + 4 fp32 roundings at most per output)."""
    x64, w64 = x.double(), values.double()
    ref, scale = x64 @ w64.t(), x64.abs() @ w64.abs().t()
    for term in extra:
        ref, scale = ref + term.double(), scale + term.double().abs()
    assert ((out.double() - ref).abs() <= 1e-5 * scale + 1e-30).all(), float(((out.double() - ref).abs() / scale).max())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- the weights


@pytest.mark.parametrize("kind", ALL)
def test_every_kernel_dequantizes_to_gguf_pys_values(kernel, kernel_isa, kind):
    """The SIMD kernels of both ISAs and the scalar C reference give gguf-py's fp32 values, bit for bit."""
    n, k = shape_for(kind)
    w = random_weight(kind, n, k, seed=1)
    want = bits(gguf_values(w))
    rows = torch.tensor([12, 0, 5, 5, 7])
    for isa in isas():
        kernel_isa(isa)
        assert torch.equal(bits(qg.dequantize(w)), want), isa
        assert torch.equal(bits(qg.dequantize_rows(w, rows)), want[rows]), isa
    assert torch.equal(bits(qg.dequantize_rows(w, torch.arange(n), ref=True)), want)


@pytest.mark.parametrize("kind", ALL)
def test_resident_bytes_are_the_files_bytes(kind):
    """A weight is its blocks: no padding, no widening."""
    n, k = shape_for(kind)
    w = random_weight(kind, n, k, seed=2)
    t = TYPES[kind]
    assert w.nbytes == n * k // t.block * t.nbytes == n * t.row_bytes(k)


# ---------------------------------------------------------------- the product


@pytest.mark.parametrize("kind", ALL)
def test_the_product_multiplies_exactly_gguf_pys_weights(kernel, kind):
    """Every row count, both paths: the type's product is its F32 twin's bit for bit (the same floats multiplied in
    the same order), and within float rounding of the float64 product."""
    n, k = shape_for(kind)
    w = random_weight(kind, n, k, seed=3)
    twin, values = f32_twin(w), gguf_values(w)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(100, k, generator=gen)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100):
        for direct_rows in (-1, 0, 128):  # the default split, the tile path only, the direct path only
            out = qg.matmul(x[:m], w, direct_rows=direct_rows)
            assert torch.equal(bits(out), bits(qg.matmul(x[:m], twin, direct_rows=direct_rows))), (m, direct_rows)
    check_close(out, x, values)


@pytest.mark.parametrize("kind", ALL)
def test_every_path_isa_and_thread_count_gives_the_same_bits(kernel, kernel_isa, kind):
    """A row's result never depends on M, on the path (registers or tiles), on the ISA or on the threads; with bias
    and residual epilogues; 43 outputs split unevenly over up to 3 threads."""
    n, k = 43, shape_for(kind)[1]
    w = random_weight(kind, n, k, seed=5)
    gen = torch.Generator().manual_seed(6)
    x, bias, residual = (
        torch.randn(25, k, generator=gen),
        torch.randn(n, generator=gen),
        torch.randn(25, n, generator=gen),
    )
    want = qg.matmul(x, w, bias, residual, direct_rows=0)
    for isa in isas():
        kernel_isa(isa)
        for threads in (1, 2, 3):
            for m in (1, 3, 6, 9, 25):
                for direct_rows in (0, 128):
                    out = with_threads(
                        threads, lambda: qg.matmul(x[:m], w, bias, residual[:m], direct_rows=direct_rows)
                    )
                    assert torch.equal(bits(out), bits(want[:m])), (isa, threads, m, direct_rows)
    check_close(want, x, gguf_values(w), bias, residual)


@pytest.mark.parametrize("kind", FLOATS)
@pytest.mark.parametrize("k", [1, 5, 16, 31, 33, 48, 95])
def test_float_rows_of_any_length(kernel, kernel_isa, kind, k):
    """F32 / F16 / BF16 rows need not be whole chunks of 32: the missing weights count as zeros on every path."""
    w = random_weight(kind, 11, k, seed=k)
    x = torch.randn(12, k)
    outs = []
    for isa in isas():
        kernel_isa(isa)
        outs += [qg.matmul(x, w, direct_rows=r) for r in (0, 128)]
    assert all(torch.equal(outs[0], o) for o in outs)
    check_close(outs[0], x, gguf_values(w))


def test_mixed_parts_are_each_in_their_own_type(kernel):
    """A fused linear of several types (a Q4_K_M file's Q4_K Q and K beside a Q6_K V) computes each part's outputs
    with its own kernel, side by side: the bits of the parts multiplied one at a time."""
    parts = [random_weight("Q4_K", 16, 256, 7), random_weight("Q4_K", 8, 256, 8), random_weight("Q6_K", 9, 256, 9)]
    fused = qg.QuantParts(parts)
    assert fused.fmt == "Q4_K+Q4_K+Q6_K" and fused.shape == (33, 256) and fused.nbytes == sum(p.nbytes for p in parts)
    x, bias, residual = torch.randn(5, 256), torch.randn(33), torch.randn(5, 33)
    out = qg.matmul(x, fused, bias, residual)
    at = 0
    for p in parts:
        one = qg.matmul(x, p, bias[at : at + p.out_features], residual[:, at : at + p.out_features])
        assert torch.equal(out[:, at : at + p.out_features], one)
        at += p.out_features
    assert torch.equal(qg.dequantize(fused), torch.cat([qg.dequantize(p) for p in parts]))


@needs_avx512
def test_switching_the_isa_during_calls_never_mixes_the_two(kernel, kernel_isa):
    """KERNEL_ISA may change while another thread is inside a call (the engine steps in its own thread): each call
    reads the ISA once, so an AVX-512 tile size never reaches an AVX2 kernel, and every result keeps its bits."""
    w, x = random_weight("Q4_K", 64, 512, seed=3), torch.randn(40, 512)
    want = qg.matmul(x, w, direct_rows=64)
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            kernel_isa("avx2")
            kernel_isa("auto")

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(100):
            for direct_rows in (64, 0):  # the direct path's passes, the tile path's tiles
                assert torch.equal(qg.matmul(x, w, direct_rows=direct_rows), want)
    finally:
        stop.set()
        flipper.join()


def test_the_kernel_isa_can_be_chosen(kernel, kernel_isa):
    """``avx2`` runs the AVX2 kernels on any CPU; ``auto`` the AVX-512 ones exactly where the CPU has them."""
    kernel_isa("avx2")
    assert build.kernel_isa() == "avx2" and kernel.kernel_isa(-1) == 0
    kernel_isa("auto")
    assert build.kernel_isa() == ("avx512" if build.has_avx512() else "avx2")
    with pytest.raises(ValueError, match="kernel ISA must be one of auto, avx2"):
        kernel_isa("avx512")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "F16"])
def test_torch_fallback_computes_the_same_product(kernel, kind, monkeypatch):
    k = shape_for(kind)[1]
    w = random_weight(kind, 300, k, seed=3)  # more than one fallback chunk of 256 outputs
    x, bias, residual = torch.randn(6, k), torch.randn(300), torch.randn(6, 300)
    compiled = qg.matmul(x, w, bias, residual)
    monkeypatch.setattr(qg, "load", lambda: None)
    fallback = qg.matmul(x, w, bias, residual)
    assert torch.equal(bits(qg.dequantize(w)), bits(gguf_values(w)))  # the numpy reference without the kernel
    check_close(fallback, x, gguf_values(w), bias, residual)
    check_close(compiled, x, gguf_values(w), bias, residual)


def test_strided_rows_and_residual_views(kernel):
    """x and residual may be row views of wider tensors (ldx, ldr > K, N)."""
    wide_x, wide_r = torch.randn(20, 300), torch.randn(20, 40)
    x, residual = wide_x[:, 3:259], wide_r[:, :24]
    w = random_weight("Q4_K", 24, 256, seed=1)
    for rows in (3, 20):  # the direct path, then the tile path
        out = qg.matmul(x[:rows], w, None, residual[:rows])
        assert torch.equal(out, qg.matmul(x[:rows].contiguous(), w, None, residual[:rows].contiguous()))


def test_bad_inputs_are_clear_errors():
    w = random_weight("Q8_0", 8, 64, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        qg.matmul(torch.randn(2, 5), w)
    with pytest.raises(ValueError, match="fp32"):
        qg.matmul(torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="no kernel serves GGUF type 'IQ2_XXS'"):
        qg.QuantWeight("IQ2_XXS", torch.zeros(8, 66, dtype=torch.uint8), 8, 256)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        qg.QuantWeight("Q4_K", torch.zeros(8, 144, dtype=torch.uint8), 8, 200)
    with pytest.raises(ValueError, match=r"is uint8 \[8, 68\]"):
        qg.QuantWeight("Q8_0", torch.zeros(8, 64, dtype=torch.uint8), 8, 64)


OPENMP_RUNTIMES = """
import json
import torch
from models.kernels import quant_gemm
from models.quant import GGUFWeights  # the GGUF reader (never gguf-py, whose sentencepiece brings its own libgomp)
assert quant_gemm.load() is not None
print(json.dumps(sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_shares_torchs_openmp_runtime(kernel):
    """Two OpenMP runtimes would each spin a thread team on the same cores: a serving process (torch, the kernel,
    the GGUF reader) maps one."""
    proc = subprocess.run(
        [sys.executable, "-c", OPENMP_RUNTIMES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout)) == 1, proc.stdout


def test_missing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        qg._load()


def test_compiler_error_is_reported_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(RuntimeError, match="failed"):
        qg._load()
    assert not list(tmp_path.rglob("*.so"))
