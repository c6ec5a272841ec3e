"""lm-evaluation-harness end to end: its ``local-completions`` model against a real uvicorn on 127.0.0.1, with
token-list prompts (``prompt=[[ids], ...]``, several per request), on two tasks written here (YAML + a local
jsonl file, no dataset download): a multiple-choice task (loglikelihood: ``echo``, ``logprobs=1``,
``max_tokens=1``) whose scores must equal those computed from HF's logits directly, and a ``generate_until``
task whose answers must equal HF's greedy ``generate`` cut at the stop string.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from config import Config
from server import create_app

from live import ThreadServer

pytest.importorskip("lm_eval")

MC_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a fox"], "answer": 0},
    {"question": "A journey of a thousand miles", "choices": [" begins", " ends with a single step"], "answer": 0},
    {"question": "def fibonacci(n):", "choices": ["\n    a, b = 0, 1", " return 7", " pass"], "answer": 1},
    {"question": "Numbers: 0 1 2", "choices": [" 3", " 4 5", " banana"], "answer": 0},
    {"question": "The quick brown fox", "choices": [" jumps", " sleeps"], "answer": 1},
]
GEN_DOCS = [
    {"prompt": "Once upon a time", "target": ","},
    {"prompt": "The capital of Italy is", "target": " Rome."},
    {"prompt": "import torch;", "target": " x"},
]
MC_YAML = """task: minibatch_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_YAML = """task: minibatch_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""


def write_task(root, name: str, yaml: str, docs: list[dict]) -> None:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / f"{name}.yaml").write_text(yaml.format(data=data))


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into tokens: the context's trailing spaces move to the
    continuation, and the continuation is what encoding both adds to the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return ctx, whole[len(ctx) :]


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """Sum of log p(continuation token | everything before it), from one HF forward in float64."""
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(context)
    return sum(float(lp[n - 1 + i, t]) for i, t in enumerate(continuation))


def test_lm_eval_local_completions_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from conftest import Reference

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    write_task(tmp_path, "mc", MC_YAML, MC_DOCS)
    write_task(tmp_path, "gen", GEN_YAML, GEN_DOCS)
    config = Config(model_id=tiny_model_dir, max_batch_size=8, max_new_tokens_limit=64)
    with ThreadServer(create_app(config)) as server:
        model_args = (
            f"base_url={server.url}/v1/completions,model={tiny_model_dir},tokenizer={tiny_model_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=120"
        )
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["minibatch_mc", "minibatch_gen"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            batch_size=4,  # 4 prompts per request: token-id lists batched as OpenAI's completions API allows
            log_samples=True,
            apply_chat_template=False,
        )
    ref = Reference(tiny_model_dir)
    tok = ref.tokenizer

    # multiple choice: every choice's loglikelihood equals HF's, and so acc does
    samples = sorted(results["samples"]["minibatch_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_DOCS)
    correct = 0
    for sample, doc in zip(samples, MC_DOCS):
        expected = [hf_loglikelihood(ref.model, *encode_pair(tok, doc["question"], c)) for c in doc["choices"]]
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=2e-4), (doc, got, expected)
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert results["results"]["minibatch_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS))

    # generate_until: HF's greedy continuation, cut at the stop string
    gens = sorted(results["samples"]["minibatch_gen"], key=lambda s: s["doc_id"])
    assert len(gens) == len(GEN_DOCS)
    for sample, doc in zip(gens, GEN_DOCS):
        prompt = tok.encode(doc["prompt"])
        text = tok.decode(ref.generate(prompt, 8, ref.eos), skip_special_tokens=True)
        assert sample["resps"][0][0] == text.split(".")[0], (doc, sample["resps"])
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
