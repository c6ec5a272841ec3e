"""GGUF files of every served type, end to end: greedy tokens over HTTP equal HF ``generate`` on the file's own
dequantized weights, for Llama and GPT-2, on both runtimes, with joins, chunked prefill and preemption; and the
one-line startup errors of files we cannot serve (``python server.py`` and ``uvicorn server:app``).

The files are made from random transformers checkpoints the way users get them (``gguf_files.write_gguf``: the
converter's metadata, names and row order; gguf-py's quantizers or round-to-nearest ones for the types it lacks),
every type in every file placed on different tensors (attention, MLP, embedding, a fused QKV of three types), and
cached under weights/cache. The reference is HF's own model class with transformers' config and tokenizer of the
same file and the file's weights as gguf-py dequantizes them (transformers' own dequantization gives the same bits,
``test_gguf_blocks.py``; it has no Q5_0 / Q5_1).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import cache_key, write_gguf  # noqa: E402

from models.gguf.blocks import TYPES  # noqa: E402

from conftest import Gate, Reference, pool_mb  # noqa: E402
from live import ThreadServer, metric  # noqa: E402

pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "weights", "cache", "gguf-tests")  # git-ignored: files persist between runs
ORDER = ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16"]
ORDER += ["BF16", "F32"]
assert sorted(ORDER) == sorted(TYPES)

# (arch, checkpoint overrides): every matrix's in_features a multiple of 256 (the K-quants' super-block)
CHECKPOINTS = {
    "llama": dict(arch="llama", seed=5, tied=False, overrides={"hidden_size": 256, "intermediate_size": 512}),
    "gpt2": dict(arch="gpt2", seed=6, overrides={"n_embd": 256, "n_layer": 4}),  # 1024 positions, as GPT-2 has
}


def source_hash() -> str:
    """The code that makes the files: a change makes them again."""
    h = hashlib.sha256()
    for rel in ("tests/gguf_files.py", "scripts/make_test_model.py", "models/gguf/blocks.py"):
        with open(os.path.join(ROOT, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def types_for(variant: int):
    """Each matrix's type: the types in ORDER, round-robin over the file's matrices, shifted per variant so that a
    type lands on other tensors in the other file."""
    counter = iter(range(10**6))

    def pick(name: str, shape: tuple[int, ...]) -> str:
        return ORDER[(next(counter) + 7 * variant) % len(ORDER)]

    return pick


def reference_dir(path: str, out: str) -> str:
    """An HF checkpoint of the GGUF at ``path``: transformers' config and tokenizer of the file, and its weights as
    gguf-py dequantizes them (our reader at WEIGHTS=fp32, under HF names and layouts)."""
    from models.gguf_model import gguf_state_dict
    from models.quant import GGUFWeights

    directory, name = os.path.split(path)
    cfg = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = gguf_state_dict(GGUFWeights(path, "fp32"), cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k == "lm_head.weight" or k.endswith("attn.bias") for k in missing), missing
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def gguf_case(arch: str, variant: int) -> tuple[str, str]:
    """(the GGUF file, its reference checkpoint directory), made once and cached."""
    from scripts.make_test_model import build_checkpoint

    key = cache_key(arch, variant, CHECKPOINTS[arch], ORDER, source_hash())
    out = os.path.join(CACHE, f"{arch}-{variant}-{key}")
    path, ref = os.path.join(out, f"{arch}-mixed-{variant}.gguf"), os.path.join(out, "reference")
    if not os.path.isfile(os.path.join(out, "done")):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        hf = build_checkpoint(os.path.join(out, "hf"), **CHECKPOINTS[arch])
        write_gguf(hf, path, types_for(variant))
        reference_dir(path, ref)
        open(os.path.join(out, "done"), "w").close()
    return path, ref


@pytest.fixture(
    scope="module", params=[("llama", 0), ("llama", 1), ("gpt2", 0), ("gpt2", 1)], ids=lambda p: f"{p[0]}{p[1]}"
)
def case(request):
    return gguf_case(*request.param)


def test_every_type_lands_in_every_file(case):
    """The file holds all 15 types, a fused linear of several types, and the reader sees each tensor as written."""
    from models.gguf.reader import open_gguf

    path, _ = case
    kinds = {t.type_name for t in open_gguf(path) if len(t.shape) == 2}
    assert kinds == set(TYPES), sorted(set(TYPES) - kinds)


PROMPT_LENGTHS = [3, 17, 9, 1, 26, 12, 5, 21, 8]  # ragged: chunked over several steps, joining while others decode
BUDGETS = [14, 6, 11, 19, 4, 9, 16, 7, 12]


def prompts(ref: Reference) -> list[list[int]]:
    text = " ".join(["The quick brown fox jumps over the lazy dog. Once upon a time, in a small village"] * 3)
    ids = ref.encode(text)
    return [ids[i : i + n] for i, n in enumerate(PROMPT_LENGTHS)]


async def generate_all(url: str, requests: list[dict], gate: Gate) -> list[dict]:
    """The first five at once, the rest while they decode (joins), each answered once. The engine's first step
    waits on ``gate`` until the server holds all of the first five: on a fast machine the first would otherwise
    finish before the fifth arrives, and the pool would never run short (no preemption to test)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(body: dict, delay: float) -> dict:
            await asyncio.sleep(delay)
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        async def open_when_five_are_in() -> None:
            for _ in range(600):
                text = (await client.get("/metrics")).text
                held = metric(text, "minibatch:num_requests_running") + metric(text, "minibatch:num_requests_waiting")
                if held >= 5:
                    break
                await asyncio.sleep(0.01)
            gate.open.set()

        delays = [0.0 if i < 5 else 0.3 + 0.1 * i for i in range(len(requests))]
        answers = asyncio.gather(*(one(body, delay) for body, delay in zip(requests, delays)))
        await open_when_five_are_in()
        return await answers


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_greedy_parity_over_http(case, runtime):
    """9 ragged prompts on 4 slots, prefill chunked 6 tokens a step (riding with decode rows), a KV pool of 10
    blocks of 4 tokens (sequences preempted and recomputed): every token is HF's greedy token on the file's
    dequantized weights."""
    from config import Config
    from server import create_app

    path, ref_dir = case
    if runtime == "torch" and path.endswith("-1.gguf"):
        pytest.skip("the torch runtime runs one file per architecture (CI time); the native runtime runs both")
    ref = Reference(ref_dir)
    requests = [{"prompt": p, "max_new_tokens": n, "ignore_eos": True} for p, n in zip(prompts(ref), BUDGETS)]
    config = Config(
        model_id=path,
        weights="auto",
        runtime=runtime,
        max_batch_size=4,
        num_threads=2,
        kv_block_size=4,
        kv_cache_mb=pool_mb(ref_dir, 10, 4),
        max_num_batched_tokens=6,
    )
    with ThreadServer(create_app(config), ready_timeout=600) as server:
        engine = server.state.engine
        assert type(engine).__name__ == ("NativeEngine" if runtime == "native" else "HFEngine")
        gate, execute = Gate(), engine.execute
        engine.execute = lambda plan: (gate.wait(), execute(plan))[1]
        answers = asyncio.run(generate_all(server.url, requests, gate))
        import httpx

        preemptions = metric(httpx.get(server.url + "/metrics").text, "minibatch:num_preemptions_total")
    for body, answer in zip(requests, answers):
        want = ref.generate(body["prompt"], body["max_new_tokens"], set())
        assert answer["token_ids"] == want, (runtime, len(body["prompt"]))
    assert preemptions > 0


def test_resident_bytes_are_the_files_tensor_bytes(case):
    """Every matrix is held in the file's own blocks: the model holds what the file stores (GPT-2's position table
    aside, which is looked up in fp32), nothing widened or re-rounded."""
    from config import Config
    from models.gguf.reader import open_gguf
    from models.runtime import HFEngine

    path, ref_dir = case
    engine = HFEngine(Config(model_id=path, weights="auto", max_batch_size=1, kv_cache_mb=pool_mb(ref_dir, 8, 4)))
    held = dict(engine.model.resident_weights())
    if hasattr(engine.model, "wpe"):  # GPT-2's position table: fp32 whatever the file's type
        held["fp32"] -= engine.model.wpe.nbytes
    file: dict[str, int] = {}
    for t in open_gguf(path):
        if len(t.shape) == 2 and t.name != "position_embd.weight":
            file[t.type_name] = file.get(t.type_name, 0) + t.n_bytes
    fp32 = file.pop("F32", 0)  # an F32 matrix is an fp32 linear: small_gemm's panels pad its rows to eights
    assert {k: v for k, v in held.items() if k != "fp32"} == file
    assert fp32 <= held.get("fp32", 0) <= fp32 + 7 * 4 * 512


# --- files we cannot serve: one line at startup ---------------------------------------------------------------


def bad_files(tmp: str, good: str) -> dict[str, tuple[str, str]]:
    """name -> (path, words its startup error must have)."""
    data = open(good, "rb").read()
    from models.gguf.reader import open_gguf

    first = open_gguf(good)[0]
    out = {}
    trunc = os.path.join(tmp, "truncated.gguf")
    with open(trunc, "wb") as f:
        f.write(data[: len(data) - 1000])
    out["truncated"] = (trunc, "truncated")
    corrupt = os.path.join(tmp, "corrupt.gguf")
    with open(corrupt, "wb") as f:
        f.write(data[:24] + b"\xff" * 64 + data[88:])
    out["corrupt"] = (corrupt, "corrupt or truncated GGUF file")
    name = first.name.encode()
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    unknown = bytearray(data)
    unknown[type_at : type_at + 4] = (99).to_bytes(4, "little")
    out["unknown type id"] = (os.path.join(tmp, "unknown.gguf"), f"tensor {first.name} has an unknown GGUF type id 99")
    with open(out["unknown type id"][0], "wb") as f:
        f.write(bytes(unknown))
    return out


def unservable_file(tmp: str) -> str:
    """A file with one IQ2_XXS matrix (a type ggml has and we do not serve), the rest Q8_0."""
    import numpy as np

    writer = gguf.GGUFWriter(os.path.join(tmp, "iq2.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    odd = np.random.default_rng(0).integers(0, 256, (8, 66), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", odd, raw_shape=odd.shape, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.path.join(tmp, "iq2.gguf")


def start(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("MODEL_ID", "WEIGHTS", "RUNTIME")}
    return subprocess.run(
        command, cwd=ROOT, env={**full, **env}, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("command", ["python server.py", "uvicorn server:app"])
def test_a_file_we_cannot_serve_fails_in_one_line(tmp_path, command):
    """A corrupt, truncated, unknown-type or unservable-type file ends the start with one error line naming the
    problem (the tensor and its type), never a traceback; under uvicorn that line is uvicorn's startup-failure
    message."""
    path, _ = gguf_case("llama", 0)
    cases = {**bad_files(str(tmp_path), path), "unservable type": (unservable_file(str(tmp_path)), "")}
    cases["unservable type"] = (
        cases["unservable type"][0],
        "tensor blk.0.attn_q.weight has GGUF type IQ2_XXS, which is not supported",
    )
    argv = (
        [sys.executable, "server.py"]
        if command == "python server.py"
        else [sys.executable, "-m", "uvicorn", "server:app", "--host", "127.0.0.1", "--port", "1"]
    )
    for what, (bad, words) in cases.items():
        proc = start(argv, {"MODEL_ID": bad, "HOST": "127.0.0.1", "PORT": "1", "KV_CACHE_MB": "4"})
        assert proc.returncode != 0, (what, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if "error: " in line]
        assert len(errors) == 1 and words in errors[0] and bad in errors[0], (what, proc.stderr[-2000:])
