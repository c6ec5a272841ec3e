"""LoRA adapters in PEFT's format, served over the base model and never merged into its weights. Torch-free (numpy).

An adapter is a directory as PEFT's ``save_pretrained`` writes it: ``adapter_config.json`` and
``adapter_model.safetensors``. For every linear ``y = x W^T + b`` of the base it targets, the served output is

    y + scale * (x A^T) B^T        A [r, in], B [out, r], scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))

which is PEFT's ``result + lora_B(lora_A(x)) * scaling``, over the rows of the requests that chose that adapter
only: requests for several adapters and the base share one batch (vLLM's punica idea: a step's rows are grouped by
adapter, and each linear runs one small GEMM pair per adapter present after the base GEMM that every row shares).

Our linears are fused where HF's are not (q, k, v are one ``qkv``; gate and up one ``up``): each is a ``Target``
whose parts name the HF modules whose outputs it holds side by side (``n0``, ``N``), so an adapter of q_proj adds
into the q columns of the fused output only. GPT-2's c_attn is one HF module already (q, k and v in its B).

``read_adapter`` reads and checks an adapter against the model's targets and refuses, naming the reason, what this
code does not compute: DoRA, LoRA biases, modules_to_save, trainable tokens, per-module alphas, embedding or lm_head
adapters, a module the model does not have or shapes that do not fit the base, a rank above MAX_LORA_RANK.
``LoraManager`` is an engine's adapters: their names on the event loop (what requests may choose), and ``LoraSlots``
on the engine's worker thread, the resident adapters in MAX_LORAS slots of the runner and a step's rows mapped to
slots. The runtimes apply them: ``models/lora_torch.py`` (the torch forward) and the whole-step
kernel's hook (``kernels/lora_step.py``, for ``decode_step.c`` on both runtimes).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KINDS = ("qkv", "o", "up", "down")  # the linears of a layer an adapter may target (the kernel's order)
_PREFIX = "base_model.model."  # PEFT's prefix of every saved tensor name
_NO_SLOT = -1  # a row of the base model


class LoraError(ValueError):
    """An adapter that cannot be served: ``str()`` is one line that names the adapter and the reason."""


# --- what a model offers to adapters ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One of our linears as adapters see it: layer, kind (``KINDS``), K inputs, and its parts: the HF modules
    ``(module path, first output column, outputs)`` whose outputs it holds side by side."""

    layer: int
    kind: str
    K: int
    parts: tuple[tuple[str, int, int], ...]


def target(layer: int, kind: str, K: int, modules: list[tuple[str, int]]) -> Target:
    """A Target from its HF modules in output order, each ``(path, outputs)``."""
    parts, n0 = [], 0
    for module, n in modules:
        parts.append((module, n0, n))
        n0 += n
    return Target(layer, kind, K, tuple(parts))


def targets_to_json(targets: list[Target]) -> list:
    return [[t.layer, t.kind, t.K, [list(p) for p in t.parts]] for t in targets]


def targets_from_json(data: list) -> list[Target]:
    return [Target(layer, kind, K, tuple(tuple(p) for p in parts)) for layer, kind, K, parts in data]


# --- one adapter, read and checked ------------------------------------------------------------------------------


@dataclass
class LoraPart:
    """One HF module's adapter inside one of our linears: its columns ``[j0, j0 + rank)`` of the linear's shrink
    output, its outputs ``[n0, n0 + N)``, ``scale`` and B transposed, ``b_t`` [rank, N] fp32."""

    j0: int
    rank: int
    n0: int
    N: int
    scale: float
    b_t: np.ndarray


@dataclass
class LoraLinear:
    """An adapter on one linear: the shrink ``a_t`` [K, R] fp32 (every part's A transposed, side by side: one GEMM
    gives each part's x A^T) and its parts."""

    a_t: np.ndarray
    parts: list[LoraPart]

    @property
    def rank(self) -> int:
        return self.a_t.shape[1]


@dataclass
class Adapter:
    """A checked adapter: ``linears[(layer, kind)]`` for each of our linears it targets."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    linears: dict[tuple[int, str], LoraLinear] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(x.a_t.nbytes + sum(p.b_t.nbytes for p in x.parts) for x in self.linears.values())


# PEFT LoraConfig options that change the math, and the value under which they do not.
_REFUSED_OPTIONS = {
    "use_dora": (False, "DoRA (use_dora)"),
    "lora_bias": (False, "LoRA biases (lora_bias)"),
    "modules_to_save": (None, "modules_to_save (whole modules replaced)"),
    "trainable_token_indices": (None, "trainable_token_indices"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
    "layer_replication": (None, "layer_replication"),
    "target_parameters": (None, "target_parameters (LoRA on parameters)"),
    "use_qalora": (False, "QALoRA (use_qalora)"),
    "use_bdlora": (None, "block-diagonal LoRA (use_bdlora)"),
    "alora_invocation_tokens": (None, "activated LoRA (alora_invocation_tokens)"),
    "arrow_config": (None, "Arrow routing (arrow_config)"),
    "kasa_config": (None, "KaSA (kasa_config)"),
    "monteclora_config": (None, "MonteCLoRA (monteclora_config)"),
    "velora_config": (None, "VeLoRA (velora_config)"),
}


def read_adapter(name: str, path: str, targets: list[Target], max_rank: int) -> Adapter:
    """The adapter in directory ``path`` checked against the model's ``targets``; ``LoraError`` naming the adapter and
    the first thing this server cannot serve (or a missing or malformed file)."""

    def refuse(why: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r} ({path}): {why}")

    config = _read_config(path, refuse)
    rslora = bool(config.get("use_rslora", False))
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha {alpha!r} is not a number")
    tensors = _read_tensors(os.path.join(path, WEIGHTS_FILE), refuse)
    by_module = {module: (t, i) for t in targets for i, (module, _, _) in enumerate(t.parts)}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, which = _module_of(key)
        if which is None:
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight this server applies (DoRA, biases, embeddings?)")
        if module not in by_module:
            raise refuse(f"module {module!r} is not a linear this server applies LoRA to ({_supported(targets)})")
        pairs.setdefault(module, {})[which] = value  # checked first: the tensors are read once every name is
    if not pairs:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    adapter = Adapter(name, path, 0)
    grouped: dict[Target, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise refuse(f"module {module!r} has lora_{'A' if 'A' not in ab else 'B'} missing")
        tgt, i = by_module[module]
        _, _, n_out = tgt.parts[i]
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or a.shape[0] < 1:
            raise refuse(f"module {module!r}: lora_A has shape {list(a.shape)}")
        r = a.shape[0]
        if a.shape[1] != tgt.K or b.shape != (n_out, r):
            raise refuse(
                f"module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base's linear "
                f"of {tgt.K} inputs and {n_out} outputs (an adapter of another model?)"
            )
        if r > max_rank:
            raise refuse(f"module {module!r} has rank {r}; this server's MAX_LORA_RANK is {max_rank}")
        grouped.setdefault(tgt, []).append((i, _fp32(a), _fp32(b)))
        adapter.rank = max(adapter.rank, r)
    for tgt, parts in grouped.items():
        adapter.linears[(tgt.layer, tgt.kind)] = _linear(tgt, sorted(parts, key=lambda p: p[0]), alpha, rslora)
    return adapter


def _linear(tgt: Target, parts: list[tuple[int, np.ndarray, np.ndarray]], alpha: float, rslora: bool) -> LoraLinear:
    """One linear's adapter from its modules' (part index, A [r, K], B [N, r]), in output order."""
    a_t = np.ascontiguousarray(np.concatenate([a for _, a, _ in parts]).T, dtype=np.float32)  # [K, R]
    out, j0 = [], 0
    for i, a, b in parts:
        r = a.shape[0]
        scale = alpha / math.sqrt(r) if rslora else alpha / r  # PEFT's scaling, r the module's own rank
        _, n0, n = tgt.parts[i]
        out.append(LoraPart(j0, r, n0, n, float(scale), np.ascontiguousarray(b.T, dtype=np.float32)))
        j0 += r
    return LoraLinear(a_t, out)


def _read_config(path: str, refuse) -> dict:
    """adapter_config.json, with the options this server does not compute refused by name."""
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise refuse(f"no {CONFIG_FILE} (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise refuse(f"peft_type {kind!r} is not LoRA")
    for option, (plain, what) in _REFUSED_OPTIONS.items():
        value = config.get(option, plain)
        if value not in (plain, None, False, {}, []):
            raise refuse(f"{what} is not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise refuse(f"bias {bias!r} is not supported (only 'none': the base's biases, untrained)")
    return config


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}
_MAX_HEADER = 100 << 20  # bytes of a safetensors header this reader accepts


def _read_tensors(file: str, refuse) -> dict[str, np.ndarray]:
    """A safetensors file's tensors, without torch: views of the file's read-only map in their own dtype (F32, F16,
    F64; BF16 as uint16, ``_fp32`` widens it), so only the tensors used are ever read."""
    try:
        data = np.memmap(file, dtype=np.uint8, mode="r")
        (n,) = struct.unpack("<Q", data[:8].tobytes())
        if not 0 < n <= min(_MAX_HEADER, data.size - 8):
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(data[8 : 8 + n].tobytes())
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except FileNotFoundError:
        raise refuse(f"no {WEIGHTS_FILE}") from None
    except (OSError, ValueError, struct.error) as exc:
        raise refuse(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, (begin, end), shape = _SAFETENSORS_DTYPES.get(entry["dtype"]), entry["data_offsets"], entry["shape"]
        except (KeyError, TypeError, ValueError):
            raise refuse(f"{WEIGHTS_FILE}: tensor {key!r} has a malformed entry") from None
        if dtype is None:
            raise refuse(f"tensor {key!r} has dtype {entry['dtype']!r} (F32, F16, BF16 are read)")
        count = math.prod(shape)
        if not 0 <= begin <= end <= data.size - 8 - n or end - begin != count * np.dtype(dtype).itemsize:
            raise refuse(f"tensor {key!r} lies outside {WEIGHTS_FILE} or does not fill its shape (truncated?)")
        out[key] = data[8 + n + begin : 8 + n + end].view(dtype).reshape(shape)
    return out


def _fp32(raw: np.ndarray) -> np.ndarray:
    """A tensor of ``_read_tensors`` as an fp32 array of its own (bfloat16: the high half of an fp32)."""
    if raw.dtype == np.uint16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _module_of(key: str) -> tuple[str, str | None]:
    """A saved tensor's name -> (the HF module path, "A" / "B", or None for anything but a LoRA A/B weight)."""
    name = key.removeprefix(_PREFIX)
    for which in ("A", "B"):
        for suffix in (f".lora_{which}.weight", f".lora_{which}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], which
    return name, None


def _supported(targets: list[Target]) -> str:
    names = sorted({m.rsplit(".", 1)[-1] for t in targets for m, _, _ in t.parts})
    return "supported: " + ", ".join(names)


# --- the server's adapters ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """An adapter the server serves: its name, the id its requests carry (``Sequence.lora_id``), path and rank."""

    name: str
    lora_id: int
    path: str
    rank: int


class LoraManager:
    """The adapters of one engine: their names on the event loop (``served``, ``id_of``, ``begin`` / ``commit`` /
    ``abandon`` / ``forget``), their weights in the runner's slots on the engine's worker thread (``install``,
    ``remove``, ``rows``). An adapter's id is never reused: a name loaded again is another id, so the prefix cache
    never hands the new weights the old ones' K/V."""

    def __init__(self, runner, targets: list[Target], max_loras: int, max_rank: int) -> None:
        self.targets, self.max_loras, self.max_rank = targets, max_loras, max_rank
        self.slots = LoraSlots(runner, max_loras)
        self.served: dict[str, Loaded] = {}  # name -> adapter, in load order
        self._loading: set[str] = set()  # names whose load is under way
        self._next_id = 1

    # --- the event loop ---
    def id_of(self, name: str) -> int | None:
        loaded = self.served.get(name)
        return None if loaded is None else loaded.lora_id

    def is_served(self, lora_id: int) -> bool:
        return lora_id == 0 or any(x.lora_id == lora_id for x in self.served.values())

    def begin(self, name: str) -> None:
        """A load of ``name`` starts: LoraError when the name is taken or every slot is (counting loads under way)."""
        if name in self.served or name in self._loading:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (unload it first to load it again)")
        if len(self.served) + len(self._loading) >= self.max_loras:
            raise LoraError(
                f"LoRA adapter {name!r}: {self.max_loras} adapters are loaded, the most this server holds (MAX_LORAS); "
                "unload one first"
            )
        self._loading.add(name)

    def commit(self, adapter: Adapter, lora_id: int) -> Loaded:
        self._loading.discard(adapter.name)
        loaded = self.served[adapter.name] = Loaded(adapter.name, lora_id, adapter.path, adapter.rank)
        return loaded

    def abandon(self, name: str) -> None:
        self._loading.discard(name)

    def forget(self, name: str) -> Loaded:
        """``name`` is no longer served (new requests cannot choose it); -> what it was (KeyError if unknown)."""
        return self.served.pop(name)

    # --- any thread ---
    def read(self, name: str, path: str) -> Adapter:
        """The adapter at ``path`` read and checked against this model (``read_adapter``)."""
        return read_adapter(name, path, self.targets, self.max_rank)

    # --- the engine's worker thread ---
    def install(self, adapter: Adapter) -> int:
        """Put ``adapter`` in a free slot under a new id; -> the id."""
        lora_id, self._next_id = self._next_id, self._next_id + 1
        self.slots.install(lora_id, adapter)
        return lora_id

    def load_now(self, name: str, path: str) -> Loaded:
        """Read, install and serve ``name`` in one go (at startup, before the event loop runs)."""
        self.begin(name)
        try:
            adapter = self.read(name, path)
            return self.commit(adapter, self.install(adapter))
        except BaseException:
            self.abandon(name)
            raise

    def remove(self, lora_id: int) -> None:
        self.slots.remove(lora_id)

    def rows(self, lora_ids: list[int]) -> list[int] | None:
        return self.slots.rows(lora_ids)


# --- the resident adapters (the engine's worker thread) ---------------------------------------------------------


class LoraSlots:
    """The adapters a runner holds: at most ``max_loras`` in slots ``[0, max_loras)``, each under the id the server
    gave it (``Sequence.lora_id``; 0 is the base). Lives on the engine's worker thread with the runner it installs
    into (``runner.set_lora(slot, adapter or None)``)."""

    def __init__(self, runner, max_loras: int) -> None:
        self.runner, self.max_loras = runner, max_loras
        self._slot_of: dict[int, int] = {}

    def install(self, lora_id: int, adapter: Adapter) -> int:
        """Put ``adapter`` in a free slot under ``lora_id``; -> the slot. LoraError when every slot is taken."""
        used = set(self._slot_of.values())
        slot = next((s for s in range(self.max_loras) if s not in used), None)
        if slot is None:
            raise LoraError(f"LoRA adapter {adapter.name!r}: all {self.max_loras} adapter slots are taken (MAX_LORAS)")
        self.runner.set_lora(slot, adapter)
        self._slot_of[lora_id] = slot
        return slot

    def slot_of(self, lora_id: int) -> int:
        return self._slot_of[lora_id]

    def remove(self, lora_id: int) -> None:
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self.runner.set_lora(slot, None)

    def rows(self, lora_ids: list[int]) -> list[int] | None:
        """Each row's slot (-1: the base) for rows of these adapter ids, or None when every row is the base's."""
        if not any(lora_ids):
            return None
        return [self.slot_of(i) if i else _NO_SLOT for i in lora_ids]


def row_groups(slots: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The rows of each adapter present: [(slot, its row indices int64, ascending)], slots ascending, the base's rows
    left out. ``slots``: one per token row of the forward (``StepLayout.row_slots``)."""
    slots = np.asarray(slots, np.int64)
    return [(int(s), np.flatnonzero(slots == s)) for s in np.unique(slots) if s != _NO_SLOT]
