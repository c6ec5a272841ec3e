"""Quantizing fp32 weights into GGUF blocks, and reading GGUF tensors into our weights (models/quant.py)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from models.gguf.blocks import TYPES, random_blocks  # noqa: E402
from models.kernels import quant_gemm as qg  # noqa: E402
from models.quant import GGUFWeights, quantize  # noqa: E402

# ---------------------------------------------------------------- fp32 -> Q8_0 / Q4_1


def block_view(t: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] per-block values -> [N, K] per-weight values."""
    return t.float().repeat_interleave(32, dim=1)[:, :k]


def scales(w: qg.QuantWeight, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block -> [N, G]."""
    blocks = w.data.view(w.out_features, -1, TYPES[w.fmt].nbytes)
    return blocks[:, :, at : at + 2].contiguous().view(torch.float16)[..., 0]


def test_q8_0_error_is_at_most_half_a_step_per_block():
    w = torch.randn(37, 96) * torch.logspace(-3, 1, 96)  # very different block ranges
    q = quantize(w, "int8")
    assert q.fmt == "Q8_0" and q.data.shape == (37, 3 * 34)
    err = (qg.dequantize(q) - w).abs()
    step = block_view(scales(q, 0), 96)
    assert (err <= step * 0.5 + 1e-3 * step).all()  # fp16 rounding of d adds a sliver at the block's extreme


def test_q4_1_error_is_at_most_half_a_step():
    w = torch.randn(21, 64) + 5.0
    q = quantize(w, "int4")
    assert q.fmt == "Q4_1" and q.data.shape == (21, 2 * 20)
    err = (qg.dequantize(q) - w).abs()
    step = block_view(scales(q, 0), 64)
    assert (err <= step * 0.5 + 2e-3 * step + 5e-3).all()  # plus fp16 rounding of m


def test_quantizing_writes_ggufs_own_blocks():
    """Our quantizers' bytes are GGUF blocks: gguf-py reads them back to our dequantized values."""
    w = torch.randn(8, 64)
    for fmt, kind in (("int8", T.Q8_0), ("int4", T.Q4_1)):
        q = quantize(w, fmt)
        assert torch.equal(qg.dequantize(q), torch.from_numpy(quants.dequantize(q.data.numpy(), kind)))


def test_constant_and_zero_blocks_quantize_exactly():
    w = torch.zeros(8, 64)
    w[:, 32:] = 127 * 2**-8  # Q8_0: d = 2^-8 exactly; Q4_1: m = the value, d = 0
    for fmt in ("int8", "int4"):
        assert torch.equal(qg.dequantize(quantize(w, fmt)), w)


def test_unknown_format_is_refused_and_partial_blocks_fall_back_to_f16():
    with pytest.raises(ValueError, match="int3"):
        quantize(torch.zeros(8, 32), "int3")
    w = torch.randn(8, 70, generator=torch.Generator().manual_seed(0))
    for fmt in ("int8", "int4"):  # rows of 70: no 32-block type holds them (llama-quantize's fallback: F16)
        q = quantize(w, fmt)
        assert q.fmt == "F16" and torch.equal(qg.dequantize(q), w.half().float())


# ---------------------------------------------------------------- GGUF

N, K = 12, 256  # 256: one K-quant superblock per row


def stored(kind: str, w: np.ndarray, rng) -> np.ndarray:
    """The array a GGUF stores for ``w`` at ``kind``: gguf-py's quantizer where it has one, else random blocks."""
    if kind in ("F32", "F16"):
        return w.astype(np.float32 if kind == "F32" else np.float16)
    try:
        return quants.quantize(w, T[kind])
    except NotImplementedError:
        return random_blocks(kind, w.size // TYPES[kind].block, rng, 0.01).reshape(w.shape[0], -1)


def source_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, T]]:
    """name -> (stored array, its GGUF type): a [N, K] matrix of every type we serve, and a norm."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    out = {kind.lower(): (stored(kind, w, rng), T[kind]) for kind in TYPES}
    out["norm"] = (rng.standard_normal(K).astype(np.float32), T.F32)
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


@pytest.mark.parametrize("kind", list(TYPES))
def test_every_type_is_served_in_its_own_blocks(tiny_gguf, kind):
    """WEIGHTS=auto: a matrix keeps its file's bytes (F32 comes as an fp32 tensor, the same bytes), dequantizing to
    gguf-py's values bit for bit."""
    path, tensors = tiny_gguf
    src = GGUFWeights(path, "auto")
    arr, t = tensors[kind.lower()]
    served = src.get(kind.lower())
    expect = ggml_values(arr, t)
    if kind == "F32":
        assert isinstance(served, torch.Tensor) and torch.equal(served, expect)
    else:
        assert isinstance(served, qg.QuantWeight) and served.fmt == kind and served.shape == (N, K)
        assert np.array_equal(served.data.numpy(), np.ascontiguousarray(arr).view(np.uint8).reshape(N, -1))
        assert torch.equal(qg.dequantize(served).view(torch.int32), expect.view(torch.int32))
    assert list(src.conversions) == [f"{kind} -> {'fp32' if kind == 'F32' else kind} (exact)"]
    assert sum(src.resident.values()) == np.asarray(arr).nbytes  # resident bytes = the file's tensor bytes


@pytest.mark.parametrize("name", [*(k.lower() for k in TYPES), "norm"])
def test_every_type_dequantizes_to_ggmls_values(tiny_gguf, name):
    path, tensors = tiny_gguf
    assert torch.equal(GGUFWeights(path, "fp32").get(name), ggml_values(*tensors[name]))


@pytest.mark.parametrize("weights, kind", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_forced_format_converts_every_matrix_and_keeps_vectors_fp32(tiny_gguf, weights, kind):
    path, tensors = tiny_gguf
    src = GGUFWeights(path, weights)
    for name in tensors:
        served = src.get(name)
        if name == "norm":
            assert isinstance(served, torch.Tensor) and served.shape == (K,)
            continue
        assert isinstance(served, qg.QuantWeight) and served.fmt == kind
        expect = ggml_values(*tensors[name])
        if name == kind.lower():  # the file's own blocks, as they are
            assert torch.equal(qg.dequantize(served), expect)
            continue
        d = block_view(scales(served, 0).abs(), K)
        bound = d * 0.51 + 1e-6 + (block_view(scales(served, 2).abs(), K) * 2**-10 if kind == "Q4_1" else 0)
        assert ((qg.dequantize(served) - expect).abs() <= bound).all(), name
    assert src.conversions[f"{kind} -> {kind} (exact)"] == 1
    assert src.conversions[f"F32 -> {kind} (quantized)"] == 1  # the f32 matrix; the norm stays fp32
    assert src.conversions[f"Q4_K -> {kind} (requantized)"] == 1


def test_a_type_no_kernel_serves_fails_naming_the_tensor_and_its_type(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    odd = np.random.default_rng(1).integers(0, 256, (4, 66), dtype=np.uint8)  # one IQ2_XXS super-block a row
    path = write_gguf(tmp_path / "iq2.gguf", {"ok": (w, T.F32), "blk.0.odd": (odd, T.IQ2_XXS)})
    with pytest.raises(ValueError, match=r"tensor blk.0.odd has GGUF type IQ2_XXS, which is not supported") as info:
        GGUFWeights(path)
    assert "\n" not in str(info.value) and "Q4_K" in str(info.value)


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
    from models.gguf.names import GPT2_BLOCK, GPT2_TOP, LLAMA_BLOCK, LLAMA_TOP

    block, top = (LLAMA_BLOCK, LLAMA_TOP) if model_type == "llama" else (GPT2_BLOCK, GPT2_TOP)
    stem, kind = hf.rsplit(".", 1)
    for g, h in top.items():
        if stem == h:
            return f"{g}.{kind}"
    layer = stem.split(".")[2]
    local = stem.split(".", 3)[3]
    return f"blk.{layer}.{next(g for g, h in block.items() if h == local)}.{kind}"


STATE_TYPES = [T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q5_1, T.F16, T.BF16, T.F32]  # the ones gguf-py quantizes at K = 64


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_gguf_state_dict_puts_every_weight_back_under_its_hf_name(tmp_path, model_type):
    """Written the way llama.cpp's converter writes (Llama Q/K rows permuted, GPT-2 Conv1D transposed), read back."""
    from models.gguf.names import GPT2_CONV1D, llama_qk_rows
    from models.gguf_model import gguf_state_dict

    model = tiny_hf_model(model_type)
    n_head, n_kv = model.config.num_attention_heads, getattr(model.config, "num_key_value_heads", None)
    tensors, expect = {}, {}
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
        kind = STATE_TYPES[i % len(STATE_TYPES)] if w.ndim == 2 else T.F32
        data = w if kind == T.F32 else w.astype(np.float16) if kind == T.F16 else quants.quantize(w, kind)
        tensors[gguf_name_of(name, model_type)] = (data, kind)
        expect[name] = ggml_values(data, kind)
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


def test_cat_rows_fuses_exactly_and_mixed_types_stay_in_their_own_blocks():
    from models.quant import cat_rows

    a, b, c = torch.randn(13, 64), torch.randn(5, 64), torch.randn(8, 64)
    qa, qb, qc = quantize(a, "int4"), quantize(b, "int4"), quantize(c, "int8")
    fused, note = cat_rows([qa, qb])
    assert note is None and isinstance(fused, qg.QuantWeight) and fused.fmt == "Q4_1" and fused.shape == (18, 64)
    assert torch.equal(fused.data, torch.cat([qa.data, qb.data]))
    mixed, note = cat_rows([qa, qb, qc])
    assert isinstance(mixed, qg.QuantParts) and mixed.fmt == "Q4_1+Q8_0" and mixed.shape == (26, 64)
    assert note == "fused Q4_1+Q8_0 weights, each in its own blocks"
    assert torch.equal(qg.dequantize(mixed), torch.cat([qg.dequantize(q) for q in (qa, qb, qc)]))
    dense, note = cat_rows([a, c])
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, torch.cat([a, c])) and note is None
    with_fp32, _ = cat_rows([qa, c])  # an fp32 part beside a quantized one: its F32 blocks, the same bytes
    assert with_fp32.fmt == "Q4_1+F32" and torch.equal(qg.dequantize(with_fp32)[13:], c)


def test_a_fused_group_shares_one_buffer_and_cat_rows_does_not_copy_it():
    """``share_storage`` puts a group's weights of one type into one buffer; ``cat_rows`` then returns that buffer as
    the fused weight, byte for byte what concatenating copies gives (a load never holds a fused weight twice)."""
    from models.quant import cat_rows, share_storage

    parts = [quantize(torch.randn(n, 64), "int4") for n in (16, 8, 11)]
    want, _ = cat_rows(parts)  # concatenated copies
    assert want.data.data_ptr() not in {p.data.data_ptr() for p in parts}
    sd = dict(zip("qkv", parts))
    share_storage(sd, ["q", "k", "v"])
    assert all(torch.equal(sd[n].data, p.data) and sd[n].shape == p.shape for n, p in zip("qkv", parts))
    fused, note = cat_rows([sd[n] for n in "qkv"])
    assert note is None and fused.shape == want.shape and torch.equal(fused.data, want.data)
    assert fused.data.data_ptr() == sd["q"].data.data_ptr()  # the shared buffer itself
    assert cat_rows([parts[0]])[0] is parts[0]  # one weight: nothing to fuse, nothing copied
    v = quantize(torch.randn(8, 64), "int8")
    mixed = {"q": parts[0], "k": parts[1], "v": v}
    share_storage(mixed, ["q", "k", "v"])  # Q and K share a buffer, V keeps its own
    assert mixed["q"].data._base is mixed["k"].data._base is not None and mixed["v"] is v
    fused, _ = cat_rows([mixed[n] for n in "qkv"])
    assert isinstance(fused, qg.QuantParts) and fused.parts[0].data.data_ptr() == mixed["q"].data.data_ptr()


def test_gguf_state_dict_gives_a_llama_block_fused_groups_in_one_buffer(tmp_path):
    from models.gguf_model import fused_groups, gguf_state_dict

    model = tiny_hf_model("llama")
    tensors = {}
    for name, w in model.state_dict().items():
        w = np.ascontiguousarray(w.detach().float().numpy())
        tensors[gguf_name_of(name, "llama")] = (quants.quantize(w, T.Q4_0), T.Q4_0) if w.ndim == 2 else (w, T.F32)
    sd = gguf_state_dict(GGUFWeights(write_gguf(tmp_path / "l.gguf", tensors), "auto"), model.config)
    for layer in range(model.config.num_hidden_layers):
        for group in fused_groups("llama"):
            bases = {sd[f"model.layers.{layer}.{n}.weight"].data._base.data_ptr() for n in group}
            assert len(bases) == 1, (layer, group)
    assert sd["model.layers.0.self_attn.o_proj.weight"].data._base is None  # not fused: its own storage


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
