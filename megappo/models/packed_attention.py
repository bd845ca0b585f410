"""Causal attention over packed rows for megatron's local layer spec (CPU): the packed micro-batch is one
sequence [T, 1] of several rows (workers/packing.py), and each row attends to its own earlier tokens
only. The whole micro-batch is ONE scaled_dot_product_attention call, laid out once per micro-batch
(`PackedLayout`, cached on the segment-id tensor every layer gets) in one of two ways:

- "grid" (the usual case): the rows scattered into a [rows, L] grid (L = the longest row, short rows
  right-padded with zeros) and run with is_causal. A row's padding columns come after its real tokens, so
  causality alone keeps every real query off them; their outputs are dropped by the gather back. torch's
  flash kernel skips the blocks above the diagonal: the work is ~rows * L^2 / 2, which for the
  token-budget micro-batches (rows grouped longest first, so of similar length) is close to the
  sum(len^2) / 2 of unpacked rows. Extra memory: the grid copies of q, k, v and the output.
- "mask": a dense [T, T] boolean block-diagonal causal mask (T^2 bytes: 4 MiB at T = 2048, built once per
  micro-batch and shared by every layer), when the grid would cost more (one long row among many short
  ones: rows * L^2 / 2 > T^2). The kernel then computes all T^2 scores (no block skipping).

Numerics (issue #41). megatron's local DotProductAttention in bf16 computes the scores with a bf16 baddbmm,
the softmax in fp32 (attention_softmax_in_fp32) and probs @ v in bf16. torch's CPU flash kernel (what
SDPA picks here, with or without the mask) accumulates q @ k^T, the online softmax and the output in fp32
for bf16 / fp16 inputs (the probabilities are rounded to the input dtype for the p @ v matmul): the
model's dtype with an fp32 softmax. On a CPU without bf16 instructions (no AVX512-BF16 / AMX, e.g. AVX2
only) that kernel emulates bf16 and is 3-5x slower than the same kernel in fp32, so there (only) q, k and v
are upcast to fp32 for the one call and the context cast back: no bf16 rounding of the scores or
probabilities, within bf16 rounding of megatron's result either way. `COMPUTE_DTYPE` overrides the choice.

The model gets the rows' ids per column (`segments` [T], -1 for the tail padding, which runs as a row of
its own) where megatron passes the attention mask; megatron hands it to this module unchanged. Same
scale and grouped-query expansion (head i reads group i // (heads / groups), SDPA's enable_gqa) as
megatron's DotProductAttention, which this replaces; dropout is off in every model megappo builds.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megappo.parallel.context_parallel import segment_spans

# "model": always the model's dtype; "fp32": always upcast; None: fp32 only for bf16/fp16 on a CPU without
# native bf16 (see the module docstring). IMPL: "auto" (grid or mask by cost), "grid", "mask", or "rows"
# (the former per-row SDPA calls, kept for bench/packing.py's before/after and for tests).
COMPUTE_DTYPE: Optional[str] = None
IMPL = "auto"


def _cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # pragma: no cover - older torch
        return False


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the attention call runs in for inputs of `dtype` on `device`."""
    if dtype == torch.float32 or COMPUTE_DTYPE == "model":
        return dtype
    if COMPUTE_DTYPE == "fp32":
        return torch.float32
    if device.type == "cpu" and not _cpu_has_native_bf16():
        return torch.float32
    return dtype


class PackedLayout:
    """How one packed micro-batch runs as one attention call: its spans, and the grid index [T] (the
    grid position row * L + column of each token) or the [T, T] block-causal mask."""

    def __init__(self, segments: torch.Tensor, impl: str = "auto"):
        self.spans = segment_spans(segments)
        self.tokens = t = int(segments.shape[0])
        lengths = [b - a for a, b in self.spans]
        self.rows, self.width = len(lengths), max(lengths, default=0)
        if impl == "auto":
            impl = "grid" if self.rows * self.width * self.width <= 2 * t * t else "mask"
        self.impl = impl
        device = segments.device
        if impl == "grid":
            lens = torch.tensor(lengths, dtype=torch.long, device=device)
            row = torch.repeat_interleave(torch.arange(self.rows, device=device), lens)
            start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
            self.index = row * self.width + (torch.arange(t, device=device) - start)
        elif impl == "mask":
            ids = torch.repeat_interleave(torch.arange(self.rows, device=device),
                                          torch.tensor(lengths, dtype=torch.long, device=device))
            pos = torch.arange(t, device=device)
            self.mask = (ids[:, None] == ids[None, :]) & (pos[:, None] >= pos[None, :])

    def attend(self, q, k, v, scale):
        """q / k [T, np | ng, hn], v [T, ng, hv] -> context [T, np, hv] (multi-latent attention: hv < hn)."""
        gqa = q.shape[1] != k.shape[1]
        if self.impl == "grid":
            n, w = self.rows, self.width

            def to_grid(x):  # [T, h, d] -> [rows, h, L, d]
                g = x.new_zeros(n * w, x.shape[1], x.shape[2]).index_copy(0, self.index, x)
                return g.view(n, w, x.shape[1], x.shape[2]).transpose(1, 2)

            out = F.scaled_dot_product_attention(to_grid(q), to_grid(k), to_grid(v), is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
            return out.transpose(1, 2).reshape(n * w, q.shape[1], v.shape[2]).index_select(0, self.index)
        if self.impl == "mask":
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
        if self.impl == "rows":
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
            out = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                                            scale=scale, enable_gqa=gqa)
                             for a, b in self.spans], dim=1)
            return out.transpose(0, 1)
        raise ValueError(f"unknown packed attention impl {self.impl!r}")


_cache: dict = {}


def layout_for(segments: torch.Tensor) -> PackedLayout:
    """The micro-batch's layout, built on the first layer and reused by the others (and by activation
    recomputation): keyed on the segment-id tensor itself, which megatron passes to every layer."""
    hit = _cache.get("layout")
    if hit is not None and hit[0] is segments and hit[1] == segments._version and hit[2].impl_asked == IMPL:
        return hit[2]
    layout = PackedLayout(segments, IMPL)
    layout.impl_asked = IMPL
    _cache["layout"] = (segments, segments._version, layout)
    return layout


class PackedCausalAttention(DotProductAttention):
    """megatron's local core attention (its constructor: head counts per TP rank, softmax scale), with a
    forward that attends within each packed row."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [T, 1, np, hn], key / value [T, 1, ng, hn], attention_mask = the segment ids [T] (or, under
        context parallelism, its rows' chunk table [rows, 2], parallel/context_parallel.py) -> context
        [T, 1, np * hn]."""
        if attention_mask is None or attention_mask.dim() not in (1, 2) or query.shape[1] != 1:
            raise ValueError("PackedCausalAttention needs one packed sequence ([T, 1, ...]) and its segment ids "
                             "[T] (or, context parallel, the rows' chunk table [rows, 2]) as the attention mask (MegatronEngine with "
                             "pack_sequences or parallel cp > 1)")
        dtype = query.dtype
        work = compute_dtype(dtype, query.device)
        q, k, v = (x[:, 0].to(work) for x in (query, key, value))
        if attention_mask.dim() == 2:
            from megatron.core import parallel_state as mpu

            from megappo.parallel.context_parallel import cp_attention

            out = cp_attention(q, k, v, attention_mask, self.softmax_scale, mpu.get_context_parallel_group())
        else:
            out = layout_for(attention_mask).attend(q, k, v, self.softmax_scale)
        return out.reshape(query.shape[0], 1, -1).to(dtype)
