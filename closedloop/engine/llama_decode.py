"""A lean Llama forward for the generator's decode copy: fused projections, no module tree.

Run through transformers' module forward, a small-batch decode step spends a large share of its
time outside the matrix products: per layer seven Linear calls, position and mask tensors,
K/V heads repeated for grouped-query attention, dispatch through module and attention-interface
layers (``benchmarks/bench_generation.py`` compares it with the module copy). This copy
holds the *same function* as a ``LlamaForCausalLM`` (LoRA merged,
``decode_copy.effective_weight``) in a flat layout and runs it directly:

- per layer, ``x @ [Wq; Wk; Wv]^T`` is one GEMM and ``x @ [Wgate; Wup]^T`` another, so a block
  makes 4 matrix products instead of 7, each weight stored transposed (``[in, out]``);
- rotary ``cos``/``sin`` are computed once per forward from the position ids;
- decode attention (one new id per row) reads the K/V cache once, in place, through the C
  loops of ``closedloop.engine.attention_loops`` (where they are built; else two batched
  matmuls over the grouped heads, ``q [B, H_kv, g, D] @ K^T [B, H_kv, D, L]``); a prefill
  (several ids per row) uses ``scaled_dot_product_attention`` with ``enable_gqa``;
- a prefill whose rows are padded (pending ids of unequal length: one turn's observations)
  runs the norms, projections and MLP on its real ids only, packed into one matrix, and
  scatters them into the padded layout for attention alone (``_packed_tail``): its cost is
  the ids it prefills, not rows x the longest;
- the vocabulary projection runs on the last position only.

The formula is the model's: ``h = embed(x)``; per layer ``h += o(attn(rope(q), rope(k), v))``
on ``rmsnorm(h)`` and ``h += down(silu(gate) * up)`` on ``rmsnorm(h)``; ``logits = head(
rmsnorm(h))``, with RMSNorm ``w * (x * rsqrt(mean(x^2) + eps))``. Keys and values go into the
caller's transformers cache through ``cache.update`` (the generator's ``GrowingKVLayer``), so
the cache plumbing (``kv_cache``) is shared with the module path. Attention mask semantics are
the generator's: ``attention_mask [B, L]`` covers the cached and the new ids (0 = padding), and
a new id at column ``C + i`` (``C`` cached columns) sees columns ``<= C + i`` that are real. A
padding query row also sees itself, so its (never used) output stays finite.

In float32, where torch has oneDNN, every weight whose sides are both at least
``FP32_PACK_MIN_WIDTH`` is kept in oneDNN's pre-packed (blocked) layout and multiplied by
``mkldnn._linear_pointwise``: the strided ``x @ W^T`` re-packs each weight it streams on every
call, which at a decode batch of 32 rows left SmolLM2's products at 33-70 GFLOP/s against
67-98 packed on a 2-core AVX2 EPYC (``docs/performance.md``, "oneDNN-packed float32 decode").
Narrower weights stay strided: there the call's fixed cost weighs against the packing (a 64 x 64
product ran 2-10x slower packed, a 128 x 49152 one slower at one row), and the tiny test
models keep their float32 bits. The products accumulate in another order than the strided
ones (~1e-6 relative), so sampled ids can differ from the strided layout's where two logits
nearly tie.

Under ``precision="bfloat16"`` every product is ``float32(bf16(x) @ bf16(W'))`` with ``W'`` the
merged weight rounded once (as ``decode_copy.Bf16Linear``); the rest stays float32. Where the
CPU has native bf16 (``onednn_bf16_packing``) the bf16 weights are kept in oneDNN's pre-packed
layout, so a decode step does not re-pack every weight it streams (the products accumulate in
another order, so sampled ids may differ from the unpacked layout's in bf16 rounding).

``supports(model)`` names what this layout cannot express (another architecture, a rope
scaling, biases on the MLP, sliding windows, LoRA variants); the generator then keeps the
module copy. Equality with the module forward is tested to fp32 rounding. The copy never shares
storage with the policy: an update reaches sampling only through ``sync``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from closedloop.engine.attention_loops import decode_attention, matmul_decode_attention
from closedloop.engine.decode_copy import effective_bias, effective_weight, is_mergeable_lora
from closedloop.engine.precision import bf16_matmul, check_precision

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
FP32_PACK_MIN_WIDTH = 256
"""A float32 weight is kept oneDNN-packed when both its sides are at least this wide (module
doc): all of SmolLM2's (576 and up), none of a 64-wide test model's."""


def supports(model: Any) -> str | None:
    """Return ``None`` if ``model`` (a causal LM, or a peft model over one) fits this layout,
    else the reason it does not."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(lm, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama":
        return f"not a Llama model ({getattr(cfg, 'model_type', None)!r})"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {cfg.hidden_act!r} (only silu)"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r} (only default)"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "non-full-attention layers"
    for name, module in lm.named_modules():
        if name.endswith(_PROJ + _MLP + ("lm_head",)) and not (
                isinstance(module, nn.Linear) or is_mergeable_lora(module)):
            return f"{name} is a {type(module).__name__} (not a Linear or a plain LoRA)"
    return None


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv_t: torch.Tensor
    qkv_b: torch.Tensor | None
    o_t: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_t: torch.Tensor
    down_t: torch.Tensor


class LlamaDecodeCopy:
    """The generator's flat copy of a Llama policy (module doc). Call ``sync`` after every
    weight change; ``last_logits`` runs one forward and returns float32 ``[B, V]``."""

    def __init__(self, model: Any, precision: str = "float32", packed: bool = True,
                 packed_prefill: bool = True, fused_attention: bool = True) -> None:
        """``packed=False`` keeps every weight strided (the module doc's packing off);
        ``packed_prefill=False`` runs a padded prefill's padding through the products;
        ``fused_attention=False`` runs decode attention as the two batched matmuls even where
        the C loops are built (both for comparison: the same logits up to rounding)."""
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"LlamaDecodeCopy cannot hold this model: {reason}")
        self.precision = check_precision(precision)
        self.packed = packed
        self.packed_prefill = packed_prefill
        self.fused_attention = fused_attention
        self.source = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = self.source.config
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.wdtype = torch.float32 if precision == "float32" else torch.bfloat16
        self.layers: list[_Layer] = []
        self._keys: dict[str, tuple[Any, ...]] = {}
        # merge buffers to pack from, by shape and dtype
        self._scratch: dict[tuple[tuple[int, int], torch.dtype], torch.Tensor] = {}
        self.embed = self.norm = self.head_t = torch.empty(0)
        self.sync(force=True)

    @torch.no_grad()
    def sync(self, force: bool = False) -> None:
        """Rebuild the tensors whose source weights changed since the last sync (LoRA merged).

        A source tensor counts as changed when its storage or its version counter moved, which
        every in-place update (optimizer steps, ``copy_``, ``load_state_dict``) does: with LoRA
        only the adapted projections are rebuilt. A write through ``.data`` bypasses the
        version counter: after one, call ``sync(force=True)``.
        """
        lm = self.source
        dec = lm.get_decoder()
        head = lm.get_output_embeddings()
        if force:
            self._keys.clear()
        self.embed = self._fresh("embed", [dec.embed_tokens], self.embed,
                                 lambda: dec.embed_tokens.weight.detach().clone())
        self.norm = self._fresh("norm", [dec.norm], self.norm,
                                lambda: dec.norm.weight.detach().clone())
        self.head_t = self._fresh("head", [head], self.head_t,
                                  lambda: self._w_t(effective_weight(head)))
        self.head_b = _bias(head)
        rotary = dec.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        old: list[_Layer | None] = list(self.layers) or [None] * len(dec.layers)
        self.layers = [self._layer(i, block, prev) for i, (block, prev)
                       in enumerate(zip(dec.layers, old, strict=True))]

    def _layer(self, i: int, block: Any, prev: _Layer | None) -> _Layer:
        att, mlp = block.self_attn, block.mlp
        qkv_mods = [getattr(att, n) for n in _PROJ[:3]]
        biases = [_bias(m) for m in qkv_mods]

        def fresh(field: str, modules: list[Any], build: Callable[[], torch.Tensor]
                  ) -> torch.Tensor:
            return self._fresh(f"{i}.{field}", modules,
                               getattr(prev, field) if prev else None, build)

        def norm(module: Any) -> torch.Tensor:
            return fresh("ln1" if module is block.input_layernorm else "ln2", [module],
                         lambda: module.weight.detach().clone())

        def merged(field: str, modules: list[Any]) -> torch.Tensor:
            current = getattr(prev, field) if prev else None
            return fresh(field, modules, lambda: self._merged_t(modules, current))

        return _Layer(
            ln1=norm(block.input_layernorm),
            qkv_t=merged("qkv_t", qkv_mods),
            qkv_b=None if biases[0] is None else torch.cat(biases),  # type: ignore[arg-type]
            o_t=merged("o_t", [att.o_proj]),
            o_b=_bias(att.o_proj),
            ln2=norm(block.post_attention_layernorm),
            gate_up_t=merged("gate_up_t", [mlp.gate_proj, mlp.up_proj]),
            down_t=merged("down_t", [mlp.down_proj]))

    def _merged_t(self, modules: list[Any], current: torch.Tensor | None) -> torch.Tensor:
        """The product layout (``_w_t``) of the modules' merged weights stacked along ``out``.

        In float32 over plain LoRA (``_factors``) it is written into ``current``'s storage when
        the shape allows: ``W'^T = W^T + s A^T B^T``, a transposing copy and one ``addmm_`` per
        module, with no temporaries (a re-sync after every publication rewrites every adapted
        block; building ``B A``, ``W + s B A``, the stack and its transpose as new tensors
        streamed each block's weights four more times). A weight kept oneDNN-packed (float32,
        or bf16 where the CPU has native bf16) is merged the same way into a reused ``[out,
        in]`` buffer and packed from it (``_packed_merge``). Other adapters, and strided bf16,
        take ``effective_weight`` (peft's delta) per call.
        """
        factors = [_factors(m) for m in modules]
        widths = [int(_base(m).weight.shape[0]) for m in modules]
        shape = (int(_base(modules[0]).weight.shape[1]), sum(widths))
        packs = self._packs(_base(modules[0]).weight, shape)
        if any(f is None for f in factors) or (self.wdtype is not torch.float32 and not packs):
            return self._w_t(torch.cat([effective_weight(m) for m in modules]))
        if packs:
            return self._packed_merge(modules, widths, factors, (shape[1], shape[0]))
        out = (current if current is not None and not current.is_mkldnn
               and tuple(current.shape) == shape
               and current.dtype is torch.float32 and current.is_contiguous()
               else torch.empty(shape, dtype=torch.float32,
                                device=_base(modules[0]).weight.device))
        col = 0
        for module, width, pairs in zip(modules, widths, factors, strict=True):
            block = out[:, col:col + width]
            block.copy_(_base(module).weight.detach().t())
            for a_r_in, b_out_r, scale in pairs or ():
                block.addmm_(a_r_in.t(), b_out_r.t(), alpha=scale)
            col += width
        return out

    def _packed_merge(self, modules: list[Any], widths: list[int],
                      factors: list[Any], shape: tuple[int, int]) -> torch.Tensor:
        """``W' = W + s B A`` of each module, stacked along ``out`` in a reused float32
        ``[out, in]`` buffer, then packed (the packed tensor is a copy: the buffers are free
        again). In bf16 the merged buffer is rounded once into a reused bf16 buffer and packed
        from that: no tensor of the merge is allocated anew."""
        merged = self._buffer(shape, torch.float32)
        row = 0
        for module, width, pairs in zip(modules, widths, factors, strict=True):
            block = merged[row:row + width]
            block.copy_(_base(module).weight.detach())
            for a_r_in, b_out_r, scale in pairs or ():
                block.addmm_(b_out_r, a_r_in, alpha=scale)
            row += width
        if self.wdtype is not torch.float32:
            merged = self._buffer(shape, self.wdtype).copy_(merged)
        return torch.ops.mkldnn._reorder_linear_weight(merged, PACK_ROWS_HINT)

    def _buffer(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The reused merge buffer of ``shape`` and ``dtype`` (made on first use)."""
        buf = self._scratch.get((shape, dtype))
        if buf is None:
            buf = self._scratch[(shape, dtype)] = torch.empty(shape, dtype=dtype)
        return buf

    def _packs(self, weight: torch.Tensor, shape: tuple[int, ...]) -> bool:
        """Whether a weight of ``shape`` (on ``weight``'s device) is kept oneDNN-packed: in
        float32 where torch has oneDNN and both sides are >= ``FP32_PACK_MIN_WIDTH``, in bf16
        where the CPU has native bf16."""
        if not self.packed or weight.device.type != "cpu":
            return False
        if self.wdtype is torch.float32:
            return min(shape) >= FP32_PACK_MIN_WIDTH and onednn_fp32_packing()
        return onednn_bf16_packing()

    def _fresh(self, name: str, modules: list[Any], current: torch.Tensor | None,
               build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``current`` if ``modules``' tensors and adapter state are unchanged, else ``build()``."""
        key = tuple(_state_key(m) for m in modules)
        if current is not None and self._keys.get(name) == key:
            return current
        self._keys[name] = key
        return build()

    def _w_t(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [out, in]`` in the product's dtype and layout: oneDNN's pre-packed one
        where ``_packs``, else a contiguous ``[in, out]``."""
        if self._packs(weight, tuple(weight.shape)):
            w = weight.detach().to(self.wdtype).contiguous()
            return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        return weight.detach().t().to(self.wdtype).contiguous()

    def _mm(self, x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None = None
            ) -> torch.Tensor:
        if w_t.is_mkldnn and self.wdtype is torch.float32:
            y = torch.ops.mkldnn._linear_pointwise(x, w_t, None, "none", [], "")
        elif w_t.is_mkldnn:  # float32(bf16(x) @ bf16(W')^T), the same rule as bf16_matmul
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), w_t, None, "none",
                                                   [], "").float()
        elif self.wdtype is torch.float32:
            y = torch.matmul(x, w_t)
        else:
            y = bf16_matmul(x, w_t)
        return y if b is None else y + b

    def _rmsnorm(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def last_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run ``input_ids [B, P]`` after the cached ids; return the last position's logits
        ``[B, V]`` (``tail_logits`` with ``keep=1``)."""
        return self.tail_logits(input_ids, attention_mask, position_ids, cache, 1)[:, 0]

    def tail_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, cache: Any, keep: int) -> torch.Tensor:
        """Run ``input_ids [B, P]`` after the cached ids; return the logits of the last
        ``keep`` positions, ``[B, keep, V]``.

        ``attention_mask [B, C + P]`` (C = ids already in ``cache``), ``position_ids [B, P]``.
        Appends the new keys/values to ``cache`` (``cache.update(k, v, layer)``).
        """
        b, p = input_ids.shape
        hq, hkv, d = self.n_heads, self.n_kv, self.head_dim
        allowed = _allowed(attention_mask.bool(), p)
        real_B_P = attention_mask[:, -p:].bool()
        if self.packed_prefill and p > 1 and not bool(real_B_P.all()) \
                and bool(real_B_P[:, -keep:].all()):
            return self._packed_tail(input_ids, real_B_P, position_ids, allowed, cache, keep)
        h = self.embed[input_ids]
        cos, sin = self._rope(position_ids)
        for i, layer in enumerate(self.layers):
            x = self._rmsnorm(h, layer.ln1)
            qkv = self._mm(x, layer.qkv_t, layer.qkv_b)
            qk = _rotate(qkv[..., :(hq + hkv) * d].view(b, p, hq + hkv, d), cos, sin)
            q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
            v = qkv[..., (hq + hkv) * d:].view(b, p, hkv, d).transpose(1, 2)
            keys, values = cache.update(k, v, i)
            att = self._attend(q, keys, values, allowed)
            h = h + self._mm(att, layer.o_t, layer.o_b)
            h = h + self._mlp(h, layer)
        tail = self._rmsnorm(h[:, -keep:], self.norm)
        return self._mm(tail, self.head_t, self.head_b)

    def _packed_tail(self, input_ids: torch.Tensor, real_B_P: torch.Tensor,
                     position_ids: torch.Tensor, allowed: torch.Tensor, cache: Any,
                     keep: int) -> torch.Tensor:
        """``tail_logits`` of a padded prefill with the padding left out of the dense work.

        The ``N`` real new ids run as one ``[N, hidden]`` matrix through the norms, the
        projections and the MLP; only attention sees the ``[B, P]`` layout: each layer
        scatters the rotated queries, keys and values of the real ids into zeros, appends
        the keys/values to the cache (the padding's are zero, and masked as before), attends,
        and gathers the real rows back. A prefill of rows with unequal pending lengths (the
        observations of a turn) then costs its real ids, not ``B x max``; the kept positions
        must be real (they are: rows are left-padded).
        """
        b, p = input_ids.shape
        hq, hkv, d = self.n_heads, self.n_kv, self.head_dim
        slots_N = real_B_P.reshape(-1).nonzero().squeeze(1)
        n = int(slots_N.numel())
        h = self.embed[input_ids.reshape(-1).index_select(0, slots_N)]
        cos, sin = self._rope(position_ids.reshape(1, -1).index_select(1, slots_N))
        rotated = (hq + hkv) * d
        for i, layer in enumerate(self.layers):
            x = self._rmsnorm(h, layer.ln1)
            qkv = self._mm(x, layer.qkv_t, layer.qkv_b)
            qk = _rotate(qkv[:, :rotated].view(1, n, hq + hkv, d), cos, sin)
            dense = qkv.new_zeros(b * p, qkv.shape[-1])
            dense[:, :rotated].index_copy_(0, slots_N, qk.view(n, rotated))
            dense[:, rotated:].index_copy_(0, slots_N, qkv[:, rotated:])
            heads = dense.view(b, p, hq + 2 * hkv, d)
            q = heads[:, :, :hq].transpose(1, 2)
            k, v = heads[:, :, hq:hq + hkv].transpose(1, 2), heads[:, :, hq + hkv:].transpose(1, 2)
            keys, values = cache.update(k, v, i)
            att = self._attend(q, keys, values, allowed).reshape(b * p, hq * d)
            h = h + self._mm(att.index_select(0, slots_N), layer.o_t, layer.o_b)
            h = h + self._mlp(h, layer)
        packed_of_slot = torch.empty(b * p, dtype=torch.long, device=h.device)
        packed_of_slot[slots_N] = torch.arange(n, device=h.device)
        tail = self._rmsnorm(h[packed_of_slot.view(b, p)[:, -keep:]], self.norm)
        return self._mm(tail, self.head_t, self.head_b)

    def _mlp(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The block's MLP on ``rmsnorm(h)``: ``down(silu(gate) * up)``, to add to ``h``."""
        gu = self._mm(self._rmsnorm(h, layer.ln2), layer.gate_up_t)
        half = gu.shape[-1] // 2
        act = nn.functional.silu(gu[..., :half], inplace=True).mul_(gu[..., half:])
        return self._mm(act, layer.down_t)

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[B, P, 1, D]`` for the positions (the default Llama rotary), to
        rotate queries and keys together in their ``[B, P, heads, D]`` layout."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos[:, :, None], sin[:, :, None]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [B, Hq, P, D]`` over the cache ``[B, Hkv, L, D]``; ``[B, P, Hq*D]``."""
        b, hq, p, d = q.shape
        hkv = keys.shape[1]
        if p == 1:
            grouped = q.reshape(b, hkv, hq // hkv, d)  # allowed [B, 1, 1, L]
            out = decode_attention(grouped, keys, values, allowed, self.scale) \
                if self.fused_attention else None
            if out is None:
                out = matmul_decode_attention(grouped, keys, values, allowed, self.scale)
            return out.reshape(b, 1, hq * d)
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                                         scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, p, hq * d)


PACK_ROWS_HINT = 32  # the decode batch oneDNN's blocked weight layout is chosen for (any M runs)


def onednn_fp32_packing() -> bool:
    """Whether float32 weights can be kept pre-packed for oneDNN: torch built with it (any
    x86 CPU it runs on; the packed product needs no bf16 or AMX instructions)."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def onednn_bf16_packing() -> bool:
    """Whether bf16 weights can be kept pre-packed for oneDNN: torch built with it, and a CPU
    with native bf16 dot products (AVX512-BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _base(module: Any) -> nn.Linear:
    """The ``nn.Linear`` a module applies (itself, or a LoRA wrapper's base layer)."""
    return module if isinstance(module, nn.Linear) else module.base_layer


def _factors(module: Any) -> list[tuple[torch.Tensor, torch.Tensor, float]] | None:
    """``[(A [r, in], B [out, r], s)]`` of the active adapters a module adds to its base weight
    (``[]`` for a Linear, or adapters disabled or merged), all float32; ``None`` when the delta
    is not that product (fan-in-fan-out storage, another factor type or dtype): then
    ``effective_weight`` (peft's ``get_delta_weight``) builds it."""
    if isinstance(module, nn.Linear):
        return [] if module.weight.dtype is torch.float32 else None
    base = module.base_layer
    if base.weight.dtype is not torch.float32 or getattr(module, "fan_in_fan_out", False):
        return None
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    out = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        a, b = module.lora_A[name], module.lora_B[name]
        if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)) \
                or a.weight.dtype is not torch.float32 or b.weight.dtype is not torch.float32:
            return None
        out.append((a.weight.detach(), b.weight.detach(), float(module.scaling[name])))
    return out


def _state_key(module: Any) -> tuple[Any, ...]:
    """Storage, version and shape of every tensor under ``module``, plus its adapter switches."""
    tensors = tuple((t.data_ptr(), t._version, tuple(t.shape))
                    for t in [*module.parameters(), *module.buffers()])
    flags = (getattr(module, "disable_adapters", None), getattr(module, "merged", None),
             tuple(getattr(module, "active_adapters", ()) or ()),
             tuple(sorted((getattr(module, "scaling", None) or {}).items())))
    return (*tensors, flags)


def _bias(module: Any) -> torch.Tensor | None:
    """A copy of the module's ``effective_bias`` (or ``None``)."""
    bias = effective_bias(module)
    return None if bias is None else bias.clone()


def _allowed(mask_B_L: torch.Tensor, p: int) -> torch.Tensor:
    """Which keys each new id sees: ``[B, 1, P, L]`` (real and not in its future, or itself)."""
    length = mask_B_L.shape[1]
    cached = length - p
    col_L = torch.arange(length, device=mask_B_L.device)
    row_P = torch.arange(p, device=mask_B_L.device)[:, None] + cached
    causal_P_L = col_L[None, :] <= row_P
    return (mask_B_L[:, None, None, :] & causal_P_L) | (col_L[None, :] == row_P)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` (Llama's half-split convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
