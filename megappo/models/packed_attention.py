"""Causal attention over packed rows for megatron's local layer spec (CPU): the packed micro-batch is one
sequence [T, 1] of several rows (workers/packing.py), and each row attends to its own earlier tokens
only. Instead of a dense [T, T] block-causal mask (quadratic in the packed length, so packing would
cost more attention than the padding it saves), every row's span runs through torch's
scaled_dot_product_attention with is_causal: the work is sum(len^2) over rows, like unpacked rows.

The model gets the rows' ids per column (`segments` [T], -1 for the tail padding) where megatron passes
the attention mask; megatron hands it to this module unchanged. Same scale, grouped-query expansion
and (for bf16) fp32 softmax as megatron's DotProductAttention, which this replaces; dropout is off in
every model megappo builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


def segment_spans(segments: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal ids in `segments` [T] (rows are contiguous in a packed sequence)."""
    t = int(segments.shape[0])
    if t == 0:
        return []
    cuts = (torch.nonzero(segments[1:] != segments[:-1]).flatten() + 1).tolist()
    starts = [0] + cuts
    return list(zip(starts, cuts + [t]))


class PackedCausalAttention(DotProductAttention):
    """megatron's local core attention (its constructor: head counts per TP rank, softmax scale), with a
    forward that attends within each packed row."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [T, 1, np, hn], key / value [T, 1, ng, hn], attention_mask = the segment ids [T] ->
        context [T, 1, np * hn]."""
        if attention_mask is None or attention_mask.dim() != 1 or query.shape[1] != 1:
            raise ValueError("PackedCausalAttention needs one packed sequence ([T, 1, ...]) and its segment ids "
                             "[T] as the attention mask (MegatronEngine with pack_sequences)")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        dtype = query.dtype
        # [T, 1, np, hn] -> [np, T, hn]; the softmax in fp32 as megatron's attention_softmax_in_fp32
        q, k, v = (x[:, 0].transpose(0, 1).float() for x in (query, key, value))
        out = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True,
                                                        scale=self.softmax_scale)
                         for a, b in segment_spans(attention_mask)], dim=1)
        return out.transpose(0, 1).reshape(query.shape[0], 1, -1).to(dtype)
