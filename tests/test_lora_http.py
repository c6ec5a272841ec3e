"""LoRA adapters over HTTP, on a real uvicorn on 127.0.0.1: LORA_MODULES at startup, ``GET /v1/models`` listing them
with ``parent``, ``model`` choosing one on /v1/completions, /v1/chat/completions, /v1/responses and /generate
(tokens equal HF + PEFT's), an unknown name a 404 in OpenAI's shape, ``POST /v1/load_lora_adapter`` /
``unload_lora_adapter`` behind API_KEY with their refusals (a taken name, MAX_LORAS, an adapter that cannot be
served, 409 while requests that chose it are in flight: those finish unharmed).
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import httpx
import pytest

from conftest import assert_error, lora_modules, peft_reference
from live import ThreadServer, poll_until

pytestmark = pytest.mark.model

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def llama(lora_checkpoints):
    return lora_checkpoints("llama")


@pytest.fixture(scope="module")
def server(llama):
    """The tiny Llama with two of its adapters from startup, room for three, behind an API key."""
    from config import Config
    from server import create_app

    model_dir, adapters = llama
    startup = {k: adapters[k] for k in ("all8", "qv16")}
    config = Config(
        model_id=model_dir,
        max_batch_size=4,
        num_threads=2,
        kv_cache_dtype="fp32",
        lora_modules=lora_modules(startup),
        max_loras=3,
        api_key=KEY,
        chat_template=TEMPLATE,
        max_new_tokens_limit=256,
    )
    with ThreadServer(create_app(config=config)) as srv:
        yield srv


@pytest.fixture(scope="module")
def refs(llama):
    model_dir, adapters = llama
    return {name: peft_reference(model_dir, path) for name, path in adapters.items()}


def post(server, path: str, body: dict, headers=AUTH, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout)


def test_models_lists_the_adapters_with_their_base(server, llama):
    model_dir, adapters = llama
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {model_dir, "all8", "qv16"}
    assert cards[model_dir]["parent"] is None
    for name in ("all8", "qv16"):
        assert cards[name]["parent"] == model_dir and cards[name]["root"] == adapters[name], cards[name]


def test_model_chooses_the_adapter_on_every_endpoint(server, refs):
    """/generate, /v1/completions and /v1/chat/completions under ``all8`` and ``qv16``: HF + PEFT's greedy tokens;
    the base's differ."""
    ref = refs["all8"]
    ids = ref.encode("The quick brown fox")
    answers = {}
    for name in ("all8", "qv16"):
        body = {"prompt": ids, "max_new_tokens": 12, "ignore_eos": True, "model": name}
        r = post(server, "/generate", body)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["token_ids"]
        assert answers[name] == refs[name].generate(ids, 12, set()), name
        completion = {"model": name, "prompt": ids, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "n": 2}
        r = post(server, "/v1/completions", completion)  # two choices: the second forks the first's prefill
        assert r.status_code == 200 and r.json()["model"] == name, r.text
        text = ref.tokenizer.decode(answers[name], skip_special_tokens=True)
        assert [c["text"] for c in r.json()["choices"]] == [text, text]
    base = post(server, "/generate", {"prompt": ids, "max_new_tokens": 12, "ignore_eos": True}).json()["token_ids"]
    assert len({tuple(base), tuple(answers["all8"]), tuple(answers["qv16"])}) == 3
    messages = [{"role": "user", "content": "hello there"}]
    prompt = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    chat = {"model": "qv16", "messages": messages, "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["model"] == "qv16", r.text
    want = refs["qv16"].tokenizer.decode(refs["qv16"].generate(prompt, 10, set()), skip_special_tokens=True)
    assert r.json()["choices"][0]["message"]["content"] == want
    body = {"model": "qv16", "input": "hello there", "max_output_tokens": 10, "ignore_eos": True, "temperature": 0}
    r = post(server, "/v1/responses", body)
    assert r.status_code == 200 and r.json()["model"] == "qv16", r.text
    texts = [c["text"] for item in r.json()["output"] if item["type"] == "message" for c in item["content"]]
    assert texts == [want], r.json()["output"]


def test_metrics_name_the_adapters(server):
    from live import metric

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert metric(text, "minibatch:lora_adapters_loaded") >= 2
    info = next(line for line in text.splitlines() if line.startswith("minibatch:lora_requests_info{"))
    assert 'max_lora="3"' in info and info.endswith(" 1.0"), info


def test_unknown_model_is_a_404(server):
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"model": "nope", "prompt": "hi"}),
        ("/v1/responses", {"model": "nope", "input": "hi"}),
    ):
        err = assert_error(post(server, path, body), 404, contains="`nope` does not exist")
        assert err["param"] == "model" and "`all8`" in err["message"], err


def test_load_and_unload(server, llama, refs, tmp_path):
    """Behind the API key; a third adapter loads and serves PEFT's tokens, a fourth is over MAX_LORAS, a taken name
    and an unservable adapter are 400s naming them; unload refuses (409) while a request under the adapter runs, that
    request ends as it would have, then unload frees the slot and the name is a 404."""
    model_dir, adapters = llama
    body = {"lora_name": "mlp4", "lora_path": adapters["mlp4"]}
    assert_error(post(server, "/v1/load_lora_adapter", body, headers={}), 401)
    r = post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and "mlp4" in r.text, r.text
    ids = refs["mlp4"].encode("Once upon a time")
    r = post(server, "/generate", {"prompt": ids, "max_new_tokens": 8, "ignore_eos": True, "model": "mlp4"})
    assert r.json()["token_ids"] == refs["mlp4"].generate(ids, 8, set())
    assert_error(post(server, "/v1/load_lora_adapter", body), 400, contains="'mlp4' is already loaded")
    over = {"lora_name": "more", "lora_path": adapters["all8"]}
    assert_error(post(server, "/v1/load_lora_adapter", over), 400, contains="MAX_LORAS")

    long_request = {"prompt": ids, "max_new_tokens": 200, "ignore_eos": True, "model": "mlp4"}
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=post(server, "/generate", long_request, timeout=300)))
    worker.start()
    poll_until(lambda: server.state.scheduler.unfinished(), 30, "the request to be queued")
    err = assert_error(post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp4"}), 409, contains="in flight")
    assert err["param"] == "lora_name"
    worker.join(300)
    assert result["r"].status_code == 200 and result["r"].json()["token_ids"] == refs["mlp4"].generate(ids, 200, set())

    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp4"})
    assert r.status_code == 200 and "removed" in r.text, r.text
    assert_error(post(server, "/generate", {"prompt": ids, "model": "mlp4"}), 404)
    assert_error(post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp4"}), 404, contains="not loaded")
    dora = str(tmp_path / "dora")
    shutil.copytree(adapters["mlp4"], dora)
    with open(os.path.join(dora, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump({**config, "use_dora": True}, f)
    err = assert_error(
        post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": dora}), 400, contains="DoRA"
    )
    assert "'d'" in err["message"]
    assert_error(post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}), 400)
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "mlp4b", "lora_path": adapters["mlp4"]})
    assert again.status_code == 200, again.text  # the slot was freed
    names = [c["id"] for c in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]]
    assert names == [model_dir, "all8", "qv16", "mlp4b"]
