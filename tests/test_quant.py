"""Quantizing fp32 weights, and reading GGUF tensors into our formats (models/quant.py)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from models.kernels import quant_gemm as qg  # noqa: E402
from models.quant import GGUFWeights, quantize, quantize_int4, quantize_int8  # noqa: E402

# ---------------------------------------------------------------- fp32 -> int8 / int4


def group_view(t: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K] per-weight values."""
    return t.float().repeat_interleave(qg.GROUP, dim=1)[:, :k]


def test_int8_error_is_at_most_half_a_step_per_group():
    w = torch.randn(37, 70) * torch.logspace(-3, 1, 70)  # partial last group, very different group ranges
    q, d = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and d.shape == (37, 3)
    step = group_view(d, 70)
    err = (qg.dequantize(quantize(w, "int8")) - w).abs()
    assert (err <= step * 0.5 + 1e-3 * step).all()  # fp16 rounding of d adds a sliver at the group's extreme


def test_int4_error_is_at_most_half_a_step_and_padding_never_widens_the_range():
    w = torch.randn(21, 45) + 5.0  # all positive: a zero-padded last group would stretch its range to 0
    q, d, m = quantize_int4(w)
    assert q.dtype == torch.uint8 and q.max() <= 15 and d.shape == m.shape == (21, 2)
    assert (m.float()[:, 1] > 1.0).all()  # the partial group's min is its own, not the padding's
    step = group_view(d, 45)
    err = (qg.dequantize(quantize(w, "int4")) - w).abs()
    assert (err <= step * 0.5 + 2e-3 * step + 5e-3).all()  # plus fp16 rounding of m


def test_constant_and_zero_groups_quantize_exactly():
    w = torch.zeros(8, 64)
    w[:, 32:] = 127 * 2**-8  # int8: d = 2^-8 exactly; int4: m = the value, d = 0
    for fmt in ("int8", "int4"):
        assert torch.equal(qg.dequantize(quantize(w, fmt)), w)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="int3"):
        quantize(torch.zeros(8, 8), "int3")


# ---------------------------------------------------------------- GGUF

N, K = 12, 256  # 256: one K-quant superblock per row


def random_k_blocks(kind: T, rows: int, seed: int) -> np.ndarray:
    """Random but valid Q4_K / Q6_K rows (no quantizer for these in gguf-py): random bytes, sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, K // block, size), dtype=np.uint8)
    scales = (rng.random((rows, K // block, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == T.Q4_K:
        raw[:, :, 0:4] = scales.reshape(rows, K // block, 4)  # d, dmin
    else:
        raw[:, :, size - 2 :] = scales[:, :, 0:2]  # d is the block's last field
    return raw.reshape(rows, -1)


def source_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, T]]:
    """name -> (stored array, its GGUF type); quantized arrays are block bytes."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    out = {
        "f32": (w, T.F32),
        "f16": (w.astype(np.float16), T.F16),
        "norm": (rng.standard_normal(K).astype(np.float32), T.F32),
        "q4k": (random_k_blocks(T.Q4_K, N, seed), T.Q4_K),
        "q6k": (random_k_blocks(T.Q6_K, N, seed + 1), T.Q6_K),
    }
    for name, kind in (("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1)):
        out[name] = (quants.quantize(w, kind), kind)
    return out


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, T]]) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, kind) in tensors.items():
        if kind in (T.F32, T.F16):
            writer.add_tensor(name, arr)
        else:
            writer.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tensors = source_tensors()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensors), tensors


def ggml_values(arr: np.ndarray, kind: T) -> torch.Tensor:
    """What ggml itself dequantizes the stored tensor to (gguf-py's reference implementation)."""
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(arr, kind), dtype=np.float32))


@pytest.mark.parametrize(
    "name, fmt", [("f32", "fp32"), ("f16", "fp32"), ("q8_0", "int8"), ("q4_0", "int4"), ("q4_1", "int4")]
)
def test_exact_types_are_served_as_stored(tiny_gguf, name, fmt):
    path, tensors = tiny_gguf
    src = GGUFWeights(path, "auto")
    served = src.get(name)
    expect = ggml_values(*tensors[name])
    if fmt == "fp32":
        assert isinstance(served, torch.Tensor) and served.dtype == torch.float32
        assert torch.equal(served, expect)
    else:
        assert isinstance(served, qg.QuantWeight) and served.fmt == fmt and served.shape == (N, K)
        assert torch.equal(qg.dequantize(served), expect)  # not one weight value changed
    assert list(src.conversions) == [f"{tensors[name][1].name} -> {fmt} (exact)"]


def test_q4_k_keeps_its_4_bit_values_and_rounds_scales_to_fp16(tiny_gguf):
    path, tensors = tiny_gguf
    src = GGUFWeights(path, "auto")
    served = src.get("q4k")
    assert isinstance(served, qg.QuantWeight) and served.fmt == "int4"
    expect = ggml_values(*tensors["q4k"])
    # |w| <= 15 |scale| + |min|; both rounded to fp16 (relative error <= 2^-11 each)
    torch.testing.assert_close(qg.dequantize(served), expect, rtol=0, atol=float(expect.abs().max()) * 2**-10)
    assert list(src.conversions) == ["Q4_K -> int4 (requantized: scales rounded to fp16)"]


def test_q6_k_becomes_int8_within_half_an_int8_step(tiny_gguf):
    path, tensors = tiny_gguf
    src = GGUFWeights(path, "auto")
    served = src.get("q6k")
    assert isinstance(served, qg.QuantWeight) and served.fmt == "int8"
    expect = ggml_values(*tensors["q6k"])
    _, d, _ = qg.unpack(served)
    assert ((qg.dequantize(served) - expect).abs() <= group_view(d, K) * 0.51).all()
    assert list(src.conversions) == ["Q6_K -> int8 (requantized)"]


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0", "q4_0", "q4_1", "q4k", "q6k"])
def test_every_type_dequantizes_to_ggmls_values(tiny_gguf, name):
    path, tensors = tiny_gguf
    assert torch.equal(GGUFWeights(path, "fp32").get(name), ggml_values(*tensors[name]))


@pytest.mark.parametrize("weights, fmt", [("int8", "int8"), ("int4", "int4")])
def test_forced_format_converts_every_matrix_and_keeps_vectors_fp32(tiny_gguf, weights, fmt):
    path, tensors = tiny_gguf
    src = GGUFWeights(path, weights)
    for name in tensors:
        served = src.get(name)
        if name == "norm":
            assert isinstance(served, torch.Tensor) and served.shape == (K,)
            continue
        assert isinstance(served, qg.QuantWeight) and served.fmt == fmt
        expect = ggml_values(*tensors[name])
        _, d, m = qg.unpack(served)
        bound = group_view(d.abs(), K) * 0.51 + 1e-6  # half a step (Q4_0 stores negative d too)
        if m is not None:  # + the fp16 rounding of the min (Q4_K: of its scale and min)
            bound += group_view(m.abs(), K) * 2**-10 + group_view(d.abs(), K) * 15 * 2**-10
        assert ((qg.dequantize(served) - expect).abs() <= bound).all(), name
    assert src.conversions[f"{'Q8_0' if fmt == 'int8' else 'Q4_1'} -> {fmt} (exact)"] == 1
    assert src.conversions[f"F32 -> {fmt} (quantized)"] == 1  # the f32 matrix; the norm stays fp32
    assert src.resident[fmt] == sum(v for k, v in src.resident.items() if k == fmt) > 0


def test_resident_bytes_are_counted_per_format(tiny_gguf):
    path, tensors = tiny_gguf
    src = GGUFWeights(path, "auto")
    for name in tensors:
        src.get(name)
    groups = K // qg.GROUP
    assert src.resident["int4"] == 3 * 2 * groups * 160  # q4_0, q4_1, q4k: 12 rows = 2 panels
    assert src.resident["int8"] == 2 * 2 * groups * 272  # q8_0, q6k
    assert src.resident["fp32"] == (2 * N * K + K) * 4  # f32, f16, norm


def test_unknown_type_fails_naming_it(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q5.gguf", {"ok": (w, T.F32), "odd": (quants.quantize(w, T.Q5_0), T.Q5_0)})
    with pytest.raises(ValueError, match=r"tensor odd has GGUF type Q5_0, which is not supported"):
        GGUFWeights(path)


def test_unknown_type_id_fails_naming_the_tensor_and_the_id(tmp_path):
    w = np.zeros((4, 64), dtype=np.float32)
    path = write_gguf(tmp_path / "odd.gguf", {"odd_tensor": (w, T.F32)})
    data = bytearray(open(path, "rb").read())
    at = data.index(b"odd_tensor") + len("odd_tensor") + 4 + 2 * 8  # after the name: n_dims, two dims, then the type
    assert int.from_bytes(data[at : at + 4], "little") == T.F32
    data[at : at + 4] = (99).to_bytes(4, "little")
    (tmp_path / "odd99.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor odd_tensor has an unknown GGUF type id 99"):
        GGUFWeights(str(tmp_path / "odd99.gguf"))


def test_corrupt_and_truncated_files_fail_clearly(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = open(path, "rb").read()
    bad_magic = tmp_path / "bad.gguf"
    bad_magic.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFWeights(str(bad_magic))
    for cut in (len(data) - 100, len(data) // 2, 60, 10):  # inside the tensor data, in the header
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated|corrupt"):
            GGUFWeights(str(short))
    with pytest.raises(ValueError, match="does not exist"):
        GGUFWeights(str(tmp_path / "missing.gguf"))


def test_bad_weights_setting_is_refused(tiny_gguf):
    with pytest.raises(ValueError, match="WEIGHTS must be one of"):
        GGUFWeights(tiny_gguf[0], "int2")


# ---------------------------------------------------------------- a model's GGUF under Hugging Face names


def tiny_hf_model(model_type: str):
    import transformers

    torch.manual_seed(0)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def gguf_name_of(hf: str, model_type: str) -> str:
    from models.quant import GPT2_BLOCK, GPT2_TOP, LLAMA_BLOCK, LLAMA_TOP

    block, top = (LLAMA_BLOCK, LLAMA_TOP) if model_type == "llama" else (GPT2_BLOCK, GPT2_TOP)
    stem, kind = hf.rsplit(".", 1)
    for g, h in top.items():
        if stem == h:
            return f"{g}.{kind}"
    layer = stem.split(".")[2]
    local = stem.split(".", 3)[3]
    return f"blk.{layer}.{next(g for g, h in block.items() if h == local)}.{kind}"


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_gguf_state_dict_puts_every_weight_back_under_its_hf_name(tmp_path, model_type):
    """Written the way llama.cpp's converter writes (Llama Q/K rows permuted, GPT-2 Conv1D transposed), read back."""
    from models.quant import GPT2_CONV1D, gguf_state_dict, llama_qk_rows

    model = tiny_hf_model(model_type)
    n_head, n_kv = model.config.num_attention_heads, getattr(model.config, "num_key_value_heads", None)
    tensors, expect, types = {}, {}, [T.Q8_0, T.Q4_1, T.Q4_0]
    for i, (name, w) in enumerate(model.state_dict().items()):
        if name.endswith("attn.bias") or name.endswith("masked_bias"):
            continue  # old GPT-2 buffers
        w = w.detach().float().numpy()
        if model_type == "gpt2" and w.ndim == 2 and name.rsplit(".", 1)[0].endswith(GPT2_CONV1D):
            w = w.T  # llama.cpp stores every linear [out, in]
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_head if "q_proj" in name else n_kv
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)
        w = np.ascontiguousarray(w)
        kind = types[i % 3] if w.ndim == 2 else T.F32
        stored = w if kind == T.F32 else quants.quantize(w, kind)
        tensors[gguf_name_of(name, model_type)] = (stored, kind)
        expect[name] = ggml_values(stored, kind)
    path = write_gguf(tmp_path / f"{model_type}.gguf", tensors)
    sd = gguf_state_dict(GGUFWeights(path, "auto"), model.config)
    assert set(sd) == set(expect)
    hf = model.state_dict()
    for name, value in sd.items():
        quantized = isinstance(value, qg.QuantWeight)
        conv1d = model_type == "gpt2" and name.rsplit(".", 1)[0].endswith(GPT2_CONV1D) and name.endswith("weight")
        got = qg.dequantize(value) if quantized else value
        want = expect[name]  # as stored: [out, in]
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            want = want[llama_qk_rows(want.shape[0], n_head if "q_proj" in name else n_kv)]
        if conv1d and not quantized:
            want = want.t()  # fp32 tensors come back in HF's layout; a QuantWeight is always [out, in]
        assert torch.equal(got, want.reshape(got.shape)), name
        # and they are HF's own weights, up to the quantization error
        hf_layout = got.t() if conv1d and quantized else got
        assert (hf_layout - hf[name].float()).abs().max() <= hf[name].abs().max() / 6, name


def test_cat_rows_fuses_exactly_and_mixed_formats_go_to_the_finest():
    from models.quant import cat_rows

    a, b, c = torch.randn(13, 70), torch.randn(5, 70), torch.randn(8, 70)
    qa, qb = quantize(a, "int4"), quantize(b, "int4")
    fused, note = cat_rows([qa, qb])
    assert note is None and fused.fmt == "int4" and fused.shape == (18, 70)
    assert torch.equal(qg.dequantize(fused), torch.cat([qg.dequantize(qa), qg.dequantize(qb)]))
    mixed, note = cat_rows([qa, quantize(c, "int8")])
    assert mixed.fmt == "int8" and note == "fused int4+int8 weights served as int8"
    assert torch.equal(qg.dequantize(mixed)[13:], qg.dequantize(quantize(c, "int8")))
    dense, note = cat_rows([qa, c])
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, torch.cat([qg.dequantize(qa), c]))
    assert note == "fused fp32+int4 weights served as fp32"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_cat_rows_of_whole_panels_concatenates_packed_bytes_exactly(fmt):
    """Parts of 8k rows (QKV, gate+up) fuse by concatenating panels; a ragged last part is allowed."""
    from models.quant import cat_rows

    parts = [quantize(torch.randn(n, 70), fmt) for n in (16, 8, 11)]
    fused, note = cat_rows(parts)
    assert note is None and fused.shape == (35, 70) and fused.data.shape[0] == 2 + 1 + 2
    repacked = qg.pack(fmt, *[torch.cat(p) for p in zip(*(qg.unpack(w)[: 2 if fmt == "int8" else 3] for w in parts))])
    assert torch.equal(fused.data, repacked.data)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_fused_group_shares_one_buffer_and_cat_rows_does_not_copy_it(fmt):
    """``share_storage`` puts a group's packed weights into one buffer; ``cat_rows`` then returns that buffer as the
    fused weight, byte for byte what concatenating copies gives (a load never holds a fused weight twice)."""
    from models.quant import cat_rows, share_storage

    parts = [quantize(torch.randn(n, 70), fmt) for n in (16, 8, 11)]
    want, _ = cat_rows(parts)  # concatenated copies
    assert want.data.data_ptr() not in {p.data.data_ptr() for p in parts}
    sd = dict(zip("qkv", parts))
    share_storage(sd, ["q", "k", "v"])
    assert all(torch.equal(sd[n].data, p.data) and sd[n].shape == p.shape for n, p in zip("qkv", parts))
    fused, note = cat_rows([sd[n] for n in "qkv"])
    assert note is None and fused.shape == want.shape and torch.equal(fused.data, want.data)
    assert fused.data.data_ptr() == sd["q"].data.data_ptr()  # the shared buffer itself
    assert cat_rows([parts[0]])[0] is parts[0]  # one weight: nothing to fuse, nothing copied
    ragged = {"a": quantize(torch.randn(11, 70), fmt), "b": parts[1]}  # a partial panel before the last part
    share_storage(ragged, ["a", "b"])
    assert ragged["a"].data._base is None and ragged["b"] is parts[1]


def test_gguf_state_dict_gives_a_llama_block_fused_groups_in_one_buffer(tmp_path):
    from models.quant import FUSED, gguf_state_dict

    model = tiny_hf_model("llama")
    tensors = {}
    for name, w in model.state_dict().items():
        w = np.ascontiguousarray(w.detach().float().numpy())
        tensors[gguf_name_of(name, "llama")] = (quants.quantize(w, T.Q4_0), T.Q4_0) if w.ndim == 2 else (w, T.F32)
    sd = gguf_state_dict(GGUFWeights(write_gguf(tmp_path / "l.gguf", tensors), "auto"), model.config)
    for layer in range(model.config.num_hidden_layers):
        for group in FUSED["llama"]:
            bases = {sd[f"model.layers.{layer}.{n}.weight"].data._base.data_ptr() for n in group}
            assert len(bases) == 1, (layer, group)
    assert sd["model.layers.0.self_attn.o_proj.weight"].data._base is None  # not fused: its own storage


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_1, T.Q4_0])
def test_a_large_matrix_packed_in_row_slices_is_the_same_weight(tmp_path, monkeypatch, kind):
    """Above PACK_ROWS rows a matrix is repacked a slice at a time into one buffer: the same bytes as all at once,
    the last slice ragged (45 rows: slices of 16, 16, 13)."""
    import models.quant as mq

    w = np.random.default_rng(1).standard_normal((45, 96)).astype(np.float32)
    path = write_gguf(tmp_path / "rows.gguf", {"w": (quants.quantize(w, kind), kind)})
    whole = GGUFWeights(path, "auto").get("w")
    monkeypatch.setattr(mq, "PACK_ROWS", 16)
    sliced = GGUFWeights(path, "auto").get("w")
    assert (sliced.fmt, sliced.shape) == (whole.fmt, whole.shape)
    assert torch.equal(sliced.data, whole.data)
    assert torch.equal(qg.dequantize(sliced), ggml_values(quants.quantize(w, kind), kind))


def mapped_rss_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: address range ... [path]
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_converted_tensor_leaves_the_file_map_out_of_rss(tmp_path):
    """Reading a tensor faults the file's pages into our RSS; once ``get`` has converted it they are dropped (a
    load would otherwise hold the whole file on top of the converted copies until the map goes)."""
    w = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB of pages
    path = write_gguf(tmp_path / "big.gguf", {"w": (w, T.F32), "q": (quants.quantize(w, T.Q8_0), T.Q8_0)})
    src = GGUFWeights(path, "auto")
    assert float(np.asarray(src.tensors["w"].data).sum()) == pytest.approx(float(w.sum()), rel=1e-4)  # faults in
    np.asarray(src.tensors["q"].data).sum()
    assert mapped_rss_kib(path) >= 2048
    assert torch.equal(src.get("w"), torch.from_numpy(w))
    assert isinstance(src.get("q"), qg.QuantWeight)
    assert mapped_rss_kib(path) <= 8  # at most the header's page
    assert torch.equal(src.get("w"), torch.from_numpy(w))  # a second read faults the pages back in: same values
