"""The torch-free runner: a model image (``models/image.py``) stepped by the whole-step kernel, numpy around it.

``NativeModel`` maps the image's ``weights.bin`` read-only (its pages are the resident weights: no copy, and pages
never read, e.g. RoPE rows past the longest context, never become resident), allocates the KV pools with numpy
(zeroed lazily by the OS: the pool costs RSS only as it fills), rebuilds the kernel's structs with pointers into
the mapping (``kernels/step_abi.py``, the same code ``decode_step.StepPlan`` uses) and runs ``forward``
(``model_runner.ModelRunner``'s) through ``step_abi.StepKernel.run``, the one kernel-call setup both runtimes use,
returning numpy logits.

LoRA adapters (``models/lora.py``) go to the kernel as ``kernels/lora_step.KernelLora`` structs pointing at their
own numpy arrays; each call groups its rows by adapter. The image records the linears adapters may target.

A step of more rows than the image's ``max_rows`` (many decode rows, a long prompt chunk) runs as consecutive
calls of at most ``max_rows`` rows in row order (``StepKernel.run``: exact, attention being causal).

Importing this module, building a ``NativeModel`` and running steps import no torch. OpenMP reads its settings
(wait policy, spin count) once, when the kernel's libgomp loads: set them
(``models.runtime_config.thread_environment``) before the first ``NativeModel``. Shapes: N rows (decode tokens,
then each chunk's tokens), V logits per row, KVH K/V heads, D head_dim.
"""

from __future__ import annotations

import os

import numpy as np

from model_runner import RowsForward
from models import kv_dtype
from models.image import TOKENIZER_DIR, WEIGHTS_FILE, ImageError, check_image
from models.image_files import MODEL_FILE
from models.kernels import int_dot, packing, step_abi
from models.kernels.lora_step import KernelLora
from models.kv_pool import KVPool
from models.lora import targets_from_json
from models.step_layout import StepLayout, StepLimits


def unavailable_reason() -> str | None:
    """Why this machine cannot run model images (no AVX2/FMA/F16C, no C compiler, a failed build), or None."""
    return None if step_abi.load() is not None else step_abi.KERNEL.unavailable_reason or "the kernel did not load"


def _map(path: str) -> np.ndarray:
    """A file mapped read-only (shared: its pages are the page cache's) as uint8; an empty file as an empty array."""
    if os.path.getsize(path) == 0:  # mmap refuses an empty file; no buffer points into it
        return np.zeros(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def _map_files(image_dir: str, meta: dict) -> dict:
    """{an image.json buffer's "file" (None: weights.bin): that file mapped} (``check_image`` has checked their
    sizes): weights.bin, and the GGUF file whose own bytes most buffers are (``models/image_files.py``)."""
    maps = {None: _map(os.path.join(image_dir, WEIGHTS_FILE))}
    if meta.get("model_file") is not None:
        maps[MODEL_FILE] = _map(meta["model_file"]["path"])
    return maps


class NativeModel(RowsForward):
    """One model image with its own KV pool, stepped without torch.

    ``num_blocks`` KV blocks of ``block_size`` tokens of ``kv_cache_dtype`` elements (``self.kv``, a
    ``models.kv_pool.KVPool``: the pool class the torch forward views too); ``threads`` OpenMP threads per step;
    ``pack``: repack the packable linears for the integer path (``kernels/packing.py``; None: ``packing.wanted``).
    Raises ``ImageError`` for an unusable image, ``RuntimeError`` when the kernel cannot be built or run here,
    ValueError for an unknown dtype.
    """

    def __init__(
        self,
        image_dir: str,
        num_blocks: int,
        block_size: int,
        threads: int = 1,
        kv_cache_dtype: str = "fp32",
        pack: bool | None = None,
    ) -> None:
        meta = check_image(image_dir)
        try:
            spec = step_abi.spec_from_json(meta["plan"])
            self.maps = _map_files(image_dir, meta)  # held: the structs point into them
            base = {file: m.ctypes.data for file, m in self.maps.items()}
            addresses = {name: base[e.get("file")] + e["offset"] for name, e in meta["buffers"].items()}
            addresses = step_abi.map_buffers(spec, lambda _, name: addresses[name])
        except (KeyError, TypeError, ValueError) as exc:
            raise ImageError(f"model image {image_dir}: image.json is malformed ({type(exc).__name__}: {exc})") from exc
        kv_dtype.check(kv_cache_dtype)
        if not 0 < block_size <= meta["max_block_size"] or num_blocks < 1 or threads < 1:
            raise ValueError(
                f"need 1 <= block_size <= {meta['max_block_size']}, num_blocks >= 1, threads >= 1 "
                f"(got {block_size}, {num_blocks}, {threads})"
            )
        lib = step_abi.load()
        if lib is None:
            raise RuntimeError(f"the decode step kernel cannot run here: {step_abi.KERNEL.unavailable_reason}")
        # Packable linears (Q4_K, Q6_K) repacked for the integer path, where it gains (kernels/packing.py): the
        # mapped source's pages are released chunk by chunk, so the resident bytes stay the file's
        self.packed_buffers, self.packed_bytes = [], 0
        types = packing.wanted(lib) if pack is None else int_dot.PACKABLE if pack else ()
        if types:
            addresses, self.packed_buffers, self.packed_bytes = packing.pack_linears(addresses, lib, threads, types)
        self.meta, self.image_dir, self.threads = meta, image_dir, threads
        self.model_type, self.vocab_size, self.n_vocab = meta["model_type"], meta["vocab_size"], meta["n_vocab"]
        self.context_window, self.eos_ids = meta["context_window"], set(meta["eos_ids"])
        self.max_rows, self.kv_cache_dtype = meta["max_rows"], kv_cache_dtype
        self.tokenizer_dir = os.path.join(image_dir, TOKENIZER_DIR)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.step_limits = StepLimits(
            block_size, num_blocks, meta["embed_rows"], meta["context_window"], meta.get("kv_window", 0)
        )
        n_layer, KVH, D = meta["kv"]["n_layer"], meta["kv"]["n_kv_head"], meta["kv"]["head_dim"]
        self.kv_bytes_per_token = kv_dtype.bytes_per_token(kv_cache_dtype, n_layer, KVH, D)
        self.kv = KVPool(n_layer, num_blocks, block_size, KVH, D, kv_cache_dtype)
        pools = [self.kv.layer_addresses(i) for i in range(n_layer)]
        self.structs = step_abi.Structs(addresses, pools, self.kv.geometry())
        self.step = step_abi.StepKernel(lib, self.structs, spec.C, self.max_rows)
        self.n_embd = spec.C  # the model's width: a final hidden state's size

    # --- LoRA adapters (models/lora.py): the kernel's hook after each targeted linear ---

    lora: KernelLora | None = None

    def lora_targets(self) -> list:
        """The linears adapters may target (``lora.Target``s), as the image recorded them."""
        return targets_from_json(self.meta.get("lora_targets", []))

    def enable_lora(self, max_loras: int) -> None:
        self.lora = KernelLora(self.meta["kv"]["n_layer"], max_loras)

    def set_lora(self, slot: int, adapter) -> None:
        """Slot ``slot`` holds ``adapter`` (a ``lora.Adapter``) from the next step on; None empties it."""
        self.lora.set(slot, adapter)

    # --- what the server and the benchmark ask ---

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the KV pool: K and V, and int8's scales."""
        return self.kv.nbytes

    def resident_weights(self) -> dict[str, int]:
        """Bytes of weights held, per format (``MixedForward.resident_weights`` of the model the image came from)."""
        return dict(self.meta["resident_weights"])

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights one step streams, per format (``MixedForward.weight_bytes``)."""
        return dict(self.meta["weight_bytes"])

    def flops_per_token(self, context: int) -> int:
        """FLOPs of one token attending over ``context`` positions (``MixedForward.flops_per_token``)."""
        return self.meta["flops"]["token"] + context * self.meta["flops"]["per_position"]

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src``, every layer (``KVPool.copy_block``)."""
        self.kv.copy_block(src, dst)

    # --- a step ---

    def forward(self, layout: StepLayout, loras: list[int] | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """``model_runner.ModelRunner.forward``: the whole-step kernel over ``layout``'s rows, in calls of at most
        ``max_rows`` rows (``step_abi.StepKernel.run``) -> numpy logits [n_sample, V] (and the hidden rows' final
        hidden states [len(layout.hidden), C] beside them, when the layout has any)."""
        logits = np.empty((layout.n_sample, self.n_vocab), np.float32)
        states = None if layout.hidden is None else np.empty((len(layout.hidden), self.n_embd), np.float32)
        if loras is not None and self.lora is None:
            raise ValueError("loras: adapter slots for a model without adapters (enable_lora)")
        slots = layout.row_slots(loras)
        self.step.run(layout, logits, self.threads, states=states, slots=slots, lora=self.lora)
        return logits if states is None else (logits, states)
