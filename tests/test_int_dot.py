"""The integer-dot path (models/kernels/int_dot.c): int8 activations times GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS weights in their own blocks (random valid blocks written with numpy
in each type's layout, as quant_gemm reads them).

Each ISA the CPU has (AVX2 maddubs always; AVX-VNNI and AVX-512 VNNI where present, else the test says which it
could not run and why: never a silent skip) against a float64 evaluation of the same quantized math: the
activations rounded exactly as the kernel does (checked bit for bit first), then per output the sum over groups
of dx d S (+ m s dx; Q2_K: + dx (-dmin) Mn, its sub-blocks' mins). Ragged shapes (N not a multiple of 8 or 16,
odd panel ranges), 1-3 threads, bias and residual; and the results do not depend on the ISA, the batch or the
thread count (bit for bit).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from models.gguf.blocks import (
    KVALUES,
    _bits,
    _k4_nibbles,
    _nibbles,
    _q3_k_scales,
    _two_bit_groups,
    iq4_xs_scales,
    k4_scale_min,
    random_blocks,
)
from models.gguf.blocks import TYPES as GGUF_TYPES
from models.kernels import build, int_dot, quant_gemm

from conftest import need_kernel


@pytest.fixture(autouse=True)
def _kernel():
    """Every test needs the kernel: skipped where it cannot build, failed instead under REQUIRE_KERNELS=1."""
    need_kernel(int_dot, "integer-dot")


FLAGS = build.cpu_flags() or set()
CPU_ISAS = ["avx2"]
if "avx_vnni" in FLAGS:
    CPU_ISAS.append("avxvnni")
if {"avx512_vnni", "avx512bw", "avx512vl"} <= FLAGS:
    CPU_ISAS.append("avx512vnni")


@pytest.fixture(params=int_dot.ISAS)
def isa(request):
    """Each ISA path; one the CPU lacks fails loudly unless the CPU really lacks it (then it reports the reason)."""
    name = request.param
    if name not in CPU_ISAS:
        pytest.skip(f"this CPU has no {name} (flags: {sorted(f for f in FLAGS if 'vnni' in f)})")
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


def reference(x, q, d, m, bias=None, residual=None) -> tuple[np.ndarray, np.ndarray]:
    """float64 (y, scale) of the quantized math: y[i, n] = sum_g dx d S (+ m s dx) (+ bias) (+ r), q the weights'
    integers (Q4_0: q - 8); m a group's min, or Q2_K's (mins [n, k] per weight, factor [n, G]: the group's term
    dx factor Mn, Mn = sum_k q_k mins_k); scale bounds the fp32 rounding (the sum of the terms' magnitudes)."""
    xq, dx, xs = quantize_ref(x.numpy())
    n, k = q.shape
    g = dx.shape[1]

    def sums(ints: np.ndarray) -> np.ndarray:  # [M, N, G]: each group's exact integer sum of q_k ints_k
        per_group = ints.astype(np.int64).reshape(n, g, 32)
        return np.einsum("mgk,ngk->mng", xq.astype(np.int64).reshape(-1, g, 32), per_group)

    terms = dx.astype(np.float64)[:, None, :] * d.astype(np.float64)[None, :, :] * sums(q)  # S exact
    if isinstance(m, tuple):
        mins, factor = m
        terms = terms + dx.astype(np.float64)[:, None, :] * factor.astype(np.float64)[None, :, :] * sums(mins)
    elif m is not None:
        terms = terms + m.astype(np.float64)[None, :, :] * (xs.astype(np.float64) * dx)[:, None, :]
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
    """[n, k] random valid blocks of GGUF type ``fmt`` (fp16 scales and mins of both signs) -> the weight and, as the
    blocks hold them, its integers q [n, k] (Q4_0: q - 8; Q5_0: q - 16; Q6_K: sc (q - 32); Q3_K: sc (q - 4); Q2_K:
    sc q; IQ4_*: the grid's values) and each 32-group's factors d [n, G] and m [n, G] (None without a min; Q2_K:
    (its mins [n, k], -dmin [n, G])): weight = d q (+ m) in fp32, gguf-py's values."""
    t, g = GGUF_TYPES[fmt], k // 32
    raw = random_blocks(fmt, n * k // t.block, np.random.default_rng(seed), 0.01)  # [blocks, block bytes]
    w = quant_gemm.from_blocks(fmt, raw.reshape(n, -1), k)
    half = lambda at: raw[:, at : at + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731  [blocks, 1]
    m = None
    if fmt == "Q8_0":
        q, d = raw[:, 2:34].view(np.int8).astype(np.int32), half(0)
    elif fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[fmt]  # the 16 bytes of nibbles (Q5_*: qh just before)
        qs = raw[:, at : at + 16]
        q, d = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int32), half(0)  # k 0-15 low nibbles, 16-31 high
        if fmt.startswith("Q5"):
            q |= _bits(raw, at - 4, 32).astype(np.int32) << 4  # bit k of the u32 qh: q[k]'s 5th bit
        if fmt.endswith("_1"):
            m = half(2)
        else:
            q -= 8 if fmt == "Q4_0" else 16
    elif fmt in ("Q4_K", "Q5_K"):
        sc, mn = k4_scale_min(raw[:, 4:16])  # [blocks, 8 sub-blocks]
        if fmt == "Q4_K":
            q = _k4_nibbles(raw[:, 16:144]).astype(np.int32)
        else:  # bit s of qh[l]: sub-block s's element l's 5th bit
            high = _bits(raw, 16, 256).reshape(-1, 32, 8).transpose(0, 2, 1)
            q = (_k4_nibbles(raw[:, 48:176]) | high << 4).astype(np.int32).reshape(len(raw), 256)
        d, m = half(0) * sc.astype(np.float32), -(half(2) * mn.astype(np.float32))
    elif fmt == "IQ4_NL":
        q, d = KVALUES[_nibbles(raw[:, 2:18])].astype(np.int32), half(0)
    elif fmt == "IQ4_XS":  # 8 sub-blocks of 32: (d sc) grid[q], sc 6 bits - 32
        q = KVALUES[_nibbles(raw[:, 8:136].reshape(-1, 16))].astype(np.int32).reshape(len(raw), 256)
        d = half(0) * iq4_xs_scales(raw).astype(np.float32)
    elif fmt in ("Q2_K", "Q3_K"):  # group c = 4 h + j: bits 2 j of qs[32 h .. 32 h + 32]; two sub-blocks of 16 each
        b, at = len(raw), 16 if fmt == "Q2_K" else 32
        low = _two_bit_groups(raw[:, at : at + 64]).astype(np.int32).reshape(b, 256)
        if fmt == "Q2_K":
            sc, mn = (raw[:, :16] & 15).astype(np.int32), (raw[:, :16] >> 4).astype(np.int32)
            q, d = np.repeat(sc, 16, axis=1) * low, np.repeat(half(80), 8, axis=1)
            m = (np.repeat(mn, 16, axis=1).reshape(n, k), np.repeat(-half(82), 8, axis=1).reshape(n, k // 32))
        else:  # bit c of hmask[k % 32]; scales 6 bits as ggml unpacks them, minus 32
            high = _bits(raw, 0, 256).reshape(b, 32, 8).transpose(0, 2, 1).reshape(b, 256).astype(np.int32)
            sc = _q3_k_scales(raw[:, 96:108]).astype(np.int32)
            q, d = np.repeat(sc, 16, axis=1) * (low + 4 * high - 4), np.repeat(half(108), 8, axis=1)
    else:  # Q6_K: 16 sub-blocks of 16, each (d sc) (q - 32); the integers carry sc
        b = len(raw)
        ql = raw[:, 0:128].reshape(b, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = raw[:, 128:192].reshape(b, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q6 = ((ql & 15).reshape(b, 8, 32) | (qh & 3).reshape(b, 8, 32) << 4).astype(np.int32) - 32
        sc = raw[:, 192:208].view(np.int8).astype(np.int32)
        q, d = (sc[:, :, None] * q6.reshape(b, 16, 16)).reshape(b, 256), np.repeat(half(208), 8, axis=1)
    d = d.astype(np.float32).reshape(n, g)
    if isinstance(m, tuple):  # Q2_K: each weight's min times the group's -dmin
        offset = np.repeat(m[1], 32, axis=1).astype(np.float64) * m[0]
    elif m is not None:
        m = m.astype(np.float32).reshape(n, g)
        offset = np.repeat(m, 32, axis=1)
    q = q.reshape(n, k)
    values = np.repeat(d, 32, axis=1) * q.astype(np.float64) + (0 if m is None else offset)
    assert np.array_equal(values.astype(np.float32), quant_gemm.dequantize(w).numpy()), fmt  # the file's weights
    return w, q, d, m


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


SHAPES = [(1, 32, 8), (1, 64, 17), (2, 96, 15), (3, 128, 40), (5, 64, 7), (8, 224, 33), (9, 64, 24), (17, 96, 16)]
SHAPES += [(33, 160, 9), (100, 64, 23)]  # rows, K, N (K: whole 32-blocks)
SUPER_SHAPES = [(1, 256, 8), (3, 512, 17), (8, 256, 33), (9, 768, 16), (33, 256, 9), (100, 512, 23)]  # 256-blocks
TYPES = list(int_dot.FORMATS)


def shapes(fmt: str) -> list[tuple[int, int, int]]:
    return SUPER_SHAPES if GGUF_TYPES[fmt].block == 256 else SHAPES


@pytest.mark.parametrize("fmt", TYPES)
def test_each_isa_matches_the_float64_reference(isa, fmt):
    for i, (rows, k, n) in enumerate(shapes(fmt)):
        w, q, d, m = random_weight(fmt, n, k, seed=10 + i)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i))
        bias = torch.randn(n) if i % 2 else None
        residual = torch.randn(rows, n) if i % 3 == 0 else None
        y, scale = reference(x, q, d, m, bias, residual)
        for threads in (1, 2, 3):
            out = int_dot.gemm(x, w, bias, residual, threads=threads)
            check(out, y, scale)


@pytest.mark.parametrize("fmt", TYPES)
def test_results_do_not_depend_on_isa_batch_or_threads(fmt):
    k = 512 if GGUF_TYPES[fmt].block == 256 else 160
    w, *_ = random_weight(fmt, 45, k, seed=3)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(4))
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


ROW_SHAPES = [(32, 1), (64, 7), (96, 9), (160, 17), (224, 33)]  # K (whole 32-blocks), N: ragged against the 8-strips
SUPER_ROW_SHAPES = [(256, 1), (512, 9), (768, 23)]  # K in 256-blocks


@contextlib.contextmanager
def row_path(rows: int):
    """Steps of up to ``rows`` rows take int_rows.c's row path (0: none, the panel path takes every step)."""
    lib = int_dot.load()
    before = lib.int_dot_row_path(rows)
    try:
        yield
    finally:
        lib.int_dot_row_path(before)


def test_row_path_is_on_for_1_to_4_rows():
    assert int_dot.load().int_dot_row_path(-1) == int_dot.ROW_PATH_ROWS == 4


@pytest.mark.parametrize("fmt", TYPES)
def test_row_path_matches_the_float64_reference_and_the_panel_path(isa, fmt):
    """int_rows.c at 1-4 rows, 1-3 threads, ragged N (strips of 8 cut short), bias and residual: within the fp32
    bound of the float64 reference, and bit for bit the panel path's output at the same rows."""
    shapes = SUPER_ROW_SHAPES if GGUF_TYPES[fmt].block == 256 else ROW_SHAPES
    for i, (k, n) in enumerate(shapes):
        w, q, d, m = random_weight(fmt, n, k, seed=40 + i)
        for rows in (1, 2, 3, 4):
            gen = torch.Generator().manual_seed(100 * i + rows)
            x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
            bias = torch.randn(n, generator=gen) if (i + rows) % 2 else None
            residual = torch.randn(rows, n, generator=gen) if (i + rows) % 3 == 0 else None
            y, scale = reference(x, q, d, m, bias, residual)
            with row_path(0):
                panel = int_dot.gemm(x, w, bias, residual, threads=2)
            for threads in (1, 2, 3):
                out = int_dot.gemm(x, w, bias, residual, threads=threads)
                check(out, y, scale)
                assert torch.equal(out, panel), (k, n, rows, threads)


def test_close_to_the_exact_fp32_path():
    """Sanity of the whole idea: int8 activations change a linear's outputs by about 2^-8 relative, not more."""
    w, *_ = random_weight("Q4_1", 64, 512, seed=5)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(6))
    exact = quant_gemm.matmul(x, w)
    approx = int_dot.gemm(x, w)
    rel = (approx - exact).norm() / exact.norm()
    assert 0 < rel < 0.02


def test_other_types_keep_fp32_activations():
    """The integer path takes every quantized GGUF type and no float one: F32, F16 and BF16 are refused by its switch
    (the whole-step kernel then runs quant_gemm's path for them) and by ``gemm``."""
    lib = int_dot.load()
    assert set(int_dot.FORMATS) == {name for name, t in GGUF_TYPES.items() if name not in ("F32", "F16", "BF16")}
    for name in ("F32", "F16", "BF16"):
        assert lib.int_dot_set_rows(GGUF_TYPES[name].type_id, 1) == -1, name
    raw = random_blocks("F16", 8 * 64, np.random.default_rng(0), 0.01).reshape(8, -1)
    with pytest.raises(ValueError, match="Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS"):
        int_dot.gemm(torch.randn(2, 64), quant_gemm.from_blocks("F16", raw, 64))


def test_activations_setting():
    lib = int_dot.load()
    assert int_dot.rows_for("fp32", "Q8_0") is None and int_dot.rows_for("int8", "Q4_1") == 1
    with pytest.raises(ValueError, match="ACTIVATIONS"):
        int_dot.set_activations("int4")
    try:
        int_dot.set_activations("int8")
        assert all(lib.int_dot_set_rows(code, 1) == 1 for code in int_dot.FORMATS.values())
        int_dot.set_activations("fp32")
        assert lib.int_dot_set_rows(int_dot.FORMATS["Q8_0"], 0) == 0
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
        nm.kv.k[...] = 0
        nm.kv.v[...] = 0
        first = nm.forward_rows([], [], [], [prompt], [table], [0], [True])  # 40 rows
        # 2 decode rows; the second is another sequence at position 3 in its own block (a block another row of the
        # step reads would make the result depend on which thread writes first: the planner never builds that step)
        step = nm.forward_rows([7, 9], [40, 3], [table, [12]])
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


@pytest.mark.model
@pytest.mark.parametrize("kinds", [("Q5_0", "Q5_1", "Q5_K"), ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")], ids=["q5", "low"])
def test_a_gguf_files_linears_take_the_integer_path(tmp_path, kinds):
    """A Llama GGUF whose every matrix is one of ``kinds`` (round-robin; the 5-bit types as llama.cpp's Q4_K_M files
    of 896- or 1152-wide models are mostly Q5_0; the 2-, 3-bit and IQ4 types of Q2_K, Q3_K_M and IQ4 files) through
    the whole-step kernel (decode_step.c): under ACTIVATIONS=int8 its linears run int_dot.c (other logits, close to
    the exact ones, the same bits at 1 and 3 threads), and with those types' rows turned off the same steps are the
    exact path's, bit for bit."""
    import itertools

    from gguf_files import write_gguf

    from models import image
    from models.gguf.reader import open_gguf
    from models.native import NativeModel
    from scripts.make_test_model import build_checkpoint

    hf = build_checkpoint(
        str(tmp_path / "hf"), arch="llama", seed=7, tied=False, overrides={"hidden_size": 256, "intermediate_size": 512}
    )
    cycle = itertools.cycle(kinds)
    path = write_gguf(hf, str(tmp_path / "mixed.gguf"), lambda name, shape: next(cycle))
    assert {t.type_name for t in open_gguf(path) if len(t.shape) == 2} == set(kinds)
    image.write_image(path, "auto", str(tmp_path / "image"))
    nm = NativeModel(str(tmp_path / "image"), 64, 4, threads=2)
    prompt, table = list(range(5, 45)), list(range(12))

    def run(choice: str, threads: int = 2, kind_rows: int | None = None) -> np.ndarray:
        int_dot.set_activations(choice)
        if kind_rows is not None:
            for lib in int_dot._libs:
                for fmt in kinds:
                    lib.int_dot_set_rows(int_dot.FORMATS[fmt], kind_rows)
        nm.threads = threads
        nm.kv.k[...] = 0
        nm.kv.v[...] = 0
        first = nm.forward_rows([], [], [], [prompt], [table], [0], [True])  # 40 rows: the panel path
        step = nm.forward_rows([7, 9], [40, 3], [table, [12]])  # 2 decode rows: the row path
        return np.concatenate([first, step])

    try:
        exact, approx = run("fp32"), run("int8")
        assert not np.array_equal(exact, approx)
        assert np.linalg.norm(approx - exact) / np.linalg.norm(exact) < 0.05
        assert (approx.argmax(-1) == exact.argmax(-1)).mean() >= 0.9
        assert np.array_equal(run("int8", threads=1), approx) and np.array_equal(run("int8", threads=3), approx)
        assert np.array_equal(run("int8", kind_rows=0), exact)  # every matrix is one of kinds: nothing else is int8
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
        assert int_dot.rows_for("auto", "Q4_1", "avx512vnni") == int_dot.MEASURED_AUTO_ROWS["vnni"]["Q4_1"]
        assert int_dot.rows_for("auto", "Q8_0", "avx2") == int_dot.MEASURED_AUTO_ROWS["avx2"]["Q8_0"]
        int_dot.set_activations("auto")
        q4_1 = int_dot.FORMATS["Q4_1"]
        vnni = int_dot.MEASURED_AUTO_ROWS["vnni"]["Q4_1"] or 0
        if CPU_ISAS[-1] != "avx2":  # a VNNI CPU: auto's rows, then KERNEL_ISA=avx2 turns them to AVX2's
            assert lib.int_dot_set_rows(q4_1, vnni) == vnni
            build.set_kernel_isa("avx2")
            assert lib.int_dot_set_rows(q4_1, 0) == (int_dot.MEASURED_AUTO_ROWS["avx2"]["Q4_1"] or 0)
    finally:
        build.set_kernel_isa("auto")
        for kind, rows in saved.items():
            int_dot.AUTO_ROWS[kind].update(rows)
        int_dot.set_activations("auto")
