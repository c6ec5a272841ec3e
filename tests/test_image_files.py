"""Starting a GGUF: its model image holds no second copy of the file's weights (the runner maps the file itself), a
second start is a cache hit, and the tokenizer/config conversion reads the header through our parser with the same
result as gguf-py's reader (docs/architecture.md "Loading a GGUF")."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from test_gguf_parity import gguf_case

from models import image
from models.gguf.reader import fields_reader_installed, open_gguf
from models.image_files import MODEL_FILE, FileTensors
from models.kernels import step_abi

from conftest import need_kernel

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gguf() -> str:
    """A small Llama GGUF holding every type, Q/K rows permuted as llama.cpp's converter writes them."""
    return gguf_case("llama", 0)[0]


@pytest.fixture
def images(tmp_path, monkeypatch) -> str:
    """A private images/ directory (the kernels stay in the shared cache: built once per machine)."""
    root = str(tmp_path / "cache")
    monkeypatch.setattr(image, "cache_subdir", lambda name: os.path.join(root, name))
    return root


def test_fields_reader_gives_transformers_what_gguf_reader_gives(gguf):
    """transformers' GGUF metadata load (config, tokenizer, tokenizer_config) is the same through ``FieldsReader``
    as through gguf-py's ``GGUFReader``."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    want = load_gguf_checkpoint(gguf)
    with fields_reader_installed():
        got = load_gguf_checkpoint(gguf)
    assert got == want and len(got["tokenizer"]["tokens"]) > 100


def test_a_gguf_image_serves_the_files_own_bytes(gguf, tmp_path):
    """Every matrix the load leaves as it lies in the file (all but Llama's permuted Q/K rows and the F32 matrices,
    which become fp32 panels) is served from the file's mapping: no buffer written to weights.bin holds a file
    tensor at any of its row boundaries."""
    need_kernel(step_abi, "decode step")
    meta = image.write_image(gguf, "auto", str(tmp_path / "image"))
    assert meta["model_file"]["path"] == os.path.abspath(gguf)
    served = {e["offset"] for e in meta["buffers"].values() if e.get("file") == MODEL_FILE}
    for t in open_gguf(gguf):
        kept = len(t.shape) == 2 and t.type_name != "F32" and t.name.split(".")[-2] not in ("attn_q", "attn_k")
        assert not kept or t.data_offset in served, t.name
    files = FileTensors(gguf)
    weights = np.fromfile(tmp_path / "image" / image.WEIGHTS_FILE, np.uint8)
    assert weights.size == meta["weights_bin_bytes"]
    for name, e in meta["buffers"].items():
        if e.get("file") is None:
            data = weights[e["offset"] : e["offset"] + e["nbytes"]]
            row_bytes = e["shape"][-1] if e["dtype"] == "uint8" else data.size  # a quantized part: rows of blocks
            assert [t for *_, t in files.segments(data, row_bytes) if t is not None] == [], name


def test_a_second_start_is_a_cache_hit_and_a_changed_file_is_not_served(gguf, images, tmp_path, monkeypatch):
    """The image is built once; the next start finds it and maps it with the file. A file changed in place since the
    build is not served from the old image (its key changes, and ``check_image`` refuses the old one)."""
    from models.native import NativeModel

    need_kernel(step_abi, "decode step")
    path = str(tmp_path / "model.gguf")
    shutil.copy(gguf, path)
    built = []

    def build(source, weights, out, failure):
        built.append(source)
        image.write_image(source, weights, out)

    monkeypatch.setattr(image, "_build_in_child", build)
    first = image.ensure_image(path, "auto")
    assert image.ensure_image(path, "auto") == first and built == [path]
    model = NativeModel(first, 4, 16)
    assert set(model.maps) == {None, MODEL_FILE} and model.maps[MODEL_FILE].size == os.path.getsize(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(image.ImageError, match="has changed"):
        image.check_image(first)
    assert image.image_dir(path, "auto")[1] != first
