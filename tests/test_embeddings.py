"""Embeddings (``POST /v1/embeddings``, ``core/pooling.py``): prompt-only sequences in the generation batches, their
final hidden states (after the final norm) pooled and L2-normalized.

The gate: vectors equal HF's last ``hidden_states`` (``output_hidden_states=True``) pooled the same way within 1e-4, on
tiny random GPT-2 and Llama checkpoints, on both runtimes (the torch forward and the native whole-step kernel), with
prompts chunked and split over kernel calls, beside a generating sequence whose greedy tokens do not change. Then the
server through the openai client (base64, its default, and float) and LangChain's ``OpenAIEmbeddings``, as they
really send their requests.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from config import Config
from core.sequence import Sequence, SequenceStatus
from engine import FakeEngine
from server import create_app

from conftest import bounded, drive, make_engine, need_native, schedule_all, serving
from live import ThreadServer, openai_client

TIMEOUT = 120.0
PROMPTS = [
    "Hello world, this is a test of embeddings",
    "a",
    "The quick brown fox jumps over the lazy dog again and again and again",
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoint(request, tmp_path_factory):
    """A tiny random checkpoint, its tokenizer and HF model (the reference)."""
    import transformers

    from scripts.make_test_model import build_checkpoint

    out = build_checkpoint(
        str(tmp_path_factory.mktemp(f"embed_{request.param}")), shape="tiny", seed=0, arch=request.param
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    return out, tokenizer, model


def hf_embedding(model, ids: list[int], pooling: str) -> np.ndarray:
    """HF's last hidden states (after the final norm) of ``ids``, pooled and L2-normalized, in float64."""
    import torch

    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
    vector = states.mean(axis=0) if pooling == "mean" else states[-1]
    return vector / np.linalg.norm(vector)


def build(runtime: str, model_dir: str, **config):
    if runtime == "torch":
        return make_engine(model_dir, capacity=4, kv_block_size=4, **config)
    need_native()
    from models.runtime import NativeEngine

    base = {"max_batch_size": 4, "num_threads": 2, "kv_cache_dtype": "fp32", "kv_block_size": 4}
    return NativeEngine(Config(model_id=model_dir, runtime="native", weights="fp32", **{**base, **config}))


@pytest.mark.model
@pytest.mark.parametrize("runtime", ["torch", "native"])
@pytest.mark.parametrize("budget", [0, 7], ids=["whole", "chunked"])
def test_vectors_equal_hf_pooled_hidden_states(checkpoint, runtime, budget):
    """Both poolings, prompts of 1 to ~25 tokens whole (past the native kernel's 16 fp32 rows a call: split over
    calls) or in chunks of 7, beside a generating sequence whose greedy tokens are those it gets alone."""
    model_dir, tokenizer, model = checkpoint
    engine = build(runtime, model_dir, max_num_batched_tokens=budget)
    alone = Sequence(prompt_token_ids=tokenizer.encode("Once upon"), max_new_tokens=6)
    drive(engine, [(0, [alone])])
    for pooling in ("mean", "last"):
        seqs = [Sequence(prompt_token_ids=tokenizer.encode(p), max_new_tokens=0, pooling=pooling) for p in PROMPTS]
        beside = Sequence(prompt_token_ids=tokenizer.encode("Once upon"), max_new_tokens=6)
        drive(engine, [(0, [seqs[0], beside]), (1, seqs[1:])])
        assert beside.output_token_ids == alone.output_token_ids
        for seq in seqs:
            assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.output_token_ids == []
            assert seq.embedding.dtype == np.float32 and abs(np.linalg.norm(seq.embedding) - 1) < 1e-5
            np.testing.assert_allclose(seq.embedding, hf_embedding(model, seq.prompt_token_ids, pooling), atol=1e-4)
    assert engine.planner.blocks.is_all_free()


@pytest.mark.model
@pytest.mark.parametrize("runtime", ["torch", "native"])
def test_an_embedding_fills_the_prefix_cache_and_last_pooling_reads_it(checkpoint, runtime):
    """What an embedding computes enters the prefix cache: a generating prompt with the same start finds it, and a
    ``last``-pooled embedding of the same text computes only its last block, with the same vector."""
    model_dir, tokenizer, model = checkpoint
    engine = build(runtime, model_dir)
    ids = tokenizer.encode(PROMPTS[2])
    drive(engine, [(0, [Sequence(prompt_token_ids=ids, max_new_tokens=0, pooling="mean")])])
    hits = engine.stats()["prefix_cache_hits"]
    chat = Sequence(prompt_token_ids=ids + tokenizer.encode(" ok"), max_new_tokens=2)
    again = Sequence(prompt_token_ids=ids, max_new_tokens=0, pooling="last")
    drive(engine, [(0, [chat]), (1, [again])])
    assert chat.num_cached_tokens == len(ids) // 4 * 4 and again.num_cached_tokens == (len(ids) - 1) // 4 * 4
    assert engine.stats()["prefix_cache_hits"] > hits
    np.testing.assert_allclose(again.embedding, hf_embedding(model, ids, "last"), atol=1e-4)


def test_a_preempted_embedding_recomputes_to_the_same_vector():
    """A pool so small that the long embedding is preempted while it prefills in chunks: readmitted, it starts over
    and its vector is the one it gets alone (the fake's hidden states depend on every token and position)."""
    ids = list(range(1, 61))
    alone = Sequence(prompt_token_ids=ids, max_new_tokens=0, pooling="mean")
    drive(FakeEngine(capacity=4, block_size=4, max_num_batched_tokens=8), [(0, [alone])])
    engine = FakeEngine(capacity=4, num_blocks=20, block_size=4, max_num_batched_tokens=8, check_kv=True)
    squeezed = Sequence(prompt_token_ids=ids, max_new_tokens=0, pooling="mean")
    runners = [Sequence(prompt_token_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True) for _ in range(2)]
    schedule_all(engine, [*runners, squeezed])
    assert engine.stats()["num_preemptions"] > 0 and squeezed.status is SequenceStatus.FINISHED_STOPPED
    np.testing.assert_allclose(squeezed.embedding, alone.embedding, rtol=1e-6)
    assert engine.planner.blocks.is_all_free()


# --- the server, through real clients ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_server(tiny_model_dir):
    config = Config(model_id=tiny_model_dir, served_model_name="tiny-gpt2", max_batch_size=4, kv_block_size=4)
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def gpt2_ref(tiny_model_dir):
    import transformers

    return (
        transformers.AutoTokenizer.from_pretrained(tiny_model_dir),
        transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
    )


@pytest.mark.model
def test_openai_client_base64_and_float_texts_and_token_ids(gpt2_server, gpt2_ref):
    tokenizer, model = gpt2_ref
    with openai_client(gpt2_server, TIMEOUT) as c:
        by_text = c.embeddings.create(model="tiny-gpt2", input=PROMPTS)  # base64: the SDK's default
        ids = [tokenizer.encode(p) for p in PROMPTS]
        by_ids = c.embeddings.create(model="tiny-gpt2", input=ids, encoding_format="float")
        one = c.embeddings.create(model="tiny-gpt2", input=ids[0])
    assert [d.index for d in by_text.data] == [0, 1, 2] and by_text.object == "list"
    assert by_text.usage.prompt_tokens == by_text.usage.total_tokens == sum(map(len, ids))
    for i, (a, b) in enumerate(zip(by_text.data, by_ids.data)):
        assert a.embedding == b.embedding  # base64 carries the float32 bits exactly
        np.testing.assert_allclose(a.embedding, hf_embedding(model, ids[i], "mean"), atol=1e-4)
    assert one.data[0].embedding == by_text.data[0].embedding


@pytest.mark.model
def test_langchain_openai_embeddings_as_it_really_sends(gpt2_server, gpt2_ref, tiny_model_dir):
    """LangChain's default tokenizes with tiktoken's cl100k_base (OpenAI's vocabulary, downloaded on first use) and
    sends those token ids: meaningless to another model, so it is told ``check_embedding_ctx_length=False`` (plain
    texts) or ``tiktoken_enabled=False`` with the model's own tokenizer (decoded chunks of text, as sent here)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    tokenizer, model = gpt2_ref
    bodies: list[dict] = []
    recorder = httpx.Client(event_hooks={"request": [lambda r: bodies.append(json.loads(r.read()))]})
    common = dict(model="tiny-gpt2", base_url=f"{gpt2_server.url}/v1", api_key="unused", http_client=recorder)
    plain = langchain_openai.OpenAIEmbeddings(**common, check_embedding_ctx_length=False)
    vectors = plain.embed_documents(PROMPTS)
    query = plain.embed_query(PROMPTS[0])
    assert bodies[0]["input"] == PROMPTS and bodies[0]["encoding_format"] == "base64"
    for text, vector in zip(PROMPTS, vectors):
        np.testing.assert_allclose(vector, hf_embedding(model, tokenizer.encode(text), "mean"), atol=1e-4)
    assert query == vectors[0]
    bodies.clear()
    own = langchain_openai.OpenAIEmbeddings(**common, tiktoken_enabled=False, tiktoken_model_name=tiny_model_dir)
    assert own.embed_documents(PROMPTS[:1]) == vectors[:1]
    assert all(isinstance(x, str) for body in bodies for x in body["input"])


def test_the_api_refuses_what_it_cannot_do():
    """Through the fake (8-wide vectors): dimensions other than the model's, token ids outside the vocabulary,
    empty inputs, too many inputs; the pooling knob changes the vectors."""

    async def body():
        async with serving() as c:
            r = await c.post("/v1/embeddings", json={"input": "x", "dimensions": 4})
            assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
            assert (await c.post("/v1/embeddings", json={"input": "x", "dimensions": 8})).status_code == 200
            r = await c.post("/v1/embeddings", json={"input": [[1, 2], [999]]})
            assert r.status_code == 422 and "input 1" in r.json()["error"]["message"], r.text
            for bad in ("", [], ["a", ""], [[]]):
                assert (await c.post("/v1/embeddings", json={"input": bad})).status_code == 422, bad
            r = await c.post("/v1/embeddings", json={"input": ["a"] * 257})
            assert r.status_code == 422 and "MAX_SEQUENCES_PER_REQUEST" in r.text
            r = await c.post("/v1/embeddings", json={"input": "x", "model": "other"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            mean = (await c.post("/v1/embeddings", json={"input": "abc", "encoding_format": "float"})).json()
            assert len(mean["data"][0]["embedding"]) == 8
        async with serving(embedding_pooling="last") as c:
            last = (await c.post("/v1/embeddings", json={"input": "abc", "encoding_format": "float"})).json()
        fake = FakeEngine()
        rows = fake.hidden_states(Sequence(prompt_token_ids=fake.encode("abc"), max_new_tokens=0), 0, 3)
        for vector, want in ((mean, rows.mean(axis=0)), (last, rows[-1])):
            np.testing.assert_allclose(vector["data"][0]["embedding"], want / np.linalg.norm(want), rtol=1e-6)

    bounded(body)
