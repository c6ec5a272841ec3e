"""The GGUF types' block layouts and reference dequantization (models/gguf/blocks.py), torch-free: each is gguf-py's
``dequantize`` bit for bit (what transformers loads a GGUF with), on blocks with random valid contents."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

from models.gguf.blocks import GGML_TYPES, TYPES, dequantize, random_blocks  # noqa: E402


def test_the_type_table_is_ggmls():
    """Ids, block sizes and bytes of every ggml type (the reader needs them for types we do not serve, to name them)."""
    want = {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert GGML_TYPES == want
    for t in TYPES.values():
        assert GGML_TYPES[t.type_id] == (t.name, t.block, t.nbytes)


@pytest.mark.parametrize("kind", list(TYPES))
def test_reference_dequantization_is_gguf_pys_bit_for_bit(kind):
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    t = TYPES[kind]
    for scale in (1e-3, 1.0, 300.0):  # small, unit and large scales (the products stay exact in fp32)
        raw = random_blocks(kind, 4 * (512 // t.block if t.block > 1 else 64), rng, scale).reshape(4, -1)
        ours = dequantize(raw, kind)
        stored = raw.view(np.float32) if kind == "F32" else raw.view(np.float16) if kind == "F16" else raw
        theirs = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind])
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        assert np.array_equal(ours.view(np.uint32), np.ascontiguousarray(theirs, np.float32).view(np.uint32))


@pytest.mark.parametrize("kind", list(TYPES))
def test_random_blocks_are_valid(kind):
    """Finite scales of about the scale asked for: every weight finite."""
    raw = random_blocks(kind, 64, np.random.default_rng(0), 0.1)
    assert raw.shape == (64, TYPES[kind].nbytes) and raw.dtype == np.uint8
    assert np.isfinite(dequantize(raw.reshape(1, -1), kind)).all()


def transformers_dequantizer():
    """transformers' own GGUF dequantization (torch), what ``from_pretrained(gguf_file=...)`` loads with, or None."""
    try:
        from transformers.integrations.gguf import dequant
    except ImportError:
        return None
    return dequant


@pytest.mark.parametrize("kind", list(TYPES))
def test_transformers_dequantizes_to_the_same_bits(kind):
    """Where transformers dequantizes a type itself (not F32 / F16 / BF16, nor Q5_0 / Q5_1, which it lacks), its values
    are gguf-py's and ours bit for bit: HF on transformers' load of a file is the reference our kernels match."""
    torch = pytest.importorskip("torch")
    dequant = transformers_dequantizer()
    t = TYPES[kind]
    if dequant is None or t.type_id not in dequant.GGML_BLOCK:
        pytest.skip(f"transformers has no dequantizer of its own for {kind}")
    raw = random_blocks(kind, 64, np.random.default_rng(t.type_id), 0.5)
    theirs = dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), t.type_id).numpy()
    assert np.array_equal(theirs.view(np.uint32), dequantize(raw.reshape(1, -1), kind).reshape(-1).view(np.uint32))
