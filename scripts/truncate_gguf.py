#!/usr/bin/env python
"""A GGUF holding only the first N transformer blocks of another: a draft model of the same tokenizer.

    python -m scripts.truncate_gguf smollm2 --layers 8 -o /tmp/smollm2-8.gguf   # the alias, or a .gguf path
    python -m scripts.truncate_gguf smollm2 --layers 8 --last 4 -o /tmp/smollm2-4+4.gguf  # first 4 and last 4

Every metadata field is copied (the tokenizer, the chat template, the hyperparameters) but ``<arch>.block_count``,
which becomes N; every tensor is copied as it is stored (its quantization unchanged) but those of the blocks left
out. By default the first N blocks are kept: an early exit of the original (its embedding, final norm and lm_head
feed on block N's output). ``--last M`` keeps the last M of the N from the end of the original instead (the first
N - M, then the last M, renumbered): the layer-skipping draft of self-speculative decoding, whose last blocks still
see what they were trained on. Written with gguf-py (``gguf.GGUFWriter``), as llama.cpp's ``gguf_new_metadata.py``
copies a file.
"""

from __future__ import annotations

import argparse
import os
import re

BLOCK = re.compile(r"blk\.(\d+)\.")


def truncate(source: str, out: str, layers: int, last: int = 0) -> str:
    """Write ``out``: ``source`` (a .gguf) with ``layers`` of its blocks, the first ``layers - last`` and the last
    ``last``, renumbered in order. Returns ``out``."""
    import gguf

    reader = gguf.GGUFReader(source, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.get_field(count_key).contents()
    if not 1 <= layers <= total or not 0 <= last <= layers:
        raise SystemExit(f"--layers must be in [1, {total}] ({source} has {total} blocks), --last in [0, --layers]")
    kept_blocks = [*range(layers - last), *range(total - last, total)]  # old block ids, in their new order
    new_id = {old: new for new, old in enumerate(kept_blocks)}
    writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [(t, _renamed(t.name, new_id)) for t in reader.tensors]
    kept = [(t, name) for t, name in kept if name is not None]
    for t, name in kept:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, _ in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return out


def _renamed(name: str, new_id: dict[int, int]) -> str | None:
    """A tensor's name in the truncated file (its block renumbered), or None for a block left out."""
    m = BLOCK.match(name)
    if not m:
        return name
    block = int(m.group(1))
    return None if block not in new_id else f"blk.{new_id[block]}.{name[m.end() :]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a .gguf file, or a MODEL_ID alias (smollm2)")
    ap.add_argument("--layers", type=int, required=True, help="blocks to keep (the first N)")
    ap.add_argument("--last", type=int, default=0, help="of those, taken from the end of the original (default 0)")
    ap.add_argument("-o", "--out", required=True, help="the .gguf to write")
    args = ap.parse_args()
    from models.loading.model_id import alias_path

    source = alias_path(args.source)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(truncate(source, args.out, args.layers, args.last))


if __name__ == "__main__":
    main()
