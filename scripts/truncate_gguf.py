#!/usr/bin/env python
"""A GGUF holding only the first N transformer blocks of another: a draft model of the same tokenizer.

    python -m scripts.truncate_gguf smollm2 --layers 8 -o /tmp/smollm2-8.gguf   # the alias, or a .gguf path

Every metadata field is copied (the tokenizer, the chat template, the hyperparameters) but ``<arch>.block_count``,
which becomes N; every tensor is copied as it is stored (its quantization unchanged) but those of blocks N and
later. The embedding, the final norm and the lm_head are the original's, so the truncated model is a (poor) early
exit of the original: it agrees with it on the easiest tokens, which is what a draft is for. Written with gguf-py
(``gguf.GGUFWriter``), as llama.cpp's ``gguf_new_metadata.py`` copies a file.
"""

from __future__ import annotations

import argparse
import os
import re

BLOCK = re.compile(r"blk\.(\d+)\.")


def truncate(source: str, out: str, layers: int) -> str:
    """Write ``out``: ``source`` (a .gguf) with its first ``layers`` blocks only. Returns ``out``."""
    import gguf

    reader = gguf.GGUFReader(source, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.get_field(count_key).contents()
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers must be in [1, {total}] ({source} has {total} blocks)")
    writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not (m := BLOCK.match(t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a .gguf file, or a MODEL_ID alias (smollm2)")
    ap.add_argument("--layers", type=int, required=True, help="blocks to keep (the first N)")
    ap.add_argument("-o", "--out", required=True, help="the .gguf to write")
    args = ap.parse_args()
    from models.loading.model_id import alias_path

    source = alias_path(args.source)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(truncate(source, args.out, args.layers))


if __name__ == "__main__":
    main()
