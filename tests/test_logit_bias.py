"""``logit_bias``: the sampler's vectorized add (rows without a bias untouched), the tiny real model
under greedy (-100 bans, +100 forces; biased and unbiased rows in one batch each get their solo output),
and the HTTP side: /generate and both /v1 endpoints through httpx and the ``openai`` client, bad keys
and values answered with a 422."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from config import Config
from core.sampling import SamplingParams, apply_logit_bias, sample
from server import create_app

from live import ThreadServer, openai_client

PROMPT = "A journey of a thousand"
MODEL = "tiny-gpt2"
TIMEOUT = 60.0


# --- the sampler ---------------------------------------------------------------------------------------------


def test_apply_logit_bias_adds_to_the_biased_rows_only():
    x = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)
    params = [
        SamplingParams(logit_bias=((3, 5.0), (49, -100.0))),
        SamplingParams(),
        SamplingParams(logit_bias=((0, 0.5),)),
        SamplingParams(),
    ]
    expected = x.astype(np.float64)
    expected[0, 3] += 5.0
    expected[0, 49] -= 100.0
    expected[2, 0] += 0.5
    out = apply_logit_bias(x.copy(), params)
    assert out.dtype == np.float32
    assert np.array_equal(out[1], x[1]) and np.array_equal(out[3], x[3])  # bit for bit: not touched
    assert np.allclose(out, expected, atol=1e-6)  # float32 rounding of the sums


def test_sample_applies_bias_after_penalties_and_leaves_logits_alone():
    logits = np.random.default_rng(1).standard_normal((6, 40)).astype(np.float32)
    logits.flags.writeable = False  # never written
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(logit_bias=((top[0], -100.0),)),  # ban the argmax
        SamplingParams(logit_bias=((7, 100.0),)),  # force 7
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=3, logit_bias=((11, 100.0),)),  # sampled, forced
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(repetition_penalty=1.5, logit_bias=((5, 100.0),)),  # a penalty and a bias
    ]
    prompt_ids = [[1, 2]] * 6
    output_ids = [[5]] * 6
    out = sample(logits, params, prompt_ids, output_ids)
    assert out[0] != top[0] and out[0] == int(np.argsort(-logits[0])[1])
    assert out[1] == 7 and out[2] == top[2] and out[3] == 11 and out[5] == 5
    # Each row's token is what it gets sampled alone (batchmates with biases change nothing).
    for i in range(6):
        assert sample(logits[i : i + 1], params[i : i + 1], prompt_ids[i : i + 1], output_ids[i : i + 1]) == [out[i]]


@pytest.mark.parametrize(
    "bias",
    [((1, 101.0),), ((-1, 1.0),), ((1, 1.0), (1, 2.0)), tuple((i, 1.0) for i in range(301)), ((1.5, 1.0),), [(1, 1.0)]],
)
def test_sampling_params_refuse_bad_biases(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_bias_beyond_the_vocabulary_is_refused_by_the_sampler():
    with pytest.raises(ValueError, match="vocabulary"):
        sample(np.zeros((1, 10), np.float32), [SamplingParams(logit_bias=((10, 1.0),))])


# --- the tiny real model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from models.runtime import HFEngine

    return HFEngine(Config(model_id=tiny_model_dir, max_batch_size=8))


def run_batch(engine, specs: list[tuple[str, dict]], max_new_tokens: int = 12) -> list[list[int]]:
    """Admit one batch (prompt, SamplingParams kwargs) together, step it to the end; the output ids."""
    from core.sequence import Sequence

    seqs = [
        Sequence(engine.encode(p), max_new_tokens, ignore_eos=True, sampling=SamplingParams(**sp)) for p, sp in specs
    ]
    engine.admit(seqs)
    while engine.num_active():
        engine.step()
    return [s.output_token_ids for s in seqs]


def test_greedy_ban_and_force_on_the_tiny_model(engine):
    (plain,) = run_batch(engine, [(PROMPT, {})])
    banned = tuple((t, -100.0) for t in sorted(set(plain)))
    (avoided,) = run_batch(engine, [(PROMPT, {"logit_bias": banned})])
    assert not set(avoided) & set(plain), (plain, avoided)
    forced_token = 123
    (forced,) = run_batch(engine, [(PROMPT, {"logit_bias": ((forced_token, 100.0),)})])
    assert forced == [forced_token] * 12


def test_biased_and_unbiased_rows_in_one_batch_get_their_solo_outputs(engine):
    (plain,) = run_batch(engine, [(PROMPT, {})])
    specs = [
        (PROMPT, {}),
        (PROMPT, {"logit_bias": ((plain[0], -100.0),)}),
        ("The quick brown fox", {}),
        (PROMPT, {"logit_bias": ((42, 100.0),)}),
        ("The quick brown fox", {"temperature": 1.0, "seed": 9, "logit_bias": ((plain[1], 3.0), (17, -2.5))}),
        ("Hello", {"temperature": 1.0, "seed": 4}),
    ]
    together = run_batch(engine, specs)
    solo = [run_batch(engine, [spec])[0] for spec in specs]
    assert together == solo
    assert together[0] == plain and together[1][0] != plain[0] and together[3] == [42] * 12


# --- HTTP: /generate and both /v1 endpoints -------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    config = Config(
        model_id=tiny_model_dir,
        served_model_name=MODEL,
        chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
        max_batch_size=8,
        log_level="WARNING",
    )
    with ThreadServer(create_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live, TIMEOUT) as c:
        yield c


def generate(live, **fields) -> httpx.Response:
    body = {"prompt": PROMPT, "max_new_tokens": 6, "ignore_eos": True, **fields}
    return httpx.post(f"{live.url}/generate", json=body, timeout=TIMEOUT)


def test_generate_and_v1_apply_the_bias(live, client, engine):
    (plain,) = run_batch(engine, [(PROMPT, {})], max_new_tokens=6)
    r = generate(live)
    assert r.json()["token_ids"] == plain
    forced = generate(live, logit_bias={"123": 100})
    assert forced.status_code == 200 and forced.json()["token_ids"] == [123] * 6
    banned = generate(live, logit_bias={str(plain[0]): -100})
    assert banned.json()["token_ids"][0] != plain[0]

    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(prompt=PROMPT, logit_bias={"123": 100}, **kw).choices[0].text
    assert text == forced.json()["text"]
    msg = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(messages=msg, logit_bias={"123": 100}, **kw).choices[0].message.content
    assert chat == forced.json()["text"]


@pytest.mark.parametrize(
    "bias, words",
    [
        ({"x": 1}, "token ids"),
        ({"-3": 1}, "token ids"),
        ({"1": 100.5}, "[-100, 100]"),
        ({"1": -101}, "[-100, 100]"),
        ({"1": "high"}, "number"),
        ({"1": 1, "001": 2}, "twice"),
        ({str(i): 1 for i in range(301)}, "300"),
        ({"999999": 1}, "outside the vocabulary"),
    ],
)
def test_bad_keys_and_values_are_422_everywhere(live, client, bias, words):
    r = generate(live, logit_bias=bias)
    assert r.status_code == 422 and words in r.json()["error"]["message"], r.text
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    assert words in e.value.body["message"] and "logit_bias" in e.value.body["message"] + str(e.value.body["param"])
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logit_bias=bias
        )
