"""Memory high-water under many distinct prompt lengths (``models/native_memory.py``).

Each distinct prompt length is a new shape for every linear; oneDNN's and ideep's per-shape caches and
the heap used to grow RSS by ~500 MB over 300 lengths on the tiny model, and further on a second pass.
A fresh interpreter (the cache caps must be in place before torch's first oneDNN op) runs 150 distinct
lengths twice and reports RSS; the growth must stay bounded and the second pass must not grow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from test_llama import GGUF_CACHE
from test_llama import smollm2_gguf as smollm2_gguf  # a fixture

pytestmark = pytest.mark.model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import sys
    from config import Config
    from models.runtime import HFEngine
    from core.sequence import Sequence

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

    engine = HFEngine(Config(model_id=sys.argv[1], max_batch_size=4, num_threads=2))
    vocab = len(engine.tokenizer)

    def one_pass():
        for length in range(2, 302, 2):  # 150 distinct prompt lengths, each prefilled then decoded
            prompt = [(i * 7 + length) % (vocab - 1) + 1 for i in range(length)]
            seq = Sequence(prompt_token_ids=prompt, max_new_tokens=2, ignore_eos=True)
            engine.admit([seq])
            engine.step()

    start = rss_mb()
    one_pass()
    first = rss_mb()
    one_pass()
    print("RSS", start, first, rss_mb())
    """
)


def test_distinct_prompt_lengths_keep_rss_bounded(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model_dir], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    start, first, second = (int(x) for x in proc.stdout.split("RSS", 1)[1].split())
    # Measured: +54 MB over 300 lengths with the caps and trimming, +526 MB without.
    assert first - start < 150, (start, first, second)
    assert second - first < 40, (start, first, second)


# --- a GGUF served at its own precision: tokenizer and config converted once, read back without transformers' model
# classes; the load's peak RSS ---------------------------------------------------------------------------------------


def write_tiny_gguf(path) -> str:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "gpt2")  # gpt2: no config keys checked before the (stubbed) conversion
    writer.add_tensor("w", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_metadata_is_converted_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    from models.loading import convert as loading

    monkeypatch.setenv("MINIBATCH_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    calls = []

    def convert(src: str, out: str) -> None:  # stands in for the child process's transformers conversion
        calls.append(src)
        if len(calls) == 3:
            raise RuntimeError("the converter failed")
        with open(os.path.join(out, "tokenizer.json"), "w") as f:
            f.write(str(len(calls)))

    monkeypatch.setattr(loading, "_metadata_in_child", convert)
    first = loading.gguf_metadata_dir(path)
    assert loading.gguf_metadata_dir(path) == first and calls == [path]  # the second load reads the cache
    with open(os.path.join(first, "tokenizer.json")) as f:
        assert f.read() == "1"
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: its cache is stale
    second = loading.gguf_metadata_dir(path)
    assert second != first and len(calls) == 2
    with open(os.path.join(second, "tokenizer.json")) as f:
        assert f.read() == "2"
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    with pytest.raises(loading.ModelLoadError, match="converter failed") as info:
        loading.gguf_metadata_dir(path)
    assert path in str(info.value) and "\n" not in str(info.value)
    assert sorted(os.listdir(os.path.dirname(first))) == sorted(os.path.basename(d) for d in (first, second))


def tiny_config(model_type: str, **extra):
    import transformers

    if model_type == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=100, **extra)
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=64, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_saved_config_has_every_attribute_of_the_config_class(tmp_path, model_type):
    import json

    import transformers

    from models.loading import convert as loading

    cfg = tiny_config(model_type)
    generation = transformers.GenerationConfig.from_model_config(cfg)
    loading.save_config(str(tmp_path), cfg, generation)
    config, generation_config = loading.saved_config(str(tmp_path))
    assert isinstance(config, loading.PlainConfig)
    for key, value in json.loads(cfg.to_json_string(use_diff=False)).items():
        assert getattr(config, key) == value, key
    assert cfg.attribute_map or model_type == "llama"
    for alias in cfg.attribute_map:  # GPT-2's hidden_size, num_attention_heads...
        assert getattr(config, alias) == getattr(cfg, alias), alias
    for key in ("model_type", "vocab_size", "num_attention_heads", "hidden_size", "num_hidden_layers"):
        assert getattr(config, key) == getattr(cfg, key), key
    assert generation_config.eos_token_id == generation.eos_token_id
    assert not hasattr(config, "no_such_attribute")


def test_a_scaled_rope_config_comes_back_as_its_transformers_class(tmp_path):
    import transformers

    from models.loading import convert as loading

    cfg = tiny_config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    loading.save_config(str(tmp_path), cfg, transformers.GenerationConfig.from_model_config(cfg))
    config, _ = loading.saved_config(str(tmp_path))
    assert type(config) is transformers.LlamaConfig and config.rope_parameters["rope_type"] == "linear"


SERVE_GGUF = textwrap.dedent(
    """
    import json, sys
    from config import Config
    from models.runtime import HFEngine
    from models.native_memory import memory_mib

    engine = HFEngine(Config(model_id=sys.argv[1], max_batch_size=8, max_model_len=256, num_threads=1))
    memory = memory_mib()
    heavy = sorted(m for m in ("sympy", "torch.distributed.tensor", "transformers.models.llama.configuration_llama")
                   if m in sys.modules)
    print("RESULT " + json.dumps({"heavy": heavy, "memory": memory}))
    """
)


def test_smollm2_gguf_loads_without_model_classes_and_peaks_at_its_final_rss(smollm2_gguf):
    """A fresh interpreter serving the GGUF at its own precision imports none of transformers' model (config)
    modules (sympy, torch.distributed: ~55 MB) and its peak RSS during the load stays close to its RSS after
    (issue 15: under 2x). The tokenizer read through its own class is AutoTokenizer's, token for token."""
    import json

    import transformers

    from models.loading import convert as loading

    env = {**os.environ, "MINIBATCH_CACHE": GGUF_CACHE}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_GGUF, smollm2_gguf], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["heavy"] == [], result
    # Issue 15's bound is 2x; measured 1.0x (the load's transients are gone or trimmed before the KV pool comes).
    assert result["memory"]["VmHWM"] < 1.25 * result["memory"]["VmRSS"], result["memory"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIBATCH_CACHE", GGUF_CACHE)
        meta = loading.gguf_metadata_dir(smollm2_gguf)  # the child's conversion, found in the cache
    ours, auto = loading.saved_tokenizer(meta), transformers.AutoTokenizer.from_pretrained(meta)
    text = "<|im_start|>user\\nWhat is the capital of France? déjà vu 😀<|im_end|>\\n"
    assert type(ours) is type(auto) and len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
    assert ours.encode(text) == auto.encode(text) and ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert ours.chat_template == auto.chat_template and ours.eos_token_id == auto.eos_token_id


# --- a checkpoint's mapped pages leave RSS as the model packs them ---------------------------------------------------


def _resident_pages(t) -> int:
    """Pages of ``t``'s span mapped in this process (``/proc/self/pagemap``'s present bit: in our RSS, which
    mincore, reporting the page cache, cannot tell)."""
    import mmap
    import struct

    first = t.data_ptr() // mmap.PAGESIZE
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{last - first + 1}Q", f.read((last - first + 1) * 8))
    return sum(e >> 63 for e in entries)


def test_release_file_pages_drops_clean_file_pages_and_nothing_else(tmp_path):
    """A clean private file mapping (how safetensors maps a checkpoint): its pages leave RSS and read back with
    the same values. A mapping with a modified page, and anonymous memory, are left as they are."""
    torch = pytest.importorskip("torch")
    from models.state_dict import release_file_pages

    values = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    path = str(tmp_path / "weights.bin")
    values.numpy().tofile(path)

    mapped = torch.from_file(path, shared=False, size=values.numel(), dtype=torch.float32)  # MAP_PRIVATE
    assert torch.equal(mapped, values) and _resident_pages(mapped) > 0  # read: every page faulted in
    assert release_file_pages(mapped) >= values.numel() * 4 - 2 * 4096  # whole pages inside the span
    assert _resident_pages(mapped) <= 2 and torch.equal(mapped, values)  # gone from RSS, and read back from the file

    dirty = torch.from_file(path, shared=False, size=values.numel(), dtype=torch.float32)
    dirty[7] = -1.0  # one privately modified page: releasing would revert it to the file's value
    assert release_file_pages([dirty]) == 0 and dirty[7] == -1.0 and torch.equal(dirty[8:], values[8:])

    anonymous = values.clone()
    assert release_file_pages([anonymous, "not a tensor"]) == 0 and torch.equal(anonymous, values)


def test_an_fp32_checkpoint_loads_without_holding_its_file_in_rss(tiny_model_dir, tmp_path):
    """Packing a safetensors checkpoint releases each block's mapped pages: after the build, the HF model still
    alive, the model file's mapping holds (almost) nothing in RSS, and the forward equals HF's."""
    torch = pytest.importorskip("torch")
    from models import families
    from models.loading import load_checkpoint

    _, hf = load_checkpoint(tiny_model_dir, "fp32")
    model = families()["gpt2"](hf.eval(), 2, 64, torch.device("cpu"), num_blocks=8, block_size=16)
    weights = [p for p in hf.parameters() if p.numel() * 4 >= 1 << 16]
    assert weights and sum(_resident_pages(p) for p in weights) <= 2 * len(weights)  # partial end pages at most
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        want = hf(ids).logits[0, -1]
    got = model.forward_rows([], [], [], [ids[0].tolist()], [[0]])[0]
    assert torch.allclose(torch.as_tensor(got), want, atol=1e-4)


def test_a_large_table_leaves_rss_chunk_by_chunk_as_it_is_packed(tmp_path, monkeypatch):
    """An fp32 Linear packed from a mapped checkpoint table of several chunks releases each chunk's pages as its
    panels fill (so the table and its panels are never both resident), and the panels hold the table's values."""
    torch = pytest.importorskip("torch")
    from models.kernels import small_gemm
    from models.layers import Linear

    monkeypatch.setattr(small_gemm, "RELEASE_CHUNK_BYTES", 64 << 10)
    table = torch.randn(1024, 256)  # 1 MiB: 16 chunks
    path = str(tmp_path / "table.bin")
    table.numpy().tofile(path)
    mapped = torch.from_file(path, shared=False, size=table.numel(), dtype=torch.float32).view(1024, 256)
    released = []
    real = small_gemm.pack

    def pack(w, release=None):  # record what the Linear's release gave back for each chunk
        return real(w, lambda rows: released.append(release(rows)))

    monkeypatch.setattr(small_gemm, "pack", pack)
    lin = Linear(mapped, None, onednn=False, batch_hint=1, small=True, table=True)
    assert len(released) == 17 and all(r > 0 for r in released[:16])  # each chunk released as it was copied,
    # then the whole table: what reading a chunk mapped back of the one before (fault-around) goes too
    assert _resident_pages(mapped) <= 2
    assert torch.equal(small_gemm.rows(lin.table(), torch.arange(1024)), table)
