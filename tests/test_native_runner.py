"""The torch-free runner (models/native.py) on model images (models/image.py) against the torch model.

Both run the same compiled whole-step kernel on the same packed bytes, so where the torch model also takes its
one-call path (``_takes_fused_step``) logits and KV pools must be identical; steps past ``max_rows`` (the runner
splits them into consecutive calls, the torch model takes its torch path) must agree within float tolerance
and in greedy argmax. GPT-2 (tied: fp32 panels as the token table) and an untied Llama (GQA, RoPE; fp32 token
rows), WEIGHTS fp32 (16 rows a call), int8 and int4 (128). Also: copy_block, the image cache (built once in a
child process, reused, rebuilt on a key change, a failing child's error), unusable images, bad arguments, and
that the runner never imports torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from models import image  # noqa: E402
from models.image import ImageError  # noqa: E402
from models.kernels import build, step_abi  # noqa: E402
from models.kv_pool import KVPool  # noqa: E402
from models.loading import ModelLoadError, marker_path  # noqa: E402
from models.native import NativeModel  # noqa: E402

from conftest import need_kernel, needs_avx512, private_cache_root  # noqa: E402

BS = 4  # tokens per KV block: chunks end mid-block and on block boundaries
NB = 400  # KV blocks in each pool
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _need_kernel():
    need_kernel(step_abi, "decode step")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A private cache for this module (its images build into it once; its kernels are the run's)."""
    root = private_cache_root(str(tmp_path_factory.mktemp("native_cache")))
    before = os.environ.get("MINIBATCH_CACHE")
    os.environ["MINIBATCH_CACHE"] = root
    yield root
    if before is None:
        os.environ.pop("MINIBATCH_CACHE", None)
    else:
        os.environ["MINIBATCH_CACHE"] = before


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family_dir(request, tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    if request.param == "gpt2":
        return request.getfixturevalue("tiny_model_dir")
    return build_checkpoint(str(tmp_path_factory.mktemp("llama_native")), arch="llama", seed=2, tied=False)


def pool_arrays(model) -> list[np.ndarray]:
    """A model's K and V pools (and int8's scales) as numpy arrays of their raw elements (bf16 as its 16 bits): the
    one ``KVPool`` both runtimes step over (the torch forward's tensors view it on the CPU)."""
    return (model.kv if isinstance(model, NativeModel) else model.kv.pool).arrays()


def dequantized(arrays: list[np.ndarray], kv_dtype: str) -> list[np.ndarray]:
    """``pool_arrays`` as fp32 values: K, V."""
    k, v = arrays[:2]
    if kv_dtype == "bf16":
        return [(a.astype(np.int32) << 16).view(np.float32) for a in (k, v)]
    if kv_dtype == "int8":
        return [k * arrays[2][..., None], v * arrays[3][..., None]]
    return [k.astype(np.float32), v.astype(np.float32)]


class Pair:
    """The torch model and the native runner over the same image, each with its own pools of NB x BS (elements
    ``kv_dtype``)."""

    def __init__(self, model_dir: str, weights: str, out: str, kv_dtype: str = "fp32") -> None:
        image.write_image(model_dir, weights, out)  # in-process: the child build is tested once, below
        self.image_dir, self.kv_dtype = out, kv_dtype
        self.tm = image.build_model(model_dir, weights, num_blocks=NB, block_size=BS, kv_cache_dtype=kv_dtype)[3]
        self.nm = NativeModel(out, NB, BS, threads=2, kv_cache_dtype=kv_dtype)
        self.exact = 0  # steps compared bit for bit (the torch model took its one-call path)
        torch.set_num_threads(2)

    def both(self, *args, **kwargs) -> tuple[np.ndarray, np.ndarray]:
        """One forward through each from the same KV state; checks they agree (bit for bit where the torch model
        takes its one-call path), then leaves both with the runner's pools. -> (torch logits, runner logits)."""
        prompts = kwargs.get("prompts", ())
        one_call = self.tm._takes_fused_step(len(args[0]), prompts)
        want = self.tm.forward(*args, **kwargs)
        got = self.nm.forward(*args, **kwargs)
        mine, theirs = pool_arrays(self.nm), pool_arrays(self.tm)
        assert got.shape == want.shape and got.dtype == np.float32
        if one_call:
            self.exact += 1
            assert np.array_equal(got, want)
            assert all(np.array_equal(a, b) for a, b in zip(mine, theirs))
        else:
            # fp32 K/V within float tolerance; a narrower element may round the other way (int8: by one step), and
            # so move the logits by more
            logits_tol = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 3e-3, "int8": 3e-3}[self.kv_dtype]
            np.testing.assert_allclose(got, want, rtol=logits_tol, atol=logits_tol)
            assert (got.argmax(-1) == want.argmax(-1)).all()
            tol = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2, "int8": 2e-2}[self.kv_dtype]
            for a, b in zip(dequantized(mine, self.kv_dtype), dequantized(theirs, self.kv_dtype)):
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
            for a, b in zip(mine, theirs):  # the same state again for the next step
                b[...] = a
        return want, got


@pytest.fixture(scope="module", params=["fp32", "int8", "int4"])
def pair(request, family_dir, cache_root, tmp_path_factory) -> Pair:
    before = torch.get_num_threads()
    yield Pair(family_dir, request.param, str(tmp_path_factory.mktemp(f"image_{request.param}")))
    torch.set_num_threads(before)


# Narrower KV pools (KV_CACHE_DTYPE), each with a weights format: the 16-row calls of fp32 linears, the 128 of the
# quantized ones.
KV_PAIRS = [("int8", "fp16"), ("fp32", "bf16"), ("int4", "int8")]


@pytest.fixture(scope="module", params=KV_PAIRS, ids=[f"{w}-kv{d}" for w, d in KV_PAIRS])
def kv_pair(request, family_dir, cache_root, tmp_path_factory) -> Pair:
    weights, kv_dtype = request.param
    before = torch.get_num_threads()
    yield Pair(family_dir, weights, str(tmp_path_factory.mktemp(f"image_{weights}_kv{kv_dtype}")), kv_dtype)
    torch.set_num_threads(before)


class Sequences:
    """Random token sequences, each with its own blocks (shuffled over the pool), in a step's argument form."""

    def __init__(self, seed: int, lengths: list[int]) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = [rng.integers(3, 600, n).tolist() for n in lengths]
        free = rng.permutation(NB).tolist()
        self.tables = []
        for n in lengths:
            need = n // BS + 2  # room for decode tokens past the prompt
            self.tables.append(free[:need])
            free = free[need:]

    def chunks(self, spans: list[tuple[int, int, int]], every: tuple = ()) -> dict:
        """(sequence, start, end) spans -> forward's chunk keyword arguments."""
        return {
            "prompts": [self.tokens[i][a:b] for i, a, b in spans],
            "prompt_tables": [self.tables[i] for i, _, _ in spans],
            "prompt_starts": [a for _, a, _ in spans],
            "every_position": list(every),
        }

    def decode(self, rows: list[int], next_tokens: list[int]) -> tuple:
        """Decode rows: sequence i's next token at position len(tokens[i]) (the token is appended)."""
        positions = [len(self.tokens[i]) for i in rows]
        for i, t in zip(rows, next_tokens):
            self.tokens[i].append(int(t))
        return next_tokens, positions, [self.tables[i] for i in rows]


@pytest.mark.model
def test_mixed_steps_match_the_torch_model(pair):
    """Prefill chunks from 0 and mid-sequence, ending mid-block and on block boundaries, every-position chunks,
    decode rows riding with them; then a chunk longer than max_rows riding with decode rows (split over calls),
    and the same sequence's next chunk, from mid-sequence, split again."""
    mixed_steps(pair)


@pytest.mark.model
def test_mixed_steps_match_the_torch_model_with_narrower_kv(kv_pair):
    """The same steps over fp16, bf16 and int8 pools: the two runtimes store and read the same elements (bit for
    bit on one-call steps)."""
    mixed_steps(kv_pair)


def mixed_steps(pair: Pair) -> None:
    m = pair.nm.max_rows
    long = m + 37  # a chunk of more rows than one call takes
    seqs = Sequences(7, [6, 8, 13, 16, 11, 9, 2 * long + 5, 12, 3])
    # Step 1: whole prompts (mid-block, boundary, mid-block), first parts (boundary, mid-block, boundary).
    spans = [(0, 0, 6), (1, 0, 8), (2, 0, 13), (3, 0, 8), (4, 0, 5), (7, 0, 4)]
    out, _ = pair.both([], [], [], **seqs.chunks(spans))
    exact = pair.exact
    # Step 2 (within 16 rows: one call on both sides, fp32 too): decode rows 0-2, sequence 7 from mid-sequence
    # with every position, sequence 8 whole.
    _, got = pair.both(
        *seqs.decode([0, 1, 2], out[:3].argmax(-1).tolist()), **seqs.chunks([(7, 4, 10), (8, 0, 3)], (True, False))
    )
    assert got.shape[0] == 3 + 6 + 1 and pair.exact == exact + 1
    # Step 3: decode rows 0-2, chunk 3 from mid-sequence to a boundary with every position, chunk 4 to mid-block,
    # sequence 5 whole with every position.
    nxt = got[:3].argmax(-1).tolist()
    spans = [(3, 8, 16), (4, 5, 11), (5, 0, 9)]
    _, got = pair.both(*seqs.decode([0, 1, 2], nxt), **seqs.chunks(spans, every=(True, False, True)))
    assert got.shape[0] == 3 + 8 + 1 + 9
    # Step 4: five decode rows and sequence 6's first `long` tokens: more rows than one call.
    rows = [0, 1, 2, 3, 4]
    nxt = [t % 600 for t in range(40, 45)]
    pair.both(*seqs.decode(rows, nxt), **seqs.chunks([(6, 0, long)]))
    # Step 5: its next `long` tokens from mid-sequence (mid-block), every position, with decode rows.
    _, got = pair.both(*seqs.decode(rows, nxt), **seqs.chunks([(6, long, 2 * long)], every=(True,)))
    assert got.shape[0] == 5 + long


@pytest.mark.model
def test_decode_steps_past_max_rows_split(pair):
    """A decode-only step of max_rows + 3 rows (two calls), after their prompts' prefill (split too)."""
    n = pair.nm.max_rows + 3
    seqs = Sequences(11, [1 + i % 3 for i in range(n)])
    out, _ = pair.both([], [], [], **seqs.chunks([(i, 0, len(t)) for i, t in enumerate(seqs.tokens)]))
    pair.both(*seqs.decode(list(range(n)), out.argmax(-1).tolist()))


@pytest.mark.model
@pytest.mark.parametrize("weights", ["int8"])
def test_long_contexts_and_thread_counts(family_dir, cache_root, tmp_path, weights):
    """A chunk whose calls cross one attention partition (512 tokens), and the same step from the same state at
    1, 2 and 3 threads: the same bits."""
    p = Pair(family_dir, weights, str(tmp_path / "image"))
    seqs = Sequences(3, [700])
    p.both([], [], [], **seqs.chunks([(0, 0, 400)]))
    k0, v0 = p.nm.kv.k.copy(), p.nm.kv.v.copy()
    runs = []
    for threads in (1, 2, 3):
        p.nm.kv.k[...], p.nm.kv.v[...] = k0, v0
        p.nm.threads = threads
        runs.append((p.nm.forward([], [], [], **seqs.chunks([(0, 400, 700)])), p.nm.kv.k.copy(), p.nm.kv.v.copy()))
    for logits, k, v in runs[1:]:
        assert np.array_equal(logits, runs[0][0]) and np.array_equal(k, runs[0][1]) and np.array_equal(v, runs[0][2])
    p.nm.kv.k[...], p.nm.kv.v[...] = k0, v0
    p.nm.threads = 2
    p.both([], [], [], **seqs.chunks([(0, 400, 700)]))


@pytest.mark.model
@needs_avx512
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_avx512_and_avx2_steps_give_the_same_bits(family_dir, cache_root, tmp_path, kernel_isa, weights):
    """The whole step under KERNEL_ISA=avx2 and auto (AVX-512 here) from the same state: decode rows alone (the
    register kernels, 1 and 5 rows) and with a prompt chunk (the L1 tiles): the same logits and KV, bit for bit."""
    p = Pair(family_dir, weights, str(tmp_path / "image"))
    seqs = Sequences(13, [9, 12, 7, 30, 5, 40])
    out, _ = p.both([], [], [], **seqs.chunks([(i, 0, len(seqs.tokens[i])) for i in range(5)]))
    steps = [
        (seqs.decode([2], out[2:3].argmax(-1).tolist()), {}),
        (seqs.decode([0, 1, 2, 3, 4], out.argmax(-1).tolist()), {}),
        (seqs.decode([0, 1, 3], [5, 6, 7]), seqs.chunks([(5, 0, 33)], every=(True,))),
    ]
    for args, chunk in steps:
        k0, v0 = p.nm.kv.k.copy(), p.nm.kv.v.copy()
        runs = []
        for choice in ("avx2", "auto"):
            kernel_isa(choice)
            p.nm.kv.k[...], p.nm.kv.v[...] = k0, v0
            runs.append((p.nm.forward(*args, **chunk), p.nm.kv.k.copy(), p.nm.kv.v.copy()))
        (a, ka, va), (b, kb, vb) = runs
        assert np.array_equal(a, b) and np.array_equal(ka, kb) and np.array_equal(va, vb)


@pytest.mark.model
def test_copy_block(pair):
    copy_block(pair)


@pytest.mark.model
def test_copy_block_with_narrower_kv(kv_pair):
    copy_block(kv_pair)


def copy_block(pair: Pair) -> None:
    """Both runtimes' copy_block: every array of the pool (int8's scales too), the same bytes."""
    seqs = Sequences(5, [10])
    pair.both([], [], [], **seqs.chunks([(0, 0, 10)]))
    src, dst = seqs.tables[0][1], seqs.tables[0][2]
    pair.nm.copy_block(src, dst)
    pair.tm.kv.copy_block(src, dst)
    mine, theirs = pool_arrays(pair.nm), pool_arrays(pair.tm)
    assert len(mine) == (4 if pair.kv_dtype == "int8" else 2)
    for a, b in zip(mine, theirs):
        assert np.array_equal(a, b) and np.array_equal(a[:, dst], a[:, src]) and np.any(a[:, src])
    with pytest.raises(ValueError, match="outside the pool"):
        pair.nm.copy_block(0, NB)


@pytest.mark.model
def test_what_the_runner_reports(pair):
    what_the_runner_reports(pair)


@pytest.mark.model
def test_what_the_runner_reports_with_narrower_kv(kv_pair):
    """The pool's bytes by dtype: fp16 / bf16 half of fp32's, int8 a quarter plus a 4-byte scale per token and
    head."""
    nm = kv_pair.nm
    what_the_runner_reports(kv_pair)
    n_layer, KVH, D = (nm.meta["kv"][k] for k in ("n_layer", "n_kv_head", "head_dim"))
    per_token = {"fp16": 2 * D, "bf16": 2 * D, "int8": D + 4}[kv_pair.kv_dtype] * 2 * n_layer * KVH
    assert nm.kv_bytes_per_token == per_token == KVPool.bytes_per_block(n_layer, 1, KVH, D, kv_pair.kv_dtype)


def what_the_runner_reports(pair: Pair) -> None:
    nm, tm = pair.nm, pair.tm
    assert nm.n_vocab == tm.lm_head.out_features and nm.max_rows == tm.fused_step.max_rows
    assert nm.kv_nbytes == tm.kv.nbytes
    assert nm.resident_weights() == tm.resident_weights() and nm.weight_bytes() == tm.weight_bytes()
    assert nm.flops_per_token(0) == tm.flops_per_token(0) and nm.flops_per_token(777) == tm.flops_per_token(777)
    assert nm.kv_bytes_per_token * BS * NB == nm.kv_nbytes
    assert nm.context_window == 1024 and nm.vocab_size == 611
    assert os.path.isfile(os.path.join(nm.tokenizer_dir, "tokenizer.json"))
    meta = nm.meta
    for entry in meta["buffers"].values():
        assert entry["offset"] % image.ALIGN == 0
    tied = meta["model_type"] == "gpt2"  # the tied lm_head's table is written once, under one name
    assert (meta["plan"]["embed"] == meta["plan"]["lm_head"]["parts"][0]["w"]) == tied


@pytest.mark.model
def test_bad_arguments_raise(pair):
    nm, seqs = pair.nm, Sequences(9, [6])
    table = seqs.tables[0]
    with pytest.raises(ValueError, match="context window"):
        nm.forward([5], [1024], [table * 200])
    with pytest.raises(ValueError, match="block ids"):
        nm.forward([5], [1], [[NB]])
    with pytest.raises(ValueError, match="does not cover"):
        nm.forward([5], [BS], [table[:1]])
    with pytest.raises(ValueError, match="token ids"):
        nm.forward([611], [0], [table])
    with pytest.raises(ValueError, match="empty prompt chunk"):
        nm.forward([], [], [], [[]], [table])
    with pytest.raises(ValueError, match="differ"):
        nm.forward([5, 6], [0], [table])
    assert nm.forward([], []).shape == (0, nm.n_vocab)


# --- the image cache and the image files ---------------------------------------------------------------------


@pytest.mark.model
def test_ensure_image_builds_once_in_a_child_and_reuses(tiny_model_dir, cache_root, tmp_path, monkeypatch):
    """The first call builds in a child (the same bytes the in-process writer gives), the second reuses it, a
    damaged one is built again; a changed model file or WEIGHTS or code is another key, and a changed file really
    rebuilds. "auto" is fp32 for a checkpoint directory (only a GGUF has a precision of its own)."""
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, model_dir)
    built = []
    real = image._build_in_child
    monkeypatch.setattr(image, "_build_in_child", lambda *a: (built.append(a[0]), real(*a))[1])
    first = image.ensure_image(model_dir, "int4")
    assert built == [os.path.abspath(model_dir)] and first.startswith(os.path.join(cache_root, "images"))
    assert [n for n in os.listdir(os.path.dirname(first)) if ".tmp-" in n] == []
    image.write_image(model_dir, "int4", str(tmp_path / "here"))
    with open(os.path.join(first, image.WEIGHTS_FILE), "rb") as a, open(tmp_path / "here" / "weights.bin", "rb") as b:
        assert a.read() == b.read()
    assert image.ensure_image(model_dir, "int4") == first and len(built) == 1
    with open(os.path.join(first, image.WEIGHTS_FILE), "r+b") as f:  # damaged after its build: built again
        f.truncate(100)
    assert image.ensure_image(model_dir, "int4") == first and len(built) == 2
    NativeModel(first, 4, BS)
    assert image.image_dir(model_dir, "int8")[1] != first
    assert image.image_dir(model_dir, "auto")[1] == image.image_dir(model_dir, "fp32")[1]
    monkeypatch.setattr(image, "code_hash", lambda: "edited")
    assert image.image_dir(model_dir, "int4")[1] != first
    monkeypatch.undo()
    monkeypatch.setattr(image, "_build_in_child", lambda *a: (built.append(a[0]), real(*a))[1])
    weights_file = os.path.join(model_dir, "model.safetensors")
    st = os.stat(weights_file)
    os.utime(weights_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = image.ensure_image(model_dir, "int4")
    assert second != first and len(built) == 3 and os.path.isdir(first)  # superseded, but used a moment ago
    NativeModel(second, 4, BS)
    day_ago = time.time() - image.PRUNE_UNUSED_S - 60
    for out in (first, second):
        os.utime(marker_path(out), (day_ago, day_ago))
    assert image.ensure_image(model_dir, "int4") == second and len(built) == 3
    assert time.time() - os.path.getmtime(marker_path(second)) < 60  # the use is stamped
    assert not os.path.exists(first)  # superseded and unused for a day: pruned


def _fake_image(root, name: str, marker: dict | None, age_s: float, now: float) -> str:
    """A directory in the image cache: a built image when ``marker`` is given (its marker ``age_s`` old)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    stamp = now - age_s
    if marker is not None:
        with open(marker_path(path), "w") as f:
            json.dump(marker, f)
        os.utime(marker_path(path), (stamp, stamp))
    os.utime(path, (stamp, stamp))
    return path


def test_prune_images_removes_only_unused_images_that_cannot_be_served(tmp_path):
    """Unused for a day and (other code | other format | superseded | model gone) -> removed; a killed build's
    directory after BUILD_TIMEOUT_S; everything else (recent, another live model, a hub id, not an image) stays."""
    root, now, code = str(tmp_path / "images"), time.time(), image.code_hash()
    old, recent = image.PRUNE_UNUSED_S + 60, image.PRUNE_UNUSED_S - 60
    live = tmp_path / "live.gguf"
    live.write_bytes(b"x")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"x")

    def marker(source, weights="int8", code=code, fmt=image.IMAGE_FORMAT):
        return {"source": str(source), "weights": weights, "format": fmt, "code": code}

    keep = _fake_image(root, "live-int8-new", marker(live), 0, now)
    gone = {
        _fake_image(root, "live-int8-old", marker(live), old, now),  # superseded by keep
        _fake_image(root, "other-int8-edited", marker(other, code="edited"), old, now),
        _fake_image(root, "other-int8-format0", marker(other, fmt=0), old, now),
        _fake_image(root, "other-int8-nocode", {"source": str(other), "weights": "int8", "format": 1}, old, now),
        _fake_image(root, "deleted-int4-x", marker(tmp_path / "deleted" / "model"), old, now),
        _fake_image(root, "live-int8-x.tmp-killed", None, image.BUILD_TIMEOUT_S + 60, now),
    }
    kept = {
        _fake_image(root, "live-int8-recent", marker(live), recent, now),  # superseded but used within a day
        _fake_image(root, "live-int4-y", marker(live, "int4"), old, now),  # the same model at other WEIGHTS
        _fake_image(root, "other-int8-y", marker(other), old, now),  # another model that still exists
        _fake_image(root, "org_tiny-int8-y", marker("org/tiny"), old, now),  # a hub id: never "gone"
        _fake_image(root, "live-int8-z.tmp-building", None, 60, now),  # a build in progress
        _fake_image(root, "not-an-image", None, old, now),
    }
    assert set(image.prune_images(keep, now)) == gone
    assert set(os.path.join(root, n) for n in os.listdir(root)) == kept | {keep}
    assert image.prune_images(keep, now + old) != []  # the recent one's day has passed too


def _hub_cache(root, repo: str, commit: str) -> None:
    """A Hugging Face hub cache holding ``repo``'s config.json at ``commit`` (main points there)."""
    base = os.path.join(root, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    os.makedirs(os.path.join(base, "snapshots", commit), exist_ok=True)
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(commit)
    with open(os.path.join(base, "snapshots", commit, "config.json"), "w") as f:
        f.write("{}")


def test_a_hub_ids_image_is_keyed_by_its_cached_revision(cache_root, tmp_path, monkeypatch):
    """A hub id's key names the commit its cached snapshot is at (no network): a new revision is a new image; the
    first build (which downloads the snapshot) moves its image to the key of the revision it fetched."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert image.hub_revision("org/tiny") is None and image.hub_revision("not a hub id!") is None
    uncached = image.image_dir("org/tiny", "int8")[1]
    _hub_cache(tmp_path / "hub", "org/tiny", "a" * 40)
    assert image.hub_revision("org/tiny") == "a" * 40
    at_a = image.image_dir("org/tiny", "int8")[1]
    assert at_a != uncached and image.image_dir("org/tiny", "int8") == ("org/tiny", at_a)
    _hub_cache(tmp_path / "hub", "org/tiny", "b" * 40)
    assert image.image_dir("org/tiny", "int8")[1] not in (uncached, at_a)
    os.makedirs(uncached)  # as the first build left it, before the snapshot existed
    settled = image._settle("org/tiny", "int8", uncached)
    assert settled == image.image_dir("org/tiny", "int8")[1] and os.path.isdir(settled)
    assert not os.path.exists(uncached)


@pytest.mark.model
def test_a_failing_build_raises_with_the_childs_error(cache_root, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "gpt2", "n_layer": "many"}')
    with pytest.raises(ModelLoadError, match="could not build its model image") as info:
        image.ensure_image(str(broken), "int8")
    assert "'n_layer'" in str(info.value) and "\n" not in str(info.value)  # the child's own error, one line
    images = os.path.join(cache_root, "images")
    assert [n for n in os.listdir(images) if n.startswith("broken")] == []  # nothing half-built left


@pytest.mark.model
def test_unusable_images_fail_clearly(pair, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(pair.image_dir, bad)
    weights = os.path.join(bad, image.WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 64)
    with pytest.raises(ImageError, match="truncated"):
        NativeModel(bad, 4, BS)
    os.remove(weights)
    with pytest.raises(ImageError, match="missing"):
        NativeModel(bad, 4, BS)
    meta_path = os.path.join(bad, image.META_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    shutil.copy(os.path.join(pair.image_dir, image.WEIGHTS_FILE), weights)
    del meta["plan"]["layers"][0]["qkv"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ImageError, match="malformed"):
        NativeModel(bad, 4, BS)
    with open(meta_path, "w") as f:
        f.write('{"format": 1, "plan": ')
    with pytest.raises(ImageError, match="cannot be read"):
        NativeModel(bad, 4, BS)
    os.remove(meta_path)
    with pytest.raises(ImageError, match="cannot be read"):
        NativeModel(bad, 4, BS)
    with pytest.raises(ValueError, match="block_size"):
        NativeModel(pair.image_dir, 4, 1000)


def test_cpu_flags_gate_the_kernel_without_torch(monkeypatch):
    from models.kernels import build

    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse2", "avx2"})
    with pytest.raises(RuntimeError, match="lacks fma, f16c"):
        build.require_cpu_flags(("avx2", "fma", "f16c"), "AVX2, FMA and F16C")
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    build.require_cpu_flags(("avx2", "fma", "f16c"), "AVX2, FMA and F16C")


NO_TORCH = """
import json, sys
import numpy as np
from models.kernels import int_dot
from models.native import NativeModel
image_dir, out, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
int_dot.set_activations("fp32")  # the exact path, as the tests' session fixture sets it in this process
model = NativeModel(image_dir, args["nb"], args["bs"], threads=2)
first = model.forward([], [], [], args["prompts"], args["tables"])
second = model.forward(first.argmax(-1).tolist(), [len(p) for p in args["prompts"]], args["tables"])
np.save(out, np.concatenate([first, second]))
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print("imported:", bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.model
def test_the_runner_imports_no_torch(pair, tmp_path):
    """A fresh interpreter loads the image and runs a prefill and a decode step without importing torch or
    transformers, and gets the in-process runner's logits (which ``both`` checks against the torch model's)."""
    seqs = Sequences(13, [7, 12])
    args = {"nb": NB, "bs": BS, "prompts": seqs.tokens, "tables": seqs.tables}
    out = str(tmp_path / "logits.npy")
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, pair.image_dir, out, json.dumps(args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=build.COMPILE_TIMEOUT_S,  # the child builds quant_gemm.c into this module's cache: minutes when loaded
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, first = pair.both([], [], [], seqs.tokens, seqs.tables)
    _, second = pair.both(first.argmax(-1).tolist(), [len(p) for p in seqs.tokens], seqs.tables)
    assert np.array_equal(np.load(out), np.concatenate([first, second]))
