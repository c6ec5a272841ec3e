"""The decoder every RoPE family is: its block math over shared pieces, configured per family (``decoder_spec.py``:
the spec, the weight names, reading a config); the forward loop is ``layers.py``'s, attention ``attention.py``'s.

A family (``llama.py``, ``qwen2.py``, ``gemma.py``, ...) is a ``Decoder`` subclass that says three things:

- ``spec(cfg)``: the math, as a ``DecoderSpec`` read from the HF config (and checked: anything the config asks that
  this code does not do raises ValueError naming it);
- ``names``: where each weight sits in the HF state dict (``Names``: one name per role, None for a role the family
  does not have);
- ``gguf``: llama.cpp's architecture name and tensor names for the same roles (``models/gguf/names.py``; the reader
  renames a GGUF file's tensors with it).

One block, then, for every family (N tokens, C width, H query heads, KVH K/V heads, D head_dim, I MLP width):

    h = attn_norm(x)                        # RMSNorm [C]; weight (1 + w) for Gemma; OLMo 2 has none
    q, k, v = qkv(h)                        # one fused linear [C] -> [(H + 2 KVH) D], with its bias (Qwen2)
    q, k = q_norm(q), k_norm(k)             # RMSNorm per head over D (Qwen3, Gemma 3) or over H D (OLMo 2, OLMoE)
    q, k, v = clamp(clip_qkv)               # OLMoE's optional clip
    q, k = rope(q, k)                       # the layer kind's tables (Gemma 3's local base), R <= D dims (Phi-3)
    a = o(attention(q, k, v))               # window (sliding layers), scale, soft-cap (Gemma 2)
    x = x + attn_out_norm(a) * residual     # Gemma / OLMo 2 norm the output; Granite scales it
    m = mlp(ff_norm(x))                     # SiLU or tanh-GELU gated, or a mixture of experts (``MoE``)
    x = x + ff_out_norm(m) * residual

with the embedding scaled (Gemma: sqrt(C); Granite: embedding_multiplier) and the logits divided (Granite) and
soft-capped (Gemma 2). A lean decode step runs the same block with compiled calls where they exist (the norms,
RoPE + KV write + paged attention, SiLU); the whole-step kernel (``kernels/decode_step.c``) runs the specs it
implements (``_fused_plan``). Every op follows HF's order, so greedy tokens match ``generate``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import kv_dtype
from .attention import lean_attention, mixed_attention
from .decoder_spec import DecoderSpec, GGUFNames, MoESpec, Names, head_dim_of, kv_heads
from .kernels import decode_ops, step_abi
from .kernels.decode_step import StepPlan, layer_spec
from .kernels.quant_gemm import QuantWeight
from .layers import Linear, MixedForward, embed_rows, embedding_table, linear_factory
from .mixed_batch import MixedBatch
from .quant import cat_rows
from .rope import apply_rope, rope_tables, rotary_dims
from .state_dict import fp32_state_dict, packed_blocks, release_file_pages

log = logging.getLogger("minibatch.decoder")


# --- the weights ------------------------------------------------------------------------------------------------


class MoE:
    """A mixture-of-experts MLP: router [E, C] (fp32, like llama.cpp, which never quantizes it), and per expert a
    fused gate+up and a down ``Linear`` in the model's format (quantized experts run quant_gemm like any linear).

    The router is HF's: softmax of h W^T in fp32, ``torch.topk`` (so ties break as HF's do), the top-k weights
    renormalized when ``norm_topk``. Tokens are grouped by expert: each expert chosen by any token runs once over all
    of its tokens (its weights stream once per step), experts no token chose never run, and the results are added
    in expert order, as HF adds them.
    """

    def __init__(self, router: torch.Tensor, gate_up: list[Linear], down: list[Linear], spec: MoESpec) -> None:
        self.router, self.gate_up, self.down, self.spec = router.contiguous(), gate_up, down, spec

    def linears(self) -> list[Linear]:
        return [lin for pair in zip(self.gate_up, self.down) for lin in pair]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, C] -> (weights [N, k] fp32, experts [N, k] int64), each token's chosen experts."""
        probs = torch.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float)  # [N, E]
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def __call__(self, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [N, C] -> sum over each token's experts of weight * down(act(gate_up(h))): [N, C]."""
        weights, experts = self.route(h)
        out = torch.zeros_like(h)
        for e in torch.unique(experts).tolist():  # ascending: HF's order of addition
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y = self.down[e](act(self.gate_up[e](h[rows])))  # [n_e, C]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class Block:
    """One layer's weights: its norms (None where the family has none), fused QKV, O, and a dense MLP (fused gate+up,
    down) or an ``MoE``."""

    def __init__(self, sd: dict, prefix: str, names: Names, spec: DecoderSpec, moe: bool, make_linear) -> None:
        self.modules: dict[str, list[tuple[str, int]]] = {}  # our linear -> its HF modules (path, outputs): LoRA

        def fused(parts: tuple[str, ...]) -> Linear:
            weights = [sd[f"{prefix}{n}.weight"] for n in parts]  # each [out_i, C], fp32 or a QuantWeight
            self.modules[parts[0]] = [(f"{prefix}{n}", w.shape[0]) for n, w in zip(parts, weights)]
            biases = [sd.get(f"{prefix}{n}.bias") for n in parts]
            bias = torch.cat(biases) if biases[0] is not None else None
            weight, note = cat_rows(weights)  # one [sum out_i, C] weight in one format
            if note:
                log.info("%s%s: %s", prefix, "+".join(parts), note)
            return make_linear(weight, bias)

        def norm(name: str | None) -> torch.Tensor | None:
            return None if name is None else norm_weight(sd[f"{prefix}{name}.weight"], spec)

        self.attn_norm, self.ff_norm = norm(names.attn_norm), norm(names.ff_norm)  # each [C]
        self.attn_out_norm, self.ff_out_norm = norm(names.attn_out_norm), norm(names.ff_out_norm)
        qk = spec.qk_norm is not None
        self.q_norm, self.k_norm = (norm(names.q_norm), norm(names.k_norm)) if qk else (None, None)  # [D] or [H D]
        self._first = {"qkv": names.qkv[0], "o": names.o, "up": names.gate_up[0], "down": names.down}
        self.qkv = fused(names.qkv)  # [C] -> [(H + 2 KVH) D]
        self.o = fused((names.o,))  # [H D] -> [C]
        self.mlp = self._moe(sd, prefix, names, spec, make_linear) if moe else None
        if self.mlp is None:
            self.gate_up = fused(names.gate_up)  # [C] -> [2I]: gate, then up
            self.down = fused((names.down,))  # [I] -> [C]

    @staticmethod
    def _moe(sd: dict, prefix: str, names: Names, spec: DecoderSpec, make_linear) -> MoE:
        gate_up = sd[f"{prefix}{names.experts}.gate_up_proj"]  # [E, 2I, C]
        down = sd[f"{prefix}{names.experts}.down_proj"]  # [E, C, I]
        router = sd[f"{prefix}{names.router}.weight"]
        if isinstance(router, QuantWeight):
            from .kernels.quant_gemm import dequantize

            router = dequantize(router)
        return MoE(
            router,
            [make_linear(gate_up[e], None) for e in range(spec.moe.experts)],
            [make_linear(down[e], None) for e in range(spec.moe.experts)],
            spec.moe,
        )

    def lora_linears(self) -> dict[str, tuple[Linear, list[tuple[str, int]]]]:
        """The linears adapters may target by kind (``lora.KINDS``), each with its HF modules; a mixture of experts'
        are not."""
        linears = {"qkv": self.qkv, "o": self.o}
        if self.mlp is None:
            linears.update(up=self.gate_up, down=self.down)
        return {kind: (lin, self.modules[self._first[kind]]) for kind, lin in linears.items()}

    def dense_linears(self) -> list[Linear]:
        return [self.qkv, self.o] + ([] if self.mlp is not None else [self.gate_up, self.down])

    def linears(self) -> list[Linear]:
        return self.dense_linears() + (self.mlp.linears() if self.mlp is not None else [])


def norm_weight(w: torch.Tensor, spec: DecoderSpec) -> torch.Tensor:
    """An RMSNorm weight as the norm multiplies by: (offset + w) in fp32 (Gemma's 1 + w, HF's rounding too)."""
    return (spec.norm_offset + w.float()).contiguous() if spec.norm_offset else w


# --- the forward ------------------------------------------------------------------------------------------------


class Decoder(MixedForward):
    """A RoPE decoder family's weights, RoPE tables and KV cache; subclasses give ``model_type``, ``spec``, ``names``
    and ``gguf``."""

    model_type: str
    names: Names = Names()
    gguf: GGUFNames | None = None

    @classmethod
    def spec(cls, cfg) -> DecoderSpec:
        raise NotImplementedError

    @staticmethod
    def context_window(hf_config) -> int:
        return hf_config.max_position_embeddings

    @classmethod
    def kv_window(cls, hf_config) -> int:
        """The widest window when every layer slides (Mistral), else 0 (a global layer reads every position)."""
        windows = cls.spec(hf_config).windows
        return max(windows) if windows and all(windows) else 0

    @classmethod
    def kv_bytes_per_token(cls, hf_config, kv_cache_dtype: str = "fp32") -> int:
        """K and V of one token over every layer in a pool of ``kv_cache_dtype`` (what one KV slot costs)."""
        return kv_dtype.bytes_per_token(
            kv_cache_dtype, hf_config.num_hidden_layers, kv_heads(hf_config), head_dim_of(hf_config)
        )

    def __init__(
        self,
        hf_model: torch.nn.Module,
        capacity: int,
        max_len: int,
        device: torch.device,
        use_small_gemm: bool = True,
        num_blocks: int = 0,
        block_size: int = 32,
        weights: str = "fp32",
        kv_cache_dtype: str = "fp32",
    ) -> None:
        """``num_blocks`` KV blocks of ``block_size`` tokens (0: enough for ``capacity`` x ``max_len``) of
        ``kv_cache_dtype`` elements."""
        cfg = hf_model.config
        spec = self.cfg_spec = self.spec(cfg)
        self.n_layer, self.n_embd, self.n_head, self.n_kv_head = spec.n_layer, spec.hidden, spec.n_head, spec.n_kv_head
        self.head_dim, self.eps, self.scale, self.device = spec.head_dim, spec.eps, spec.scale, device
        kinds = sorted({spec.layer_type(i) for i in range(spec.n_layer)}, key=str)
        self.rope = {kind: rope_tables(cfg, self.head_dim, max_len, device, kind) for kind in kinds}  # [P, 1, R] each
        self.rotary = rotary_dims(cfg, self.head_dim, kinds[0])

        names = self.names
        sd = fp32_state_dict(hf_model, device)
        make_linear, self.onednn, self.small_gemm = linear_factory(device, capacity, use_small_gemm, weights)
        self.embed = embedding_table(sd[f"{names.embed}.weight"], weights)  # [V, C]
        layer_of = {f"{names.layers}.{i}.": i for i in range(self.n_layer)}
        try:
            self.blocks = packed_blocks(
                sd, list(layer_of), lambda p: Block(sd, p, names, spec, spec.is_moe(layer_of[p]), make_linear)
            )
        except KeyError as exc:  # a checkpoint (a GGUF file) without a weight the spec needs: one line naming it
            raise ValueError(
                f"the checkpoint has no weight {exc.args[0]} (a {self.model_type} model needs it)"
            ) from exc
        self.norm = norm_weight(sd[f"{names.final_norm}.weight"], spec)  # [C]
        tied = spec.tied or f"{names.lm_head}.weight" not in sd
        lm_head = self.embed if tied else sd[f"{names.lm_head}.weight"]
        self.lm_head = make_linear(lm_head, None, table=tied)  # [C] -> [V]
        self.embed = self.lm_head.table() if tied else self.embed  # tied: the lm_head's one copy serves the lookups
        release_file_pages(sd.values())  # the embedding and lm_head tables, packed now
        num_blocks = num_blocks or capacity * -(-max_len // block_size)
        self._init_cache(self.n_layer, self.n_kv_head, self.head_dim, device, num_blocks, block_size, kv_cache_dtype)

    # --- what the model costs (MixedForward's counts, with only the active experts) ---

    def linears(self) -> list[Linear]:
        """Every linear of the model, every expert's included (what is resident), then the lm_head."""
        return [lin for block in self.blocks for lin in block.linears()] + [self.lm_head]

    def _experts(self) -> list[MoE]:
        return [b.mlp for b in self.blocks if b.mlp is not None]

    def flops_per_token(self, context: int) -> int:
        """``MixedForward.flops_per_token`` with each MoE layer's ``top_k`` experts (a token runs only those) and its
        router."""
        dense = [lin for b in self.blocks for lin in b.dense_linears()] + [self.lm_head]
        flops = sum(2 * lin.out_features * lin.in_features for lin in dense)
        for moe in self._experts():
            per_expert = sum(2 * lin.out_features * lin.in_features for lin in moe.linears()) // moe.spec.experts
            flops += moe.spec.top_k * per_expert + 2 * moe.router.numel()
        return flops + self.n_layer * 4 * context * self.n_head * self.head_dim

    def weight_bytes(self, rows: int = 1) -> dict[str, int]:
        """Bytes of weights a step of ``rows`` tokens streams, per format: every dense linear once, and of each MoE
        layer the experts its tokens choose, ``E (1 - (1 - k / E) ^ rows)`` of them on average (k for one token)."""
        out: dict[str, int] = {}
        dense = [lin for b in self.blocks for lin in b.dense_linears()] + [self.lm_head]
        for lin in dense:
            out[lin.fmt] = out.get(lin.fmt, 0) + lin.streamed_bytes
        for moe in self._experts():
            E, k = moe.spec.experts, moe.spec.top_k
            active = E * (1 - (1 - k / E) ** max(rows, 1))
            for lin in moe.linears():
                out[lin.fmt] = out.get(lin.fmt, 0) + round(lin.streamed_bytes * active / E)
        return out

    def embedding_tables(self) -> list:
        return [self.embed]

    # --- the math ---

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None, lean: bool) -> torch.Tensor:
        """x: [N, C] -> weight * x / rms(x) (one compiled call on a lean step); x itself where there is no norm."""
        if weight is None:
            return x
        if lean:
            return decode_ops.rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _act(self, gate_up: torch.Tensor, lean: bool) -> torch.Tensor:
        """[N, 2I] gate, then up -> act(gate) * up: [N, I]."""
        act = self.cfg_spec.act
        if lean and act == "silu":
            return decode_ops.silu_mul(gate_up)
        if lean and act == "gelu_tanh":
            return decode_ops.gelu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return _ACT[act](gate) * up

    def _embed(self, batch: MixedBatch) -> tuple[torch.Tensor, dict]:
        """Token embeddings [N, C] (scaled), and each RoPE kind's cos, sin at the tokens' positions (each [N, 1, R]);
        a lean step's kernel reads the whole tables at the positions itself."""
        x = embed_rows(self.embed, batch.ids)
        if self.cfg_spec.embed_scale != 1.0:
            x = x * _scale_of(self.cfg_spec)
        if batch.lean:
            return x, self.rope
        return x, {kind: (cos[batch.pos], sin[batch.pos]) for kind, (cos, sin) in self.rope.items()}

    def _qk_norm(self, qkv: torch.Tensor, block: Block, lean: bool) -> torch.Tensor:
        """qkv [N, (H + 2 KVH) D] with q and k RMS-normalized (per head, or over the whole projection) and clipped; a
        lean step normalizes with the compiled RMSNorm (the whole-step kernel's bits)."""
        spec = self.cfg_spec
        if spec.qk_norm is None and spec.clip_qkv is None:
            return qkv
        H, KVH, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        if spec.qk_norm is not None:
            width = D if spec.qk_norm == "head" else None  # None: the whole projection
            q = self._norm_rows(q, block.q_norm, width, lean)
            k = self._norm_rows(k, block.k_norm, width, lean)
        qkv = torch.cat([q, k, v], dim=-1)
        if spec.clip_qkv is not None:
            qkv = qkv.clamp(-spec.clip_qkv, spec.clip_qkv)
        return qkv

    def _norm_rows(self, x: torch.Tensor, weight: torch.Tensor, width: int | None, lean: bool) -> torch.Tensor:
        """x [N, W] RMS-normalized over groups of ``width`` (None: all of W) -> [N, W]."""
        N, W = x.shape
        width = width or W
        if lean:
            return decode_ops.rms_norm(x.reshape(N * W // width, width), weight, self.eps).view(N, W)
        return F.rms_norm(x.reshape(N, W // width, width), (width,), weight, self.eps).reshape(N, W)

    def _block(self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch, rope: dict) -> torch.Tensor:
        """x: [N, C] -> the layer's output [N, C] (the module docstring's block)."""
        if batch.lean:
            return self._lean_block(layer, block, x, batch, rope)
        return self._layer(layer, block, x, batch, rope, lean=False)

    def _lean_block(self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch, rope: dict) -> torch.Tensor:
        """``_block`` for a lean decode step (B rows, no prompts): the same math, compiled calls where they exist.
        rope: the full tables; ``lean_attention`` rotates at each row's position."""
        return self._layer(layer, block, x, batch, rope, lean=True)

    def _layer(
        self, layer: int, block: Block, x: torch.Tensor, batch: MixedBatch, rope: dict, lean: bool
    ) -> torch.Tensor:
        spec = self.cfg_spec
        N, H, KVH, D = x.shape[0], self.n_head, self.n_kv_head, self.head_dim
        window, tables = spec.window(layer), rope[spec.layer_type(layer)]
        qkv = self._qk_norm(block.qkv(self._norm(x, block.attn_norm, lean)), block, lean)  # [N, (H + 2 KVH) D]
        if lean:  # RoPE, the K/V write and paged attention in one call
            pools = self.layer_pools[layer]
            att = lean_attention(qkv, H, tables, pools, batch, self.scale, window, spec.attn_softcap)  # [N, H D]
        else:
            qk = apply_rope(qkv[:, : (H + KVH) * D].view(N, H + KVH, D), *tables)  # [N, H + KVH, D]
            v = qkv[:, (H + KVH) * D :].view(N, KVH, D)
            att = mixed_attention(qk[:, :H], qk[:, H:], v, self.kv, layer, batch, self.scale, window, spec.attn_softcap)
            att = att.view(N, H * D)
        x = self._residual(x, block.o, att, block.attn_out_norm, lean)
        h = self._norm(x, block.ff_norm, lean)
        if block.mlp is not None:
            m = block.mlp(h, lambda gu: self._act(gu, lean))
            return self._residual(x, None, m, block.ff_out_norm, lean)
        return self._residual(x, block.down, self._act(block.gate_up(h), lean), block.ff_out_norm, lean)

    def _residual(
        self, x: torch.Tensor, linear: Linear | None, h: torch.Tensor, out_norm: torch.Tensor | None, lean: bool
    ) -> torch.Tensor:
        """x + out_norm(linear(h)) * residual_scale: [N, C] (the add fused into the linear when nothing comes
        between)."""
        scale = self.cfg_spec.residual_scale
        if linear is not None and out_norm is None and scale == 1.0:
            return linear.add(h, x)
        y = self._norm(linear(h) if linear is not None else h, out_norm, lean)
        return x + y * scale if scale != 1.0 else x + y

    def _final_norm(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        return self._norm(x, self.norm, lean)

    def _logits(self, x_last: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """x_last: [n, C] final hidden states -> [n, V] logits (divided, soft-capped where the family does)."""
        spec = self.cfg_spec
        logits = self.lm_head(self._final_norm(x_last, lean))
        if lean and (spec.logits_divisor != 1.0 or spec.final_softcap):  # the whole-step kernel's bits
            return decode_ops.cap_logits(logits.contiguous(), spec.logits_divisor, spec.final_softcap)
        if spec.logits_divisor != 1.0:
            logits = logits / spec.logits_divisor
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

    # --- the whole-step kernel ---

    def kernel_gap(self) -> str | None:
        """What of this spec ``decode_step.c`` does not implement, or None (it runs every spec but an erf GELU)."""
        return f"{self.model_type}'s erf GELU" if self.cfg_spec.act == "gelu" else None

    def _fused_plan(self) -> StepPlan | None:
        """Every layer of a step in one call (``decode_step.c``), where the kernel implements the spec."""
        if self.kernel_gap() is not None or not StepPlan.supports(self.linears()):
            return None
        spec = self.cfg_spec
        layers = []
        for i, b in enumerate(self.blocks):
            cos, sin = self.rope[spec.layer_type(i)]
            moe = None
            if b.mlp is not None:
                moe = (b.mlp.router, b.mlp.gate_up, b.mlp.down, b.mlp.spec.top_k, b.mlp.spec.norm_topk)
            layers.append(
                layer_spec(
                    (b.attn_norm, None),
                    (b.ff_norm, None),
                    b.qkv,
                    b.o,
                    None if moe else b.gate_up,
                    None if moe else b.down,
                    self.scale,
                    moe=moe,
                    post1_w=b.attn_out_norm,
                    post2_w=b.ff_out_norm,
                    q_norm=b.q_norm,
                    k_norm=b.k_norm,
                    qk_full=spec.qk_norm == "full",
                    cos=cos,
                    sin=sin,
                    window=spec.window(i),
                    softcap=spec.attn_softcap,
                )
            )
        act = {"silu": step_abi.ACT_SILU_GATED, "gelu_tanh": step_abi.ACT_GELU_GATED}[spec.act]
        return StepPlan(
            act=act,
            dims={"C": self.n_embd, "H": self.n_head, "KVH": self.n_kv_head, "D": self.head_dim},
            eps=self.eps,
            embed=(self.embed, None),
            rope=next(iter(self.rope.values())),
            layers=layers,
            pools=self.layer_pools,
            final_norm=(self.norm, None),
            lm_head=self.lm_head,
            embed_scale=spec.embed_scale,
            residual_scale=spec.residual_scale,
            logits_divisor=spec.logits_divisor,
            final_softcap=spec.final_softcap,
            clip_qkv=spec.clip_qkv or 0.0,
        )


_ACT = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def _scale_of(spec: DecoderSpec) -> torch.Tensor:
    """The embedding scale as HF multiplies by it: in the activations' dtype, fp32 (Gemma's sqrt(C) is a tensor cast
    to the weights' dtype; Granite's multiplier a Python float, which torch applies in fp32 too)."""
    return torch.tensor(spec.embed_scale, dtype=torch.float32)
