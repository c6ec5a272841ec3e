"""Model gates for every family beyond GPT-2 and Llama: greedy tokens through the scheduler equal HF ``generate``.

Each family's checkpoint is built by ``make_test_model.FAMILIES`` from transformers' own classes (tiny: 2 layers, 64
wide; norms and biases perturbed; windows of 20 keys, soft-caps, partial rotary, multipliers, 4 experts of which 2
run), saved, and loaded back through ``from_pretrained(path)``, the path users hit. Its EOS is re-pointed at a token
its greedy outputs emit mid-way (``conftest.repoint_eos``) so that some sequences stop by EOS mid-batch.

One run per family and runtime exercises everything the engine does to a sequence at once: joins while others
decode (staggered submissions through the scheduler), EOS mid-batch, chunked prefill (8 tokens a step), preemption
(a pool of 24 blocks of 4 tokens; 16 where every layer slides and blocks that left the window go back), prefix-cache
hits (prompts that share 3 blocks), and windows crossed (a 40-token prompt and 24 decode steps against a 20-key
window). Also: the quantized formats against HF on the dequantized
weights, the MoE routing against HF's routers (ties, experts no token picks), and the startup errors for what a
config asks that we do not implement.
"""

from __future__ import annotations

import os
import random

import pytest
from test_prefix_cache import submit_all

from conftest import (
    EOS_PROMPTS,
    PROMPTS,
    RUNTIMES,
    Reference,
    assert_runtime,
    drive,
    expected,
    repointed_reference,
    runtime_knobs,
    seqs_for,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from config import Config  # noqa: E402
from core.sequence import Sequence  # noqa: E402
from models.kernels.quant_gemm import WEIGHTS_TYPES  # noqa: E402
from models.loading import ModelLoadError  # noqa: E402
from models.runtime import build_engine  # noqa: E402
from scripts.make_test_model import FAMILIES, build_checkpoint  # noqa: E402

pytestmark = pytest.mark.model

ARCHS = list(FAMILIES)
BLOCK, POOL_BLOCKS, WINDOW = 4, 24, 20


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family(arch, tmp_path_factory) -> tuple[str, Reference]:
    """The family's tiny checkpoint with an EOS its greedy outputs really emit, and its HF reference."""
    src = build_checkpoint(str(tmp_path_factory.mktemp(f"{arch}_src")), arch=arch, seed=3)
    out = str(tmp_path_factory.mktemp(arch))
    return out, repointed_reference(src, out, EOS_PROMPTS, min_hits=2)


@pytest.fixture(scope="module")
def family_dir(family) -> str:
    return family[0]


@pytest.fixture(scope="module")
def family_ref(family) -> Reference:
    return family[1]


def engine_for(
    model_dir: str,
    runtime: str = "torch",
    blocks: int = POOL_BLOCKS,
    config_dir: str | None = None,
    image_root: str | None = None,
    **config,
):
    """An engine on ``runtime`` with a pool of ``blocks`` blocks of ``BLOCK`` tokens (of its KV_CACHE_DTYPE). The
    native runtime's model image is written in this process (``image.write_image``, what the server's child process
    runs) into a directory of its own (under ``image_root``), sparing each family a fresh interpreter that imports
    torch again. ``model_dir`` may be a GGUF file; ``config_dir`` then holds an HF config of the same model (the
    pool's size is counted from it)."""
    from models.runtime import NativeEngine

    from conftest import pool_mb

    knobs = runtime_knobs(runtime) if runtime == "native" else {"runtime": "torch"}  # then WEIGHTS from config
    config = {"max_batch_size": 4, "num_threads": 1, "kv_block_size": BLOCK, **knobs, **config}
    kv = config.get("kv_cache_dtype", "fp32")
    pool = pool_mb(config_dir or model_dir, blocks, BLOCK, kv)  # blocks of the pool's dtype
    config = Config(model_id=model_dir, kv_cache_mb=pool, **config)
    if runtime != "native":
        return build_engine(config)
    from models.image import write_image

    image = os.path.join(image_root or model_dir + "-images", config.weights)
    if not os.path.isdir(image):
        write_image(model_dir, config.weights, image)
    return NativeEngine(config, image_dir=image)


def spec_of(model_dir: str):
    """The family's ``DecoderSpec`` of a checkpoint (what our forward reads off its config)."""
    from models import families

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    return families()[cfg.model_type].spec(cfg)


def long_prompt(ref: Reference, n: int) -> list[int]:
    rng = random.Random(n)
    words = "the quick brown fox jumps over a lazy dog while batching tokens".split()
    return ref.encode(" ".join(rng.choice(words) for _ in range(n)))[:n]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_greedy_parity_through_the_scheduler(arch, family_dir, family_ref, runtime):
    """Joins, EOS mid-batch, chunked prefill, preemption, prefix-cache hits and windows crossed, in one run, on the
    torch runtime and on the torch-free one (the model image stepped by decode_step.c), fp32 weights."""
    scheduler_gate(family_dir, family_ref, runtime, family_dir, weights="fp32")


def scheduler_gate(model_id: str, ref: Reference, runtime: str, config_dir: str, **engine) -> None:
    """The family gate on ``model_id`` (a checkpoint directory or a GGUF file) against ``ref`` (HF on the same
    weights, its EOS re-pointed at a token its greedy outputs emit): joins, EOS mid-batch, chunked prefill,
    preemption, prefix-cache hits and windows crossed, in one run through the planner. ``config_dir``: an HF config
    of the model; ``engine``: further ``engine_for`` settings (WEIGHTS, an image root)."""
    spec = spec_of(config_dir)
    window = max(spec.windows)
    # Every layer windowed: the sequences keep at most 7 blocks each (blocks that left the window go back), so a
    # smaller pool makes the pressure; the first sequence (16 blocks at most) must fit it alone.
    slides = all(spec.windows)
    blocks = 16 if slides else POOL_BLOCKS
    engine = engine_for(model_id, runtime, blocks=blocks, config_dir=config_dir, max_num_batched_tokens=8, **engine)
    assert_runtime(engine, runtime) and engine.planner.kv_window == (window if slides else 0)
    stem = ref.encode(" ".join(PROMPTS))[:12]  # 3 full blocks two prompts share
    # The long and the prefix-sharing sequences ignore EOS: the pressure they make must not hinge on where this
    # CPU's greedy output meets EOS. The EOS prompts stop where the checkpoint's EOS says.
    first = [Sequence(prompt_token_ids=long_prompt(ref, 40), max_new_tokens=24, ignore_eos=True)]
    shared = [
        Sequence(prompt_token_ids=[*stem, *ref.encode(tail)], max_new_tokens=20, ignore_eos=True)
        for tail in (" zebra quilt", " a lazy dog")
    ]
    stopping = seqs_for(ref, EOS_PROMPTS[:6], [16] * 6)
    seqs = first + shared + stopping
    # Submitted together, the first four outgrow the pool as they decode (preemption); the rest join mid-run.
    submit_all(engine, [first + shared[:1] + stopping[:2], shared[1:] + stopping[2:4], stopping[4:]], gap=0.05)
    for s in seqs:
        assert s.output_token_ids == expected(ref, s, ref.eos), (s.seq_id, s.prompt_len, s.num_cached_tokens)
    stopped = [s for s in stopping if s.finish_reason == "stop"]
    assert stopped and all(len(s.output_token_ids) < s.max_new_tokens for s in stopped)
    preemptions = engine.planner.num_preemptions
    assert preemptions >= 1 and engine.blocks.hit_tokens > 0, (preemptions, engine.blocks)
    if window:  # the long sequence attended across the window in prefill and decode
        assert window == WINDOW and first[0].num_tokens > window + first[0].max_new_tokens
    assert engine.blocks.is_all_free() and engine.num_active() == 0


# --- quantized weights: int8 / int4 against HF on the dequantized weights -------------------------------------


@pytest.mark.parametrize("fmt, runtime", [("int8", "torch"), ("int4", "torch"), ("int4", "native")])
def test_quantized_formats_match_hf_on_dequantized_weights(arch, family_dir, fmt, runtime):
    """Every linear (each expert too) quantized; HF runs the same dequantized weights, the router in fp32 as ours.
    The native runtime at int4 only: its image holds Q8_0 blocks the same way, and the kernel's Q8_0 path is the one
    ``test_whole_step_call_gives_the_per_layer_calls`` compares bit for bit."""
    from models.quant import dequantize_hf_model_

    ref = Reference(family_dir)
    dequantize_hf_model_(ref.model, fmt)
    engine = engine_for(family_dir, runtime, weights=fmt, blocks=64)
    assert_runtime(engine, runtime)
    # int8 / int4: Q8_0 / Q4_1 blocks; an expert's down projection of K % 32 (Qwen3-MoE's 48) falls back to F16
    types = set(engine.model.weight_bytes())
    assert WEIGHTS_TYPES[fmt] in types and types <= {WEIGHTS_TYPES[fmt], "F16"}, types
    first = [Sequence(prompt_token_ids=long_prompt(ref, 40), max_new_tokens=12, ignore_eos=True)]
    first += seqs_for(ref, PROMPTS[:2], [14, 6], ignore_eos=True)
    joiners = seqs_for(ref, PROMPTS[3:5], [9, 5], ignore_eos=True)
    drive(engine, [(0, first), (4, joiners)])
    for s in first + joiners:
        assert s.output_token_ids == expected(ref, s, set()), (fmt, s.prompt_len)


# --- the mixture of experts' routing against HF's routers ----------------------------------------------------

MOE_ARCHS = [a for a in ARCHS if "experts" in str(FAMILIES[a][2]) or "num_local_experts" in FAMILIES[a][2]]


@pytest.mark.parametrize("moe_arch", MOE_ARCHS)
def test_moe_routing_matches_hf_with_ties_and_experts_no_token_picks(moe_arch, tmp_path):
    """Router rows made equal (exact ties at the top-k boundary) and one expert that these tokens never pick: our
    MoE layer picks HF's experts with HF's weights, runs only the experts picked (each once, over all its tokens),
    and gives HF's output."""
    from models import families

    model_dir, h, unpicked = tied_router_checkpoint(moe_arch, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = families()[hf.config.model_type](hf, 1, 64, torch.device("cpu")).blocks[0].mlp
    assert_routes_as_hf(hf.model.layers[0].mlp, ours, h, unpicked)


def tied_router_checkpoint(moe_arch: str, out: str, seed: int = 5, **overrides) -> tuple[str, torch.Tensor, int]:
    """The family's checkpoint (``overrides`` on its config) with layer 0's router rows 1 and 2 equal (every token
    ties them) and its last expert scored -50 or below by every one of the tokens ``router_probe`` gives:
    (directory, those tokens h [24, C], that expert)."""
    model_dir = build_checkpoint(out, arch=moe_arch, seed=seed, overrides=overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    router = hf.model.layers[0].mlp.gate.weight  # [E, C]
    h, u = router_probe(router.shape[1])
    with torch.no_grad():
        router[2] = router[1]  # experts 1 and 2 always tie
        router[-1] = -50 * u  # every one of these tokens scores it at -50 or below, far under the others
    hf.save_pretrained(model_dir)
    return model_dir, h, router.shape[0] - 1


def router_probe(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """24 tokens h [24, C] and a unit vector u [C] with h . u >= 1 for every token (seeded: the same every call)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(24, width, generator=gen)
    u = torch.nn.functional.normalize(torch.randn(width, generator=gen), dim=0)
    return h + (1 - h @ u).clamp(min=0)[:, None] * u, u


def assert_routes_as_hf(hf_moe, ours, h: torch.Tensor, unpicked: int) -> None:
    """Our MoE layer ``ours`` on tokens h picks ``hf_moe``'s experts with its weights (the ties broken as HF breaks
    them, ``unpicked`` never chosen), runs each chosen expert once and only those, and gives HF's output."""
    runs = []  # the experts whose gate+up linear ran, once per call

    def counted(e: int, linear):
        return lambda x: (runs.append(e), linear(x))[1]

    ours.gate_up = [counted(e, lin) for e, lin in enumerate(ours.gate_up)]
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_moe.gate(h)
        weights, experts = ours.route(h)
        assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
        tied = (experts == 1).any(-1) | (experts == 2).any(-1)
        assert tied.any() and unpicked not in experts
        out = ours(h, lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1])
        torch.testing.assert_close(out, hf_moe(h[None])[0], rtol=1e-5, atol=1e-5)
    assert sorted(runs) == sorted(set(runs)) == sorted(set(experts.flatten().tolist()))


# --- what a config asks that we do not implement: one line at startup, naming it -----------------------------


@pytest.mark.parametrize(
    "arch, overrides, named",
    [
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 256,
                }
            },
            "'longrope'",
        ),
        ("qwen3", {"hidden_act": "relu"}, "'relu'"),
        ("qwen2", {"layer_types": ["chunked_attention", "full_attention"]}, "'chunked_attention'"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
    ids=["phi3-longrope", "qwen3-relu", "qwen2-chunked", "gemma3-bidirectional"],
)
def test_what_we_do_not_implement_fails_at_startup_naming_it(tmp_path, arch, overrides, named):
    model_dir = build_checkpoint(str(tmp_path), arch=arch, overrides=overrides)
    with pytest.raises(ModelLoadError, match=named) as info:
        engine_for(model_dir)
    assert "\n" not in str(info.value)


# --- the whole-step kernel: the families' deltas in decode_step.c ----------------------------------------------


def test_the_kernels_top_k_is_torch_topk_ties_included():
    """decode_step.c routes with torch.topk's rule (libstdc++'s nth_element / partial_sort, as ATen runs them):
    rows drawn from 3 values (ties everywhere), for the expert counts and top-k of real MoE models."""
    import ctypes

    import numpy as np

    from models.kernels import step_abi

    lib = step_abi.load()
    if lib is None:
        pytest.skip(f"decode step kernel unavailable: {step_abi.KERNEL.unavailable_reason}")
    gen = torch.Generator().manual_seed(0)
    for n, k in [(4, 2), (8, 2), (16, 4), (60, 4), (64, 8), (128, 8), (128, 2), (256, 1), (40, 17)]:
        values = torch.randint(0, 3, (500, n), generator=gen).float() / 4
        values[::7] = torch.rand(values[::7].shape, generator=gen)  # some rows without ties
        want_v, want_i = torch.topk(values, k, dim=-1)
        idx, got = np.zeros((500, k), np.int64), np.zeros((500, k), np.float32)
        scratch = np.zeros(2 * n, np.float32)
        v = values.numpy()
        lib.topk_rows(
            v.ctypes.data, 500, n, k, idx.ctypes.data, got.ctypes.data, scratch.ctypes.data_as(ctypes.c_void_p)
        )
        assert np.array_equal(idx, want_i.numpy()), (n, k)
        assert np.array_equal(got, want_v.numpy()), (n, k)


def test_whole_step_call_gives_the_per_layer_calls(arch, family_dir, weights="int8"):
    """One ``decode_step`` call against the per-layer lean calls at batch 1 and 5, contexts of 3 to 33 tokens (past
    the 20-key windows), 1-3 threads, int8 linears (the fp32 panels run in the scheduler gate's lean steps; the
    kernel's linears are test_fused_decode.py's): the same logits and K/V bit for bit. A mixture of experts routes
    in C there and through torch per layer (HF's ops): the same tokens, logits within 1e-4."""
    from test_fused_decode import _runs_from_one_state

    engine = engine_for(family_dir, weights=weights, blocks=256, max_batch_size=5)
    model = engine.model
    plan = model.fused_step
    assert plan is not None, model.kernel_gap()
    moe = model.cfg_spec.moe is not None
    per_seq = 12
    for B in (1, 5):
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
        prompts = [[(5 * b + 3 * i) % 90 + 3 for i in range(3 + 7 * b)] for b in range(B)]
        tokens = model.forward_rows([], [], [], prompts, tables).argmax(-1).tolist()
        runs = _runs_from_one_state(model, plan, lambda: model.decode(tokens, [len(p) for p in prompts], tables))
        first = runs[0]
        for logits, k, v in runs[1:-1]:  # the whole-step call at other thread counts
            assert torch.equal(logits, first[0]) and torch.equal(k, first[1]) and torch.equal(v, first[2])
        logits, k, v = runs[-1]  # the per-layer calls
        if moe:
            assert logits.argmax(-1).tolist() == first[0].argmax(-1).tolist()
            torch.testing.assert_close(logits, first[0], rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(logits, first[0]) and torch.equal(k, first[1]) and torch.equal(v, first[2])


# --- sliding windows in the paged pool: blocks that left every layer's window go back ------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_blocks_that_left_the_window_go_back_to_the_pool(tmp_path, runtime):
    """Mistral (a 20-key window on every layer), blocks of 4: two sequences of 30 + 50 tokens would need 40 blocks,
    the pool has 24; each keeps only what its window reads (at most 7 blocks), so both run to the end together,
    nothing is preempted, and the tokens are HF's. A window model's pool is all free again afterwards."""
    model_dir = build_checkpoint(str(tmp_path / "mistral"), arch="mistral", seed=7)
    ref = Reference(model_dir)
    engine = engine_for(model_dir, runtime, weights="fp32", max_num_batched_tokens=8)
    assert engine.planner.kv_window == WINDOW
    seqs = [Sequence(prompt_token_ids=long_prompt(ref, 30 + i), max_new_tokens=50, ignore_eos=True) for i in range(2)]
    engine.admit(seqs)
    live = []
    while engine.num_active():
        engine.step()
        live.append(
            max((engine.blocks.num_live_blocks(s.seq_id) for s in seqs if s.seq_id in engine.blocks), default=0)
        )
        engine.blocks.check()
    assert engine.planner.num_preemptions == 0 and max(live[10:]) <= WINDOW // BLOCK + 2, live
    for s in seqs:
        assert s.output_token_ids == expected(ref, s, set())
    assert engine.blocks.is_all_free()
