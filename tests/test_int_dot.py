"""The integer-dot path (models/kernels/int_dot.c): int8 activations times quant_gemm's packed int8 / int4 weights.

Each ISA the CPU has (AVX2 maddubs always; AVX-VNNI and AVX-512 VNNI where present, else the test says which it
could not run and why: never a silent skip) against a float64 evaluation of the same quantized math: the
activations rounded exactly as the kernel does (checked bit for bit first), then per output the sum over groups
of dx d S (+ m s dx). Ragged shapes (K not a multiple of 32, N not of 8 or 16, odd panel ranges), 1-3 threads,
bias and residual; and the results do not depend on the ISA, the batch or the thread count (bit for bit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.kernels import build, int_dot, quant_gemm

pytestmark = pytest.mark.skipif(int_dot.load() is None, reason=f"int_dot kernel: {int_dot.KERNEL.unavailable_reason}")

FLAGS = build.cpu_flags() or set()
CPU_ISAS = ["avx2"]
if "avx_vnni" in FLAGS:
    CPU_ISAS.append("avxvnni")
if {"avx512_vnni", "avx512vbmi", "avx512bw", "avx512vl"} <= FLAGS:
    CPU_ISAS.append("avx512vnni")


@pytest.fixture(params=int_dot.ISAS)
def isa(request):
    """Each ISA path; one the CPU lacks fails loudly unless the CPU really lacks it (then it reports the reason)."""
    name = request.param
    if name not in CPU_ISAS:
        pytest.skip(f"this CPU has no {name} (flags: {sorted(f for f in FLAGS if 'vnni' in f or 'vbmi' in f)})")
    got = int_dot.force_isa(name)
    assert got == name
    yield name
    int_dot.force_isa("avx512vnni")  # back to the best the CPU has


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's activation rounding in numpy fp32: per 32-group a = max|x|, d = a / 127, q = rint(x * 127 / a)."""
    m, k = x.shape
    g = -(-k // 32)
    xp = np.zeros((m, g * 32), np.float32)
    xp[:, :k] = x
    xg = xp.reshape(m, g, 32)
    a = np.abs(xg).max(axis=2)  # [M, G]
    d = (a / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(a != 0, np.float32(127) / a, np.float32(0)).astype(np.float32)
    q = np.rint(xg * inv[:, :, None]).astype(np.int32)
    return q.reshape(m, g * 32).astype(np.int8), d, q.sum(axis=2).astype(np.int32)


def reference(x, fmt, q, d, m, bias=None, residual=None) -> tuple[np.ndarray, np.ndarray]:
    """float64 (y, scale) of the quantized math: y[i, n] = sum_g dx d S (+ m s dx) (+ bias) (+ r); scale bounds
    the fp32 rounding (the sum of the terms' magnitudes)."""
    xq, dx, xs = quantize_ref(x.numpy())
    n, k = q.shape
    g = dx.shape[1]
    wq = np.zeros((n, g * 32), np.int64)
    wq[:, :k] = q.numpy().astype(np.int64)
    S = np.einsum("mgk,ngk->mng", xq.astype(np.int64).reshape(-1, g, 32), wq.reshape(n, g, 32))  # exact
    terms = dx.astype(np.float64)[:, None, :] * d.numpy().astype(np.float64)[None, :, :] * S
    if m is not None:
        terms = terms + m.numpy().astype(np.float64)[None, :, :] * (xs.astype(np.float64) * dx)[:, None, :]
    y = terms.sum(axis=2)
    scale = np.abs(terms).sum(axis=2)
    if bias is not None:
        y = y + bias.numpy().astype(np.float64)
        scale = scale + np.abs(bias.numpy())
    if residual is not None:
        y = y + residual.numpy().astype(np.float64)
        scale = scale + np.abs(residual.numpy())
    return y, scale


def random_weight(fmt: str, n: int, k: int, seed: int):
    """Random valid blocks: int8 q over all of -128..127, int4 q 0..15; fp16 scales (and int4 mins) of both signs."""
    gen = torch.Generator().manual_seed(seed)
    g = -(-k // 32)
    d = (torch.rand(n, g, generator=gen) * 0.02 + 0.001).half()
    if fmt == "int8":
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int16).to(torch.int8)
        return quant_gemm.pack("int8", q, d), q, d, None
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    m = ((torch.rand(n, g, generator=gen) - 0.5) * 0.2).half()
    return quant_gemm.pack("int4", q, d, m), q, d, m


def check(out: torch.Tensor, y: np.ndarray, scale: np.ndarray) -> None:
    err = np.abs(out.numpy().astype(np.float64) - y)
    bound = 2e-6 * scale + 1e-30
    worst = float((err / bound).max())
    assert worst <= 1.0, f"off the float64 reference by {worst:.2f} x the fp32 bound (max abs {err.max():.3g})"


def test_activation_rounding_is_the_references():
    gen = torch.Generator().manual_seed(1)
    for k in (1, 31, 32, 33, 100, 2048):
        x = torch.randn(5, k, generator=gen) * torch.logspace(-3, 3, 5)[:, None]
        x[0, : min(k, 32)] = 0.0  # an all-zero group: d = 0, q = 0
        if k > 3:
            x[1, 3] = 127.5 * x[1, :k].abs().max() / 127  # a tie after scaling (the kernel rounds to even)
        q, d, s = int_dot.quantize(x.numpy())
        rq, rd, rs = quantize_ref(x.numpy())
        assert np.array_equal(q, rq) and np.array_equal(d, rd) and np.array_equal(s, rs), f"K={k}"
        assert np.abs(q.astype(np.int32)).max() <= 127


SHAPES = [(1, 32, 8), (1, 70, 17), (2, 96, 15), (3, 101, 40), (5, 64, 7), (8, 200, 33), (9, 64, 24), (17, 75, 16)]
SHAPES += [(33, 130, 9)]  # rows, K, N


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_each_isa_matches_the_float64_reference(isa, fmt):
    for i, (rows, k, n) in enumerate(SHAPES):
        w, q, d, m = random_weight(fmt, n, k, seed=10 + i)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i))
        bias = torch.randn(n) if i % 2 else None
        residual = torch.randn(rows, n) if i % 3 == 0 else None
        y, scale = reference(x, fmt, q, d, m, bias, residual)
        for threads in (1, 2, 3):
            out = int_dot.gemm(x, w, bias, residual, threads=threads)
            check(out, y, scale)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_results_do_not_depend_on_isa_batch_or_threads(fmt):
    w, *_ = random_weight(fmt, 45, 160, seed=3)
    x = torch.randn(20, 160, generator=torch.Generator().manual_seed(4))
    outs = {}
    for name in CPU_ISAS:
        int_dot.force_isa(name)
        for threads in (1, 3):
            outs[(name, threads)] = int_dot.gemm(x, w, threads=threads)
            # row i alone, and the first 8 rows (the register path) give row i's bits of the 20-row call
            for i in (0, 7, 19):
                assert torch.equal(int_dot.gemm(x[i : i + 1], w, threads=threads)[0], outs[(name, threads)][i])
            assert torch.equal(int_dot.gemm(x[:8], w, threads=threads), outs[(name, threads)][:8])
    int_dot.force_isa("avx512vnni")
    first = next(iter(outs.values()))
    for key, out in outs.items():
        assert torch.equal(out, first), key


def test_close_to_the_exact_fp32_path():
    """Sanity of the whole idea: int8 activations change a linear's outputs by about 2^-8 relative, not more."""
    w, *_ = random_weight("int4", 64, 512, seed=5)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(6))
    exact = quant_gemm.matmul(x, w)
    approx = int_dot.gemm(x, w)
    rel = (approx - exact).norm() / exact.norm()
    assert 0 < rel < 0.02


def test_activations_setting():
    lib = int_dot.load()
    assert int_dot.rows_for("fp32", "int8") is None and int_dot.rows_for("int8", "int4") == 1
    with pytest.raises(ValueError, match="ACTIVATIONS"):
        int_dot.set_activations("int4")
    try:
        int_dot.set_activations("int8")
        assert lib.int_dot_set_rows(0, 1) == 1 and lib.int_dot_set_rows(1, 1) == 1
        int_dot.set_activations("fp32")
        assert lib.int_dot_set_rows(0, 0) == 0
    finally:
        int_dot.set_activations("auto")
    assert "ACTIVATIONS=auto" in int_dot.describe()


@pytest.mark.model
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_whole_step_takes_the_setting(weights, tmp_path, kernel_isa):
    """A Llama image's steps (a prompt chunk, then decode rows) under ACTIVATIONS=int8 against fp32: the integer path
    runs (other logits), stays close (the same greedy tokens nearly everywhere), and gives the same bits at 1 and 3
    threads and under KERNEL_ISA=avx2 (maddubs) and auto (VNNI)."""
    from models import image
    from models.native import NativeModel
    from scripts.make_test_model import build_checkpoint

    model_dir = build_checkpoint(str(tmp_path / "llama"), arch="llama", seed=4, tied=False)
    image.write_image(model_dir, weights, str(tmp_path / "image"))
    nm = NativeModel(str(tmp_path / "image"), 64, 4, threads=2)
    prompt = list(range(5, 45))
    table = list(range(12))

    def run(choice: str, threads: int = 2, isa: str = "auto") -> np.ndarray:
        int_dot.set_activations(choice)
        kernel_isa(isa)
        nm.threads = threads
        nm.k[...] = 0
        nm.v[...] = 0
        first = nm.forward([], [], [], [prompt], [table], [0], [True])  # 40 rows
        # 2 decode rows; the second is another sequence at position 3 in its own block (a block another row of the
        # step reads would make the result depend on which thread writes first: the planner never builds that step)
        step = nm.forward([7, 9], [40, 3], [table, [12]])
        return np.concatenate([first, step])

    try:
        exact, approx = run("fp32"), run("int8")
        assert not np.array_equal(exact, approx)
        rel = np.linalg.norm(approx - exact) / np.linalg.norm(exact)
        assert rel < 0.05, rel
        assert (approx.argmax(-1) == exact.argmax(-1)).mean() >= 0.9
        for threads, isa in ((1, "auto"), (3, "auto"), (2, "avx2")):
            assert np.array_equal(run("int8", threads, isa), approx), (threads, isa)
        assert np.array_equal(run("fp32", 3, "avx2"), exact)  # the exact path is untouched by the setting
    finally:
        int_dot.set_activations("auto")


def test_auto_is_the_measured_choice_and_the_tests_run_exact():
    """ACTIVATIONS=auto maps each format and kind of ISA to the step size docs/integer-dot.md measured, and follows
    KERNEL_ISA; the suite pins it to the exact path (conftest), and a server started by the tests gets
    ACTIVATIONS=fp32 (live.ProcessServer)."""
    lib = int_dot.load()
    assert all(set(rows) == set(int_dot.FORMATS) for rows in int_dot.MEASURED_AUTO_ROWS.values())
    assert all(int_dot.rows_for("auto", fmt, isa) is None for fmt in int_dot.FORMATS for isa in int_dot.ISAS)
    saved = {kind: dict(rows) for kind, rows in int_dot.AUTO_ROWS.items()}
    try:
        for kind, rows in int_dot.MEASURED_AUTO_ROWS.items():
            int_dot.AUTO_ROWS[kind].update(rows)
        assert int_dot.rows_for("auto", "int4", "avx512vnni") == int_dot.MEASURED_AUTO_ROWS["vnni"]["int4"]
        assert int_dot.rows_for("auto", "int8", "avx2") == int_dot.MEASURED_AUTO_ROWS["avx2"]["int8"]
        int_dot.set_activations("auto")
        vnni = int_dot.MEASURED_AUTO_ROWS["vnni"]["int4"] or 0
        if CPU_ISAS[-1] != "avx2":  # a VNNI CPU: auto's rows, then KERNEL_ISA=avx2 turns them to AVX2's
            assert lib.int_dot_set_rows(1, vnni) == vnni
            build.set_kernel_isa("avx2")
            assert lib.int_dot_set_rows(1, 0) == (int_dot.MEASURED_AUTO_ROWS["avx2"]["int4"] or 0)
    finally:
        build.set_kernel_isa("auto")
        for kind, rows in saved.items():
            int_dot.AUTO_ROWS[kind].update(rows)
        int_dot.set_activations("auto")
