"""LoRA adapters (models/lora.py): greedy tokens under an adapter are HF + PEFT's ``generate`` on the same adapter,
token for token, on a random tiny Llama and GPT-2 with random adapters (lora_B far from PEFT's zero init); a batch
mixing three adapters and the base gives each sequence what it gets alone; on the torch and the native runtime, and
on an int8 base against PEFT over the dequantized base; a prompt's KV blocks are shared under one adapter and never
between two; adapters this server cannot serve are refused by name.

The HTTP side (LORA_MODULES at startup, /v1/models, ``model`` on every endpoint, load / unload) is
tests/test_lora_http.py's.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from test_prefix_cache import submit_all

from core.sequence import Sequence
from core.speculative import SpecParams
from scripts.make_test_model import FAMILIES as TINY_FAMILIES

from conftest import PROMPTS, Reference, lora_modules, make_engine, need_native, peft_reference, small_model_threads

pytestmark = pytest.mark.model

N_TOKENS = 10


# (runtime, WEIGHTS): the torch runtime on fp32 (its linears' hooks and the whole-step kernel's), the native runner's
# whole-step kernel on an int8 base (the quantized linears' path; the torch runtime's int8 linears take the same hooks).
RUNS = [("torch", "fp32"), ("native", "int8")]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def lora_base(request, lora_checkpoints) -> tuple[str, dict[str, str]]:
    return lora_checkpoints(request.param)


@pytest.fixture(scope="module")
def reference_sets(lora_base):
    """WEIGHTS -> {"": HF generate on the base, adapter name: HF + PEFT generate}, over the weights as served."""
    model_dir, adapters = lora_base
    built: dict[str, dict[str, Reference]] = {}

    def get(weights: str) -> dict[str, Reference]:
        if weights not in built:
            refs = {"": peft_reference(model_dir, None, weights)}
            built[weights] = refs | {name: peft_reference(model_dir, path, weights) for name, path in adapters.items()}
        return built[weights]

    return get


@pytest.fixture(scope="module")
def references(reference_sets) -> dict[str, Reference]:
    return reference_sets("fp32")


def lora_engine(model_dir: str, adapters: dict[str, str], runtime: str, weights: str, **config):
    """An engine of 8 slots serving ``adapters`` from startup on ``runtime`` at ``weights`` (an fp32 KV pool)."""
    if runtime == "torch":
        return make_engine(model_dir, capacity=8, weights=weights, lora_modules=lora_modules(adapters), **config)
    from config import Config
    from models.runtime import NativeEngine

    need_native()
    knobs = {"max_batch_size": 8, "num_threads": 2, "kv_cache_dtype": "fp32", **config}
    return NativeEngine(
        Config(model_id=model_dir, weights=weights, runtime="native", lora_modules=lora_modules(adapters), **knobs)
    )


def mixed_seqs(engine, refs: dict[str, Reference], prompts: list[str]) -> list[Sequence]:
    """Every prompt under the base and each adapter, interleaved (so one batch holds all four)."""
    seqs = []
    for prompt in prompts:
        for name in refs:
            lora_id = engine.loras.id_of(name) if name else 0
            ids = refs[""].encode(prompt)
            seqs.append(Sequence(prompt_token_ids=ids, max_new_tokens=N_TOKENS, ignore_eos=True, lora_id=lora_id))
    return seqs


def assert_peft_tokens(engine, refs: dict[str, Reference], seqs: list[Sequence]) -> None:
    names = {engine.loras.id_of(n) if n else 0: n for n in refs}
    for seq in seqs:
        name = names[seq.lora_id]
        want = refs[name].generate(seq.prompt_token_ids, seq.max_new_tokens, set())
        assert seq.output_token_ids == want, (name or "base", seq.prompt_token_ids)


@pytest.mark.parametrize("runtime, weights", RUNS, ids=[f"{r}-{w}" for r, w in RUNS])
def test_mixed_batch_equals_peft_and_each_alone(lora_base, reference_sets, runtime, weights):
    """Three adapters and the base in one batch (12 sequences over 8 slots: joins, chunked prefill riding with decode
    rows): every sequence's greedy tokens are PEFT's (over the int8 base: on its dequantized weights); then each
    again alone, found in the prefix cache, the same. On the torch runtime the decode steps run the whole-step
    kernel's LoRA hook and the mixed steps the torch linears' hooks; on the native runtime every step is the
    kernel's."""
    model_dir, adapters = lora_base
    references = reference_sets(weights)
    engine = lora_engine(model_dir, adapters, runtime, weights, kv_block_size=4, max_num_batched_tokens=24)
    seqs = mixed_seqs(engine, references, PROMPTS[:3])
    submit_all(engine, [seqs[:8], seqs[8:]], gap=0.02)
    assert_peft_tokens(engine, references, seqs)
    outputs = {}
    for prompt in PROMPTS[:3]:  # each differs from the base's (the adapters are far from zero)
        ids = references[""].encode(prompt)
        outputs[prompt] = [s.output_token_ids for s in seqs if s.prompt_token_ids == ids]
        assert len({tuple(o) for o in outputs[prompt]}) == 4, outputs[prompt]
    alone = mixed_seqs(engine, references, PROMPTS[:3])
    for seq in alone:
        submit_all(engine, [[seq]])
    assert [s.output_token_ids for s in alone] == [s.output_token_ids for s in seqs]


def test_prefix_cache_keys_include_the_adapter(lora_base, references):
    """The same 3-block prompt: under one adapter a second request finds its blocks cached; under another adapter or
    the base it finds none (their K/V differ), and every answer is still PEFT's."""
    model_dir, adapters = lora_base
    engine = make_engine(model_dir, capacity=4, lora_modules=lora_modules(adapters), kv_block_size=4)
    ids = references[""].encode(PROMPTS[4])[:13]  # 3 whole blocks before the last token's
    a, b = engine.loras.id_of("all8"), engine.loras.id_of("qv16")
    order = [a, a, b, 0, b, 0]
    seqs = [Sequence(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True, lora_id=i) for i in order]
    for seq in seqs:  # one at a time: each finds what the ones before it cached
        submit_all(engine, [[seq]])
    assert [s.num_cached_tokens for s in seqs] == [0, 12, 0, 0, 12, 12]
    assert_peft_tokens(engine, references, seqs)


def test_refused_adapters_are_named(lora_base, tmp_path):
    """What the server cannot compute is refused by name, in one line: DoRA, a LoRA bias, modules_to_save, a module
    the model does not have, a rank above MAX_LORA_RANK, an adapter of another shape, a missing file."""
    from models.lora import LoraError, read_adapter

    model_dir, adapters = lora_base
    engine = make_engine(model_dir, capacity=2, max_lora_rank=8)
    targets = engine.loras.targets
    good = adapters["all8"]

    def edited(name: str, **changes) -> str:
        out = str(tmp_path / name)
        shutil.copytree(good, out)
        path = os.path.join(out, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(changes)
        with open(path, "w") as f:
            json.dump(config, f)
        return out

    cases = {
        edited("dora", use_dora=True): "DoRA",
        edited("bias", bias="all"): "bias 'all'",
        edited("save", modules_to_save=["lm_head"]): "modules_to_save",
        edited("prompt", peft_type="PROMPT_TUNING"): "PROMPT_TUNING",
        adapters["qv16"]: "rank 16; this server's MAX_LORA_RANK is 8",
        str(tmp_path / "missing"): "no adapter_config.json",
    }
    from models.loading import ModelLoadError

    dora = next(p for p, w in cases.items() if w == "DoRA")
    with pytest.raises(ModelLoadError) as info:  # at startup: one line, the server does not start
        make_engine(model_dir, capacity=2, lora_modules=f"ok={good},bad={dora}")
    assert str(info.value).startswith("LORA_MODULES: LoRA adapter 'bad'") and "DoRA" in str(info.value), info.value
    for path, words in cases.items():
        with pytest.raises(LoraError) as info:
            read_adapter("bad", path, targets, 8)
        message = str(info.value)
        assert "'bad'" in message and words in message and "\n" not in message, message
    other = make_engine(model_dir, capacity=2, max_loras=1)  # a target list with fewer outputs: another model
    shrunk = [t.__class__(t.layer, t.kind, t.K + 1, t.parts) for t in other.loras.targets]
    with pytest.raises(LoraError, match="do not fit the base's linear"):
        read_adapter("other", good, shrunk, 64)
    with pytest.raises(LoraError, match="is not a linear this server applies LoRA to"):
        read_adapter("embed", good, [t for t in targets if t.kind != "qkv"], 64)


def test_gguf_base_equals_peft_on_its_weights(tmp_path):
    """A Llama GGUF of every served type (llama.cpp's Q/K row order undone by the reader) on the native runtime, with
    an adapter trained for its HF checkpoint: the tokens of HF + PEFT over the file's dequantized weights."""
    from test_gguf_parity import gguf_case

    from scripts.make_test_adapter import build_adapter

    need_native()
    path, ref_dir = gguf_case("llama", 0)
    adapter = build_adapter(ref_dir, str(tmp_path / "adapter"), rank=8, seed=5)
    ref, base = peft_reference(ref_dir, adapter), peft_reference(ref_dir)
    engine = lora_engine(path, {"a": adapter}, "native", "auto", kv_block_size=4)
    ids = [ref.encode(p) for p in PROMPTS[:3]]
    seqs = [
        Sequence(prompt_token_ids=p, max_new_tokens=N_TOKENS, ignore_eos=True, lora_id=i) for p in ids for i in (1, 0)
    ]
    submit_all(engine, [seqs])
    for seq in seqs:
        want = (ref if seq.lora_id else base).generate(seq.prompt_token_ids, N_TOKENS, set())
        assert seq.output_token_ids == want, seq.lora_id
    assert seqs[0].output_token_ids != seqs[1].output_token_ids


def test_adapters_under_speculative_decoding(lora_checkpoints):
    """A draft model (the base itself, SPECULATIVE_MODEL) and n-gram drafts verified under each adapter: the verify
    rows run under their sequence's adapter, so the tokens are still PEFT's (the drafts, the base's guesses, are
    often rejected). Llama only: verify rows are the engine's, not the family's."""
    from config import Config
    from models.runtime import build_engine

    model_dir, adapters = lora_checkpoints("llama")
    references = {"": peft_reference(model_dir), **{n: peft_reference(model_dir, p) for n, p in adapters.items()}}
    config = Config(
        model_id=model_dir,
        max_batch_size=8,
        num_threads=2,
        kv_cache_dtype="fp32",
        lora_modules=lora_modules(adapters),
        speculative_method="draft_model",
        speculative_model=model_dir,  # its draft engine serves no adapter
        speculative_disable_by_batch_size=0,
        speculative_adaptive=False,
    )
    engine = build_engine(config)
    seqs = mixed_seqs(engine, references, PROMPTS[3:5])
    for i, seq in enumerate(seqs):
        seq.max_new_tokens = 16
        seq.speculation = SpecParams("ngram" if i % 2 else "draft_model", num_tokens=3)
    submit_all(engine, [seqs])
    assert_peft_tokens(engine, references, seqs)
    assert engine.planner.spec.num_draft_tokens > 0 and engine.planner.spec.num_accepted_tokens > 0


def test_native_step_over_several_calls(lora_checkpoints):
    """A prompt longer than the kernel's rows per call (128 on quantized weights) prefilled in one step beside decode
    rows of other adapters: the step is several kernel calls, each grouping its own rows by adapter (Llama only:
    the split is the runner's, not the family's)."""
    model_dir, adapters = lora_checkpoints("llama")
    references = {"": peft_reference(model_dir, None, "int8")}
    references |= {name: peft_reference(model_dir, path, "int8") for name, path in adapters.items()}
    engine = lora_engine(model_dir, adapters, "native", "int8", max_num_batched_tokens=0)
    assert engine.model.max_rows == 128
    long_prompt = (references[""].encode(" ".join(PROMPTS)) * 4)[:150]
    ids = {name: engine.loras.id_of(name) for name in adapters}
    seqs = [Sequence(prompt_token_ids=long_prompt, max_new_tokens=6, ignore_eos=True, lora_id=ids["qv16"])]
    seqs += [
        Sequence(prompt_token_ids=references[""].encode(p), max_new_tokens=12, ignore_eos=True, lora_id=ids[name])
        for p, name in zip(PROMPTS[:2], ("all8", "mlp4"))
    ]
    submit_all(engine, [seqs[1:], seqs[:1]], gap=0.05)  # the long prompt joins while the others decode
    assert_peft_tokens(engine, references, seqs)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_kernel_hook_matches_the_torch_hooks_at_any_thread_count(lora_checkpoints, weights):
    """The whole-step kernel's LoRA hook (decode_step.c + lora_step.c) against the torch linears' hooks on one step of
    ragged groups (7 decode rows: the base, rank 8 on every linear x1, rank 16 on q/v x2, rank 4 on the MLP x3) plus a
    5-token chunk under an adapter: the same logits within fp32 rounding, and bit for bit the same at 1, 2 and 3
    threads (each output column is one thread's, summed in one order)."""
    import numpy as np
    import torch

    from models.kernels import decode_step

    from conftest import need_kernel

    need_kernel(decode_step, "decode step")
    model_dir, adapters = lora_checkpoints("llama")
    engine = make_engine(model_dir, capacity=8, weights=weights, lora_modules=lora_modules(adapters), kv_block_size=4)
    model, slot = engine.model, {n: engine.loras.slots.slot_of(engine.loras.id_of(n)) for n in adapters}
    assert model.fused_step is not None
    rows = [-1, slot["all8"], slot["qv16"], slot["qv16"], slot["mlp4"], slot["mlp4"], slot["mlp4"]]
    tables = [[2 * b, 2 * b + 1] for b in range(len(rows))] + [[20, 21]]
    args = ([11 + b for b in range(7)], [5] * 7, tables[:7], [[3, 4, 5, 6, 7]], [tables[7]], [0])
    for b in range(7):  # each decode row's context, under its own adapter
        model.forward_rows([], [], [], [list(range(30, 35))], [tables[b]], loras=[rows[b]])
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(model.forward_rows(*args, loras=rows + [slot["all8"]]))
        plan, model.fused_step = model.fused_step, None  # the same step through the torch linears' hooks
        torch_logits = model.forward_rows(*args, loras=rows + [slot["all8"]])
        model.fused_step = plan
        base = model.forward_rows(*args)
    finally:
        torch.set_num_threads(threads)
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    np.testing.assert_allclose(runs[0], torch_logits, rtol=1e-4, atol=1e-4)
    assert np.array_equal(runs[0][0], base[0])  # the base row: no adapter, no change
    assert not np.allclose(runs[0][1:], base[1:], atol=1e-2)  # every adapter row moved


def test_a_damaged_weights_file_is_refused_by_name(lora_checkpoints, tmp_path):
    """A truncated or non-safetensors adapter_model.safetensors, an unknown dtype, bf16 weights (read exactly):
    each refused in one line naming the adapter, or read, without torch."""
    import numpy as np

    from models.lora import LoraError, read_adapter

    model_dir, adapters = lora_checkpoints("llama")
    targets = make_engine(model_dir, capacity=1, max_loras=1).loras.targets
    good = read_adapter("good", adapters["mlp4"], targets, 64)

    def variant(name: str, edit) -> str:
        out = str(tmp_path / name)
        shutil.copytree(adapters["mlp4"], out)
        path = os.path.join(out, "adapter_model.safetensors")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(edit(data))
        return out

    for name, edit, words in (
        ("cut", lambda d: d[: len(d) // 2], "truncated"),
        ("junk", lambda d: b"\xff" * 64, "cannot be read"),
        ("int", lambda d: d.replace(b'"F32"', b'"I32"', 1), "dtype 'I32'"),
    ):
        with pytest.raises(LoraError) as info:
            read_adapter(name, variant(name, edit), targets, 64)
        assert f"'{name}'" in str(info.value) and words in str(info.value), info.value
    from safetensors.numpy import load_file

    bf16_dir = variant("bf16", lambda d: d)
    path = os.path.join(bf16_dir, "adapter_model.safetensors")
    header, blobs, at = {}, [], 0  # each fp32 tensor written as bfloat16 by hand (numpy has none): its high half
    for key, value in load_file(path).items():
        blob = (value.view(np.uint32) >> 16).astype("<u2").tobytes()
        header[key] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    bf16 = read_adapter("bf16", bf16_dir, targets, 64)
    for key, lin in good.linears.items():
        want = (lin.a_t.view(np.uint32) & 0xFFFF0000).view(np.float32)
        np.testing.assert_array_equal(bf16.linears[key].a_t, want)


# Each family's HF module names for LoRA on every linear of its layers (a mixture of experts: attention only).
FAMILY_MODULES = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
ATTENTION_ONLY = {"qwen3_moe", "mixtral", "olmoe"}


@pytest.mark.parametrize(
    "arch, small_gemm", [(a, True) for a in sorted(TINY_FAMILIES)] + [("gpt2", False), ("llama", False)]
)
def test_every_family_matches_peft(arch, small_gemm, tmp_path):
    """Every family (its norms, q/k norms, soft-caps, multipliers; Phi-3's fused qkv_proj and gate_up_proj; a mixture
    of experts' attention): the logits of a prefill and of a decode step (the whole-step kernel's hook) under an
    adapter on all its linears are PEFT's within fp32 rounding; and GPT-2 and Llama on oneDNN's linears
    (SMALL_GEMM=false: no whole-step kernel, GPT-2's GELU fused into its linear unless an adapter is present)."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from models import families
    from models.lora import read_adapter
    from scripts.make_test_adapter import DEFAULT_MODULES, build_adapter
    from scripts.make_test_model import build_checkpoint

    model_dir = build_checkpoint(str(tmp_path / "base"), arch=arch, seed=3)
    modules = FAMILY_MODULES.get(arch) or DEFAULT_MODULES["gpt2" if arch == "gpt2" else "llama"]
    modules = modules[:4] if arch in ATTENTION_ONLY else modules
    adapter = build_adapter(model_dir, str(tmp_path / "lora"), rank=8, seed=1, modules=modules)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    family = families()[hf.config.model_type]
    model = family(hf, 2, 64, torch.device("cpu"), use_small_gemm=small_gemm, num_blocks=8, block_size=4)
    assert (model.fused_step is not None) == small_gemm
    model.enable_lora(1)
    model.set_lora(0, read_adapter("a", adapter, model.lora_targets(), 64))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter)
    ids = list(range(5, 14))
    with torch.no_grad(), small_model_threads(peft):
        want = peft.eval()(torch.tensor([ids + [14]])).logits[0, -2:].numpy()
    prefill = model.forward_rows([], [], [], [ids], [[0, 1, 2, 3]], loras=[0])
    decode = model.forward_rows([14], [9], [[0, 1, 2, 3]], loras=[0])
    np.testing.assert_allclose(np.concatenate([prefill, decode]), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    "runtime, weights", [*RUNS, ("torch", "int4")], ids=["torch-fp32", "native-int8", "torch-int4"]
)
def test_slots_reused_after_unload(lora_checkpoints, runtime, weights):
    """What the load and unload endpoints do on the engine's thread, on each runtime (and an int4 base): with one slot,
    load an adapter, serve it, remove it, load another into the same slot: it serves PEFT's tokens (over the
    dequantized base), and the first adapter's id is gone (its prefix-cache chain with it)."""
    model_dir, adapters = lora_checkpoints("llama")
    engine = lora_engine(model_dir, {}, runtime, weights, max_loras=1)
    loras = engine.loras
    ids = peft_reference(model_dir).encode(PROMPTS[1])
    for name in ("all8", "mlp4"):
        loras.begin(name)
        adapter = loras.read(name, adapters[name])
        loaded = loras.commit(adapter, loras.install(adapter))
        seq = Sequence(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True, lora_id=loaded.lora_id)
        submit_all(engine, [[seq]])
        assert seq.output_token_ids == peft_reference(model_dir, adapters[name], weights).generate(ids, 8, set())
        loras.forget(name)
        loras.remove(loaded.lora_id)
    assert loras.served == {} and not loras.is_served(loaded.lora_id) and loaded.lora_id == 2
