"""``--workload kv-quality``: what each KV_CACHE_DTYPE costs in quality, through our own forward (issue 29).

Not a serving run. For each pool dtype (fp32, the reference, then fp16, bf16, int8) the model is loaded with
that pool (the torch runtime, its weights at ``WEIGHTS``, default the file's own) and

- perplexity of the held texts, teacher-forced in 64-token chunks with logits at every position
  (``models.quality.perplexity``; a chunk attends over what the pool holds, its own tokens as stored): the
  project's passage (``models/quality_passage.txt``, ~2k tokens) and a longer one (``LONG_TEXT``: this
  repository's README as of ``LONG_COMMIT``, English written for the project, the first ``LONG_TOKENS`` tokens);
- greedy agreement over ``NEW`` tokens: after each of ``PROMPTS`` prompts (``PROMPT_TOKENS`` tokens of the long
  text from different offsets) the dtype's greedy tokens against fp32's: how many come before the first
  difference, and the share of positions that are equal.

int8's scale granularity is measured the same way on simulated pools (fp32 storage whose writes are quantized and
dequantized, read by the same kernel; ``SIM``, each against ``sim:none``, the same path unquantized): one scale per
token and head (the kernel's int8, which the simulation must reproduce), per 32 values (q8_0's block: 2 scales per
64-value head), and per block and head (one scale for a block's ``KV_BLOCK_SIZE`` tokens, each token's original
values requantized as the block fills: the best any per-block scale can do without knowing later tokens).
"""

from __future__ import annotations

import gc
import subprocess
import time

import torch

DTYPES = ("fp32", "fp16", "bf16", "int8")
# int8 scale granularities, simulated on fp32 pools through the torch path; sim:none is that path unquantized (the
# simulations' own reference: its arithmetic is not the compiled step's)
SIM = ("sim:none", "sim:token", "sim:group32", "sim:block")
LONG_COMMIT = "2684c5e"
LONG_TOKENS = 4096
PROMPTS, PROMPT_TOKENS, NEW = 4, 1024, 256
QUICK = {"long_tokens": 256, "prompts": 1, "prompt_tokens": 64, "new": 16}


def long_text(root: str) -> str:
    """README.md as of LONG_COMMIT (git), the long held text."""
    return subprocess.run(
        ["git", "-C", root, "show", f"{LONG_COMMIT}:README.md"], capture_output=True, text=True, check=True
    ).stdout


def _fake_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., D] quantized and dequantized, one q8_0 scale per ``group`` consecutive values."""
    from models.kernels.paged_attention import dequantize, quantize_int8

    shape = x.shape
    q, s = quantize_int8(x.reshape(*shape[:-1], shape[-1] // group, group))
    return dequantize(q, s).reshape(shape)


def simulated_cache(kv, granularity: str):
    """``kv`` (an fp32 ``PagedKVCache``) made a simulated int8 pool: writes are stored quantized-and-dequantized at
    ``granularity`` ("token", "group32", "block"). Its ``dtype`` is not "fp32", so prompt chunks attend over what
    the pool holds, as for a real narrow pool."""
    from models.kv_cache import PagedKVCache

    class Simulated(PagedKVCache):
        def write(self, layer, blocks, offsets, k, v):
            if granularity == "block":  # originals kept; each touched block requantized over its filled tokens
                self.orig_k[layer][blocks, :, offsets] = k
                self.orig_v[layer][blocks, :, offsets] = v
                for b in torch.unique(blocks).tolist():
                    filled = max(int(offsets[blocks == b].max()) + 1, self.filled.get((layer, b), 0))
                    self.filled[(layer, b)] = filled
                    for orig, pool in ((self.orig_k, self.k), (self.orig_v, self.v)):
                        x = orig[layer, b, :, :filled]  # [KVH, filled, D]: one scale per head over the block
                        pool[layer, b, :, :filled] = _fake_int8(x.reshape(x.shape[0], -1), x[0].numel()).view_as(x)
                return
            if granularity == "none":
                return super().write(layer, blocks, offsets, k, v)
            group = k.shape[-1] if granularity == "token" else 32
            self.k[layer][blocks, :, offsets] = _fake_int8(k, group)
            self.v[layer][blocks, :, offsets] = _fake_int8(v, group)

    kv.__class__ = Simulated
    kv.dtype = f"sim:{granularity}"
    if granularity == "block":
        kv.orig_k, kv.orig_v, kv.filled = torch.zeros_like(kv.k), torch.zeros_like(kv.v), {}
    return kv


def load(model_id: str, weights: str, max_len: int):
    """(tokenizer, our model) for ``model_id`` at ``weights`` (the torch runtime's forward) with a pool of
    ``max_len`` tokens; ``use_pool`` gives it each variant's pool in turn."""
    from models.image import build_model

    tokenizer, _, _, model = build_model(model_id, weights, num_blocks=-(-max_len // 32), block_size=32)
    return tokenizer, model


def use_pool(model, variant: str) -> None:
    """A fresh pool of ``variant``'s elements for ``model``: a dtype, or a simulated int8 granularity on fp32
    storage (every step then takes the torch path, which writes through the cache)."""
    kv = model.kv
    dtype = variant if variant in DTYPES else "fp32"
    model._init_cache(model.n_layer, kv.k.shape[2], model.head_dim, model.device, kv.num_blocks, kv.block_size, dtype)
    if variant in SIM:
        model.fused_step, model.lean_decode = None, False  # the compiled steps write K/V themselves
        simulated_cache(model.kv, variant.split(":")[1])
        model.layer_pools = [model.kv.pools(layer) for layer in range(model.n_layer)]


@torch.inference_mode()
def greedy(model, prompt: list[int], new: int) -> list[int]:
    """``new`` greedy tokens after ``prompt`` (the pool's first blocks)."""
    bs = model.kv.block_size
    table = list(range(-(-(len(prompt) + new) // bs)))
    logits = model.forward_rows([], [], [], [prompt], [table], [0])
    out = [int(logits[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + new - 1):
        out.append(int(model.forward_rows([out[-1]], [pos], [table])[0].argmax()))
    return out


def score(model, variant: str, texts: dict, prompts: list[list[int]], new: int) -> dict:
    from models.quality import perplexity

    t0 = time.perf_counter()
    use_pool(model, variant)
    per_token = None if variant in SIM else model.kv.nbytes // (model.kv.num_blocks * model.kv.block_size)
    row = {"kv_cache_dtype": variant, "bytes_per_token": per_token}
    for name, ids in texts.items():
        row[f"ppl_{name}"] = perplexity(model, ids)
    row["greedy"] = [greedy(model, p, new) for p in prompts]
    row["seconds"] = time.perf_counter() - t0
    return row


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Tokens before the first difference (per prompt) and the share of equal positions, against ``ref``."""
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(ours, ref)]
    equal = sum(a == b for x, y in zip(ours, ref) for a, b in zip(x, y)) / sum(len(y) for y in ref)
    return {"first_difference": firsts, "equal_share": equal}


def run_kv_quality(model_id: str, root: str, quick: bool, weights: str = "auto") -> dict:
    from models.quality import passage

    q = QUICK if quick else {"long_tokens": LONG_TOKENS, "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS}
    new = QUICK["new"] if quick else NEW
    tokenizer, model = load(model_id, weights, LONG_TOKENS + 512)
    long_ids = tokenizer.encode(long_text(root))
    passage_ids = tokenizer.encode(passage())
    texts = {"passage": passage_ids[: q["long_tokens"]] if quick else passage_ids, "long": long_ids[: q["long_tokens"]]}
    step = (len(long_ids) - q["prompt_tokens"]) // max(q["prompts"], 1)
    prompts = [long_ids[i * step : i * step + q["prompt_tokens"]] for i in range(q["prompts"])]
    rows = []
    for variant in DTYPES + SIM:
        try:
            rows.append(score(model, variant, texts, prompts, new))
        except Exception as exc:  # one failing must not hide the others
            rows.append({"kv_cache_dtype": variant, "failed": True, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(f"kv-quality: {variant} done", flush=True)
    del model
    gc.collect()
    for r in rows:
        ref = next(x for x in rows if x["kv_cache_dtype"] == ("sim:none" if r["kv_cache_dtype"] in SIM else "fp32"))
        if r.get("failed") or ref.get("failed"):
            continue
        for name in texts:
            r[f"ppl_{name}_vs_fp32_pct"] = (r[f"ppl_{name}"] / ref[f"ppl_{name}"] - 1) * 100
        r["agreement"] = agreement(r["greedy"], ref["greedy"])
    tokens = {name: len(ids) for name, ids in texts.items()}
    return {
        "model": model_id,
        "weights": weights,
        "tokens": tokens,
        "new": new,
        "prompt_tokens": q["prompt_tokens"],
        "rows": rows,
    }


def print_kv_quality(result: dict) -> None:
    t = result["tokens"]
    print(
        f"\n== workload kv-quality == ({result['model']}, WEIGHTS={result['weights']}; perplexity of the passage "
        f"({t['passage']} tokens) and README@{LONG_COMMIT} ({t['long']} tokens); greedy {result['new']} tokens "
        f"after {len(result['rows'][0].get('greedy', []))} prompts of {result['prompt_tokens']})"
    )
    print(
        f"{'KV dtype':<12}{'B/token':>9}{'ppl passage':>13}{'vs fp32':>9}{'ppl long':>10}{'vs fp32':>9}"
        f"{'greedy =':>10}  first difference (sim: against sim:none)"
    )
    for r in result["rows"]:
        if r.get("failed"):
            print(f"{r['kv_cache_dtype']:<12}  FAILED: {r['error']}")
            continue
        a = r.get("agreement", {"equal_share": float("nan"), "first_difference": []})
        print(
            f"{r['kv_cache_dtype']:<12}{r['bytes_per_token'] or 'sim':>9}{r['ppl_passage']:>13.4f}"
            f"{r.get('ppl_passage_vs_fp32_pct', 0):>+8.2f}%{r['ppl_long']:>10.4f}"
            f"{r.get('ppl_long_vs_fp32_pct', 0):>+8.2f}%"
            f"{a['equal_share'] * 100:>9.1f}%  {a['first_difference']}"
        )


def kv_quality_workload(workloads: list[str], model_id: str, root: str, quick: bool) -> dict | None:
    """The benchmark's hook: when ``kv-quality`` is among the workloads, run and print it (else None)."""
    if "kv-quality" not in workloads:
        return None
    result = run_kv_quality(model_id, root, quick)
    print_kv_quality(result)
    return result
