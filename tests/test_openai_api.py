"""The OpenAI-compatible API through the official ``openai`` client, against a real uvicorn server
on 127.0.0.1 serving a locally built tiny GPT-2 with a chat template; plus sampling sanity checks
straight through the engine.

Every request carries a small ``max_tokens``; greedy outputs of the random checkpoint are fixed,
sampled ones are pinned with seeds, so nothing here depends on timing or on torch's RNG.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from config import Config
from server import create_app

from conftest import assert_error_body
from live import ThreadServer, openai_client, poll_until

pytestmark = pytest.mark.model

MODEL = "tiny-gpt2"  # SERVED_MODEL_NAME
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Tell me about the quick brown fox."},
]
# Greedy output of the tiny checkpoint for this prompt is clean text (" and", " new", "in", "isher",
# ...) whose top-3 alternatives all decode to distinct strings, so the legacy top_logprobs dicts
# (keyed by token text) keep all k entries.
CLEAN_PROMPT = "A journey of a thousand"
# Greedy output full of byte tokens that are partial UTF-8 characters: text is held back between
# tokens, which is where streamed and non-streamed answers could drift apart.
BYTES_PROMPT = "The quick brown fox"
NO_EOS = {"ignore_eos": True}
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    config = Config(
        model_id=tiny_model_dir,
        served_model_name=MODEL,
        chat_template=CHAT_TEMPLATE,
        max_batch_size=8,
        max_new_tokens_limit=256,
        log_level="WARNING",
    )
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live, TIMEOUT) as c:
        yield c


def generate(live, prompt: str, max_new_tokens: int, **extra) -> dict:
    r = httpx.post(
        f"{live.url}/generate", json={"prompt": prompt, "max_new_tokens": max_new_tokens, **extra}, timeout=TIMEOUT
    )
    assert r.status_code == 200, r.text
    return r.json()


def rendered_chat(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )


def stream_completion(client, **kw):
    """(text chunks, finish_reason chunks, usage chunks, logprobs of every chunk) of a streamed completion."""
    texts, finishes, usages, lps = [], [], [], []
    for ev in client.completions.create(stream=True, **kw):
        assert ev.object == "text_completion"
        if ev.usage is not None:
            assert ev.choices == []
            usages.append(ev.usage)
            continue
        (choice,) = ev.choices
        texts.append(choice.text)
        lps.append(choice.logprobs)
        if choice.finish_reason is not None:
            finishes.append(choice.finish_reason)
    return texts, finishes, usages, lps


# --- models ----------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client, live):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by
    assert models.data[0].model_dump()["max_model_len"] == live.state.engine.max_context


# --- completions -----------------------------------------------------------------------------------


def test_greedy_completion_equals_generate_with_right_usage(client, live, tokenizer):
    ref = generate(live, BYTES_PROMPT, 20)
    r = client.completions.create(model=MODEL, prompt=BYTES_PROMPT, max_tokens=20, temperature=0)
    (choice,) = r.choices
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert choice.text == ref["text"]
    assert choice.finish_reason == ref["finish_reason"]
    assert r.usage.prompt_tokens == len(tokenizer(BYTES_PROMPT)["input_ids"]) == ref["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == len(ref["token_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("prompt", [BYTES_PROMPT, CLEAN_PROMPT])
def test_streamed_completion_equals_non_streamed_and_reports_usage(client, prompt):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=NO_EOS)
    full = client.completions.create(**kw)
    texts, finishes, usages, _ = stream_completion(client, stream_options={"include_usage": True}, **kw)
    assert "".join(texts) == full.choices[0].text
    assert finishes == ["length"] == [full.choices[0].finish_reason]
    assert len(usages) == 1, "include_usage gives exactly one usage chunk, the last one"
    assert usages[0].model_dump() == full.usage.model_dump()
    assert usages[0].completion_tokens == 16

    texts, finishes, usages, _ = stream_completion(client, **kw)  # no stream_options: no usage chunk
    assert "".join(texts) == full.choices[0].text and finishes == ["length"] and usages == []


def test_completion_from_token_ids(client, live, tokenizer):
    ids = tokenizer(CLEAN_PROMPT)["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_batched_prompts_through_the_client(client, tokenizer):
    """Several prompts in one call (texts, or token-id lists as evaluation harnesses send them, ``[[ids]]``
    even for one): one choice per prompt, in order, each the prompt's solo greedy answer; usage summed."""
    prompts = [CLEAN_PROMPT, BYTES_PROMPT, "Hello"]
    kw = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": NO_EOS}
    solo = [client.completions.create(prompt=p, **kw) for p in prompts]
    token_lists = [tokenizer(p)["input_ids"] for p in prompts]
    for prompt in (prompts, token_lists):
        r = client.completions.create(prompt=prompt, **kw)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.text for c in r.choices] == [s.choices[0].text for s in solo]
        assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solo)
        assert r.usage.completion_tokens == 24
    one = client.completions.create(prompt=[token_lists[0]], **kw)
    assert [c.text for c in one.choices] == [solo[0].choices[0].text]
    # Streamed: chunks carry the index; reassembled per index they are the same texts.
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt=token_lists, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [s.choices[0].text for s in solo]


def test_echo(client):
    kw = dict(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=6, temperature=0, extra_body=NO_EOS)
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == CLEAN_PROMPT + plain
    texts, _, _, _ = stream_completion(client, echo=True, **kw)
    assert texts[0] == CLEAN_PROMPT
    assert "".join(texts) == CLEAN_PROMPT + plain


def test_completion_logprobs(client):
    k, n = 3, 12
    r = client.completions.create(
        model=MODEL, prompt=CLEAN_PROMPT, max_tokens=n, temperature=0, logprobs=k, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == n
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text  # clean text: one piece per token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == k
        assert all(v <= 0 for v in top.values())
        assert list(top.values()) == sorted(top.values(), reverse=True)
        # Greedy picks the most likely token: its logprob is the max of its top list.
        assert token in top
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-5)
        assert math.isclose(top[token], logprob, abs_tol=1e-6)

    none = client.completions.create(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=4, temperature=0, logprobs=0)
    assert none.choices[0].logprobs.top_logprobs == [{}] * none.usage.completion_tokens
    assert len(none.choices[0].logprobs.token_logprobs) == none.usage.completion_tokens

    with pytest.raises(openai.UnprocessableEntityError) as e:  # over MAX_LOGPROBS (5)
        client.completions.create(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=4, logprobs=6)
    assert "logprobs" in e.value.body["message"]


@pytest.mark.parametrize("prompt", [BYTES_PROMPT, CLEAN_PROMPT])
def test_streamed_logprobs_cover_every_token(client, prompt):
    """Tokens whose text is held back (partial UTF-8 characters) still get their logprobs streamed."""
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2, extra_body=NO_EOS)
    full = client.completions.create(**kw).choices[0].logprobs
    _, _, _, lps = stream_completion(client, **kw)
    lps = [lp for lp in lps if lp is not None]
    joined = {
        key: sum((getattr(lp, key) for lp in lps), [])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert len(joined["tokens"]) == 16
    assert joined == {key: getattr(full, key) for key in joined}


# --- chat ------------------------------------------------------------------------------------------


def test_chat_greedy_usage_and_stream(client, live, tokenizer):
    prompt = rendered_chat(tokenizer, MESSAGES)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer(prompt)["input_ids"] == prompt_ids  # so /generate tokenizes it the same way
    ref = generate(live, prompt, 12, ignore_eos=True)

    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=NO_EOS)
    r = client.chat.completions.create(**kw)
    (choice,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == ref["text"]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(ref["token_ids"]) == 12
    assert r.usage.total_tokens == len(prompt_ids) + 12

    roles, content, finishes, usages = [], [], [], []
    for ev in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        assert ev.object == "chat.completion.chunk"
        if ev.usage is not None:
            assert ev.choices == []
            usages.append(ev.usage)
            continue
        (c,) = ev.choices
        if c.delta.role:
            roles.append(c.delta.role)
        content.append(c.delta.content or "")
        if c.finish_reason:
            finishes.append(c.finish_reason)
    assert roles == ["assistant"]
    assert "".join(content) == choice.message.content
    assert finishes == ["length"]
    assert [u.model_dump() for u in usages] == [r.usage.model_dump()]


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)


# --- sampling through the API ----------------------------------------------------------------------


def test_seed_reproducible_across_batchmates(client, live):
    """The same seeded request gives the same text alone and while random requests share its batch."""
    seeded = dict(
        model=MODEL, prompt=CLEAN_PROMPT, max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, extra_body=NO_EOS
    )
    alone = client.completions.create(**seeded)
    assert alone.usage.completion_tokens == 24

    batches: list[frozenset[str]] = []
    sched = live.state.scheduler
    sched.on_tokens = lambda seqs: batches.append(frozenset(s.request_id for s in seqs))
    noise_prompts = ["Once upon a time", "The capital of Italy is", "Prices rose by", "def fibonacci(n):"]
    try:
        with ThreadPoolExecutor(len(noise_prompts)) as pool:
            noise = [
                pool.submit(
                    client.completions.create, model=MODEL, prompt=p, max_tokens=64, temperature=1.3, extra_body=NO_EOS
                )
                for p in noise_prompts
            ]
            poll_until(lambda: live.state.engine.num_active() >= len(noise_prompts), 30, "the random requests to run")
            together = client.completions.create(**seeded)
            for f in noise:
                assert f.result(TIMEOUT).usage.completion_tokens == 64
    finally:
        sched.on_tokens = None
    assert together.choices[0].text == alone.choices[0].text
    shared = [b for b in batches if together.id in b and len(b) > 1]
    assert shared, "the seeded request never shared a step with the random ones"

    other_seed = client.completions.create(**{**seeded, "seed": 4321})
    greedy = client.completions.create(**{**seeded, "temperature": 0})
    assert other_seed.choices[0].text != alone.choices[0].text  # fixed weights and seeds: deterministic
    assert greedy.choices[0].text != alone.choices[0].text


def _boundary_stop(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character stop string straddling a token boundary of ``text``, and where it starts.

    Picks the first boundary (at least 4 characters in) whose surrounding characters are clean
    printable text and where that stop string occurs for the first time."""
    for i in range(1, len(token_ids)):
        b = len(tokenizer.decode(token_ids[:i]))
        if not (4 <= b <= len(text) - 2) or not text.startswith(tokenizer.decode(token_ids[:i])):
            continue
        stop = text[b - 2 : b + 2]
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) == b - 2:
            return stop, b - 2
    raise AssertionError(f"no clean token boundary in {text!r}")


def test_stop_string_split_across_tokens(client, live, tokenizer):
    ref = generate(live, CLEAN_PROMPT, 24, ignore_eos=True)
    stop, cut = _boundary_stop(tokenizer, ref["token_ids"], ref["text"])
    expected = ref["text"][:cut]
    kw = dict(model=MODEL, prompt=CLEAN_PROMPT, max_tokens=24, temperature=0, stop=[stop], extra_body=NO_EOS)

    r = client.completions.create(**kw)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24

    texts, finishes, _, _ = stream_completion(client, **kw)
    assert "".join(texts) == expected
    assert finishes == ["stop"]
    poll_until(lambda: live.state.engine.num_active() == 0, 10, "the stopped sequence to free its slot")


# --- errors ----------------------------------------------------------------------------------------


def assert_openai_error(exc: openai.APIStatusError, status: int, *words: str) -> dict:
    """The client's exception for an error answer: ``status``, OpenAI's error shape (``assert_error_body``)."""
    assert exc.status_code == status
    err = assert_error_body(exc.response.json(), status, *words)
    assert exc.body == err  # the client hands the "error" object over as .body
    return err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    err = assert_openai_error(e.value, 404, "gpt-9", MODEL)
    assert err["param"] == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    assert_openai_error(e.value, 404, "gpt-9")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_sampling_values_are_422(client, kwargs, field):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 2, **kwargs})
    assert_openai_error(e.value, 422, field)


@pytest.mark.parametrize(
    "kwargs, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n")]
)
def test_invalid_chat_sampling_values_are_422(client, kwargs, field):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **{"max_tokens": 2, **kwargs})
    assert_openai_error(e.value, 422, field)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}},
            "response_format",
        ),
        ({"tool_choice": "required"}, "tool_choice"),  # with no tools (tools on any model: test_tools_generic.py)
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_unimplemented_chat_fields_are_400_through_the_client(client, kwargs, field):
    """The client sends these as typed parameters; the answer names the field instead of ignoring it."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
    assert assert_openai_error(e.value, 400, field)["param"] == field


@pytest.mark.parametrize("kwargs, field", [({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of")])
def test_unimplemented_completion_fields_are_400_through_the_client(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
    assert assert_openai_error(e.value, 400, field)["param"] == field


def test_chat_without_a_template_is_400(tiny_model_dir):
    config = Config(model_id=tiny_model_dir, served_model_name=MODEL, max_batch_size=1, log_level="WARNING")
    with ThreadServer(create_app(config)) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            err = assert_openai_error(e.value, 400, "chat template", "CHAT_TEMPLATE")
            assert err["param"] == "messages"
            # Completions need no template.
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


# --- sampling straight through the engine ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from models.runtime import HFEngine

    return HFEngine(Config(model_id=tiny_model_dir, max_batch_size=8))


def run_engine(engine, specs: list[tuple[str, dict]], max_new_tokens: int = 20, logprobs: int | None = None):
    """Admit one batch (prompt, SamplingParams kwargs) and step it to the end; return the sequences."""
    from core.sampling import SamplingParams
    from core.sequence import Sequence

    seqs = [
        Sequence(engine.encode(p), max_new_tokens, ignore_eos=True, sampling=SamplingParams(**sp), logprobs=logprobs)
        for p, sp in specs
    ]
    engine.admit(seqs)
    for _ in range(max_new_tokens):
        if engine.num_active() == 0:
            break
        engine.step()
    assert engine.num_active() == 0 and all(s.is_finished for s in seqs)
    return seqs


def test_engine_top_k_1_and_tiny_top_p_equal_greedy(engine):
    specs = [
        (CLEAN_PROMPT, {}),
        (CLEAN_PROMPT, {"temperature": 1.0, "top_k": 1}),
        (CLEAN_PROMPT, {"temperature": 1.0, "top_p": 1e-6}),
        (CLEAN_PROMPT, {"temperature": 2.0, "top_k": 1, "seed": 5}),
        (CLEAN_PROMPT, {"temperature": 1.0, "top_p": 1e-6, "top_k": 50}),
        (BYTES_PROMPT, {"temperature": 1.0}),  # a random batchmate
    ]
    greedy, *same, _ = run_engine(engine, specs)
    for seq in same:
        assert seq.output_token_ids == greedy.output_token_ids, seq.sampling


def test_engine_fixed_seed_repeats(engine):
    seeded = {"temperature": 1.0, "seed": 7}
    batch = run_engine(
        engine,
        [
            (CLEAN_PROMPT, seeded),
            (BYTES_PROMPT, {"temperature": 1.0}),
            (CLEAN_PROMPT, seeded),
            (CLEAN_PROMPT, {"temperature": 1.0, "seed": 8}),
            (CLEAN_PROMPT, {}),
        ],
    )
    (alone,) = run_engine(engine, [(CLEAN_PROMPT, seeded)])
    a, _, b, other, greedy = batch
    assert a.output_token_ids == b.output_token_ids == alone.output_token_ids
    assert other.output_token_ids != a.output_token_ids
    assert greedy.output_token_ids != a.output_token_ids


def test_engine_top_k_2_samples_only_the_top_two(engine):
    """First tokens under top_k=2 at temperature 1, over 48 seeds: only the two most likely tokens,
    both of them, at about their renormalized probabilities."""
    draws = []
    for batch in range(6):
        seqs = run_engine(
            engine,
            [(CLEAN_PROMPT, {"temperature": 1.0, "top_k": 2, "seed": batch * 8 + i}) for i in range(8)],
            max_new_tokens=1,
            logprobs=2,
        )
        draws += [s.output_token_ids[0] for s in seqs]
    (t1, l1), (t2, l2) = seqs[0].output_logprobs[0].top  # from the raw logits, most likely first
    assert set(draws) == {t1, t2}
    p1 = math.exp(l1) / (math.exp(l1) + math.exp(l2))
    n = len(draws)
    sigma = math.sqrt(p1 * (1 - p1) / n)
    assert abs(draws.count(t1) / n - p1) < 4 * sigma + 1e-9, (draws.count(t1), n, p1)
