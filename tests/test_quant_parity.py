"""Quantized weights end to end: greedy tokens through the engine (int8 / int4 kernels, continuous batching
with mid-stream joins) equal HF ``generate`` on the same dequantized weights, for GPT-2 and Llama.

The reference model gets ``models.quant.dequantize_hf_model_``: every weight the engine quantizes
replaced by its dequantized value, so any difference left is the kernels', not the quantization's.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.kernels.quant_gemm import WEIGHTS_TYPES  # noqa: E402
from models.quality import perplexity  # noqa: E402
from models.quant import dequantize_hf_model_  # noqa: E402
from scripts.make_test_model import build_checkpoint  # noqa: E402

from conftest import PROMPTS, Reference, drive, expected, make_engine, seqs_for  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("llama_q")), arch="llama", seed=2, tied=False)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def arch_dir(request, tiny_model_dir, tiny_llama_dir) -> str:
    return tiny_model_dir if request.param == "gpt2" else tiny_llama_dir


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_engine_matches_hf_on_dequantized_weights(arch_dir, fmt):
    ref = Reference(arch_dir)
    dequantize_hf_model_(ref.model, fmt)
    engine = make_engine(arch_dir, capacity=4, weights=fmt)
    kind = WEIGHTS_TYPES[fmt]  # int8: Q8_0 blocks, int4: Q4_1
    assert all(lin.fmt == kind for block in engine.model.blocks for lin in block.linears())
    assert engine.model.lm_head.fmt == kind
    assert len(engine.encode(PROMPTS[4])) + 4 > 16  # the join's forward takes the tile path, decode the direct one
    first = seqs_for(ref, PROMPTS[:4], [3, 17, 1, 30], ignore_eos=True)
    joiners = seqs_for(ref, PROMPTS[4:], [9, 5], ignore_eos=True)
    drive(engine, [(0, first), (6, joiners)])  # joiners prefill inside running decode steps
    for seq in first + joiners:
        assert seq.output_token_ids == expected(ref, seq, set()), (fmt, seq.prompt_token_ids)


def test_one_packed_copy_per_weight_and_resident_bytes(tiny_llama_dir):
    """int4 holds each linear once (no oneDNN, no small-gemm copy): about 0.625 bytes per weight."""
    fp32 = make_engine(tiny_llama_dir, capacity=2, weights="fp32").model
    int4 = make_engine(tiny_llama_dir, capacity=2, weights="int4").model
    for lin in [lin for b in int4.blocks for lin in b.linears()] + [int4.lm_head]:
        assert lin.quant is not None and lin.weight is None and lin.small is None
    n_weights = sum(lin.out_features * lin.in_features for b in int4.blocks for lin in b.linears())
    n_weights += int4.lm_head.out_features * int4.lm_head.in_features + int4.embed.out_features * int4.embed.in_features
    assert sum(int4.resident_weights().values()) < 0.7 * n_weights  # padding of the tiny shapes included
    assert sum(fp32.resident_weights().values()) >= 4 * n_weights


def test_perplexity_equals_hf_and_does_not_depend_on_the_chunk(tiny_model_dir):
    """fp32 perplexity through our forward (chunked prefill, logits at every position) = HF's full forward."""
    text = PROMPTS[4] + " " + PROMPTS[5]
    engine = make_engine(tiny_model_dir, capacity=1, weights="fp32")
    ids = engine.encode(text)
    ours = [perplexity(engine.model, ids, chunk) for chunk in (64, 7, 1)]
    hf = Reference(tiny_model_dir).model
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    ref = math.exp(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item())
    for value in ours:
        assert value == pytest.approx(ref, rel=1e-5), (ours, ref)


def test_int8_perplexity_within_one_percent_of_fp32(tiny_model_dir):
    text = PROMPTS[4] + " " + PROMPTS[1] + " " + PROMPTS[3] + " " + PROMPTS[5]
    scores = {}
    for fmt in ("fp32", "int8"):
        engine = make_engine(tiny_model_dir, capacity=1, weights=fmt)
        scores[fmt] = perplexity(engine.model, engine.encode(text))
    assert math.isfinite(scores["fp32"]) and scores["fp32"] > 1
    assert abs(scores["int8"] / scores["fp32"] - 1) < 0.01, scores


def test_quality_workload_scores_every_format_on_the_same_tokens(tiny_model_dir, capsys):
    """scripts/bench/quality.py (``--workload quality``) on the tiny model: rows, ratios, the int8 check, a table."""
    from scripts.bench.quality import QUICK_TOKENS, quality_workload

    assert quality_workload(["seed"], tiny_model_dir, False, True) is None  # not asked for: nothing runs
    result = quality_workload(["quality"], tiny_model_dir, False, True)
    # each quantized format also with int8 activations (ACTIVATIONS=int8: the integer-dot path), against its exact row
    assert [r["weights"] for r in result["rows"]] == ["fp32", "int8", "int4", "int8+a8", "int4+a8"]
    assert result["tokens"] == QUICK_TOKENS and all(r["tokens"] == QUICK_TOKENS for r in result["rows"])
    fp32, int8, int4, int8_a8, int4_a8 = result["rows"]
    for row, exact in ((int8_a8, int8), (int4_a8, int4)):
        assert row["activations"] == "int8" and row["resident_weight_mib"] == exact["resident_weight_mib"]
        assert row["vs_exact_pct"] == (row["perplexity"] / exact["perplexity"] - 1) * 100
    assert fp32["vs_fp32_pct"] == 0 and fp32["resident_weight_mib"] > int8["resident_weight_mib"]
    assert int8["resident_weight_mib"] > int4["resident_weight_mib"]
    assert result["checks"]["int8_within_1pct_of_fp32"] is (abs(int8["vs_fp32_pct"]) <= 1)
    assert "== workload quality ==" in capsys.readouterr().out


def test_quantized_weights_refuse_a_gpu_device(tiny_model_dir):
    from models.layers import linear_factory

    with pytest.raises(ValueError, match="CPU only"):
        linear_factory(torch.device("cuda"), 4, False, "int8")
