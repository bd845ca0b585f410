"""Context parallelism's split (issue #72, first slice): how one packed micro-batch (workers/packing.py: rows
concatenated into one sequence [T], `segments` [T] the row of each column, -1 for the tail padding) is cut over
`cp` ranks, and the attention mask each rank's queries need against the keys / values all-gathered over the CP
group. Pure functions on index tensors, and the two collectives CP attention and the CP outputs need (with their
autograd). The engine's use of them: workers/megatron_step.cp_local and model_outputs, models/packed_attention.py.

    split = zigzag_split(segments, cp, multiple=1)          # every rank's slots, computed the same on each rank
    local = split.take(input_ids[0], rank)                  # [L]: this rank's tokens (0 on padding)
    plan = split.attention_plan(rank, device)               # the rows' chunk table (CPU) or the [L, cp * L] mask
    out = cp_attention(q, k, v, plan, scale, group)         # this rank's queries against the gathered k / v

The split (megatron-core's and Llama 3's zigzag; verl's `preprocess_packed_seqs` does the same per packed row):
- each row of n tokens is padded to a multiple of 2*cp (n_pad), cut into 2*cp chunks of c = n_pad / (2*cp), and
  rank r holds chunks r and 2*cp-1-r of every row: under causal attention a chunk's work grows with its place in
  the row, so pairing an early chunk with a late one gives every rank the same work (2 chunks per row, the same
  token count L = sum(n_pad) / cp on every rank);
- L is rounded up to `multiple` (the TP size under sequence parallel) with tail padding;
- a padding slot (in-row or tail) has row -1 and is masked out of every real query: keys and values are
  gathered over the group in rank order, and a query attends to a key when both are in the same row and the
  key's place in the row is <= the query's ("same row and key position <= query position"). A padding query
  still sees itself, so no softmax row is empty (no NaN for outputs nobody reads).
- Positions for RoPE are the tokens' own (`take(position_ids)`), so the split never touches RoPE tables: no
  `get_pos_emb_on_this_cp_rank` (models/gpt.py clears the rotary modules' CP group).

Attention (`cp_attention`), two ways to the same result:
- "chunks" (CPU, the default there): each local query chunk t of a row against the row's earlier chunks
  0..t-1 (all visible: no mask) and its own chunk (causal, square), two calls of torch's CPU flash kernel merged
  by their log-sum-exps; the backward runs each part's flash backward with the merged output and log-sum-exp
  (ring attention's rule). Nothing quadratic is held: no mask, no score matrix (the kernel works in blocks),
  and a causal chunk's blocks above the diagonal are skipped. The plan is the rows' chunk sizes [rows, 2].
- "mask": one SDPA call against the mask [L, cp * L] (L * cp * L bytes, which the kernel widens to floats):
  devices without that CPU kernel, and the tests' reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def segment_spans(segments: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal ids in `segments` [T] (rows are contiguous in a packed sequence)."""
    t = int(segments.shape[0])
    if t == 0:
        return []
    cuts = (torch.nonzero(segments[1:] != segments[:-1]).flatten() + 1).tolist()
    starts = [0] + cuts
    return list(zip(starts, cuts + [t]))


def chunk_size(n: int, cp: int) -> int:
    """The tokens of each of a row's 2 * cp chunks (the row padded to a multiple of 2 * cp)."""
    return -(-n // (2 * cp))


CP_ATTENTION = "auto"  # "auto", "chunks" or "mask" (see the module docstring)


@dataclass(frozen=True)
class CPSplit:
    """The split of one packed micro-batch over `cp` ranks: `source[r]` [L] the packed column each of rank r's
    slots holds (-1 for padding), `row[r]` [L] its row (-1 for padding), `place[r]` [L] its index within the
    row (causal order)."""
    cp: int
    source: torch.Tensor  # [cp, L]
    row: torch.Tensor  # [cp, L]
    place: torch.Tensor  # [cp, L]

    @property
    def local_tokens(self) -> int:
        return int(self.source.shape[1])

    def take(self, x: torch.Tensor, rank: int, fill=0) -> torch.Tensor:
        """x [T, ...] (a packed micro-batch's per-column tensor) -> rank's [L, ...], `fill` on padding slots."""
        src = self.source[rank]
        out = x.index_select(0, src.clamp(min=0))
        pad = (src < 0).view(-1, *([1] * (x.dim() - 1)))
        return torch.where(pad, torch.as_tensor(fill, dtype=x.dtype, device=x.device), out)

    def mask(self, rank: int) -> torch.Tensor:
        """[L, cp * L]: rank's queries against the keys gathered over the group in rank order (True: attend)."""
        rq, pq = self.row[rank], self.place[rank]
        rk, pk = self.row.reshape(-1), self.place.reshape(-1)
        same = rq[:, None] == rk[None, :]
        return same & (pk[None, :] <= pq[:, None])

    def chunk_sizes(self) -> torch.Tensor:
        """[rows, 2]: each row's chunk size c (the row padded to 2 * cp * c) and its real length, in row order."""
        real = self.row[self.row >= 0]
        lengths = torch.bincount(real) if real.numel() else torch.zeros(0, dtype=torch.long)
        c = torch.tensor([chunk_size(int(n), self.cp) for n in lengths.tolist()], dtype=torch.long)
        return torch.stack([c, lengths], 1)

    def attention_plan(self, rank: int, device, impl: str | None = None) -> torch.Tensor:
        """What `cp_attention` takes for `rank`: the chunk table (impl "chunks") or the mask (impl "mask"); None:
        CP_ATTENTION, "auto" = chunks on CPU (where its flash kernel is), the mask elsewhere."""
        impl = impl or CP_ATTENTION
        if impl == "auto":
            impl = "chunks" if torch.device(device).type == "cpu" else "mask"
        if impl == "chunks":
            return self.chunk_sizes().to(device)
        if impl == "mask":
            return self.mask(rank).to(device)
        raise ValueError(f"CP attention impl {impl!r}: choose auto, chunks or mask")

    def owner(self, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed columns [n] -> (the rank holding each, its slot there), both [n]."""
        size = max(int(self.source.max()) if self.source.numel() else -1, int(columns.max()) if columns.numel() else -1)
        where = torch.full((size + 1, 2), -1, dtype=torch.long)
        flat = self.source.reshape(-1)
        real = flat >= 0
        slots = torch.arange(flat.numel())
        where[flat[real]] = torch.stack([slots[real] // self.local_tokens, slots[real] % self.local_tokens], 1)
        got = where[columns]
        if bool((got[:, 0] < 0).any()):
            raise ValueError("a column asked for is padding in the packed micro-batch")
        return got[:, 0], got[:, 1]


def zigzag_split(segments: torch.Tensor, cp: int, multiple: int = 1, width: int | None = None) -> CPSplit:
    """The split of a packed micro-batch whose columns belong to rows `segments` [T] (-1: tail padding).
    `width`: the local length every rank gets (>= the split's own; one width for every micro-batch of a
    pipeline call, whose p2p buffers have one shape); None: the split's own, rounded up to `multiple`."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    chunks = 2 * cp
    src = [[] for _ in range(cp)]
    row = [[] for _ in range(cp)]
    place = [[] for _ in range(cp)]
    for k, (a, b) in enumerate((a, b) for a, b in segment_spans(segments) if int(segments[a]) >= 0):
        n = b - a
        c = chunk_size(n, cp)
        for r in range(cp):
            for chunk in (r, chunks - 1 - r):
                p = torch.arange(chunk * c, (chunk + 1) * c)
                real = p < n
                src[r].append(torch.where(real, a + p, -1))
                row[r].append(torch.where(real, k, -1))
                place[r].append(p)
    own = sum(int(x.numel()) for x in src[0])
    need = -(-max(own, 1) // multiple) * multiple
    if width is None:
        width = need
    if width < own or width % multiple:
        raise ValueError(f"local width {width} must be >= {own} and a multiple of {multiple}")

    def stack(parts, fill):
        return torch.stack([torch.cat(p + [torch.full((width - own,), fill, dtype=torch.long)]) for p in parts])

    return CPSplit(cp, stack(src, -1), stack(row, -1), stack(place, 0))


def local_width(segments_list: list[torch.Tensor], cp: int, multiple: int = 1) -> int:
    """The one local length for every micro-batch of a call (the widest split's, rounded up to `multiple`)."""
    widest = 0
    for seg in segments_list:
        lengths = [b - a for a, b in segment_spans(seg) if int(seg[a]) >= 0]
        widest = max(widest, sum(2 * chunk_size(n, cp) for n in lengths))
    return -(-max(widest, 1) // multiple) * multiple


class _GatherOverCP(torch.autograd.Function):
    """Forward: the group's [L, ...] tensors concatenated in rank order -> [cp * L, ...]. Backward: every rank's
    gradient of the gathered tensor summed, this rank's slice kept (each rank's keys / values feed every rank's
    queries). gloo has no reduce-scatter: an all-reduce and a slice."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


class _SumOverCP(torch.autograd.Function):
    """Forward: the sum over the group (outputs each rank computed for its own columns, zeros elsewhere).
    Backward: identity, as TP's reduce_from_tensor_model_parallel_region: every CP rank computes the same loss
    from the summed outputs, and each rank's gradient flows back through the columns it computed."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherOverCP.apply(x, group)


def sum_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverCP.apply(x, group)


def cp_attention(q, k, v, plan, scale, group):
    """q [L, np, hn], k [L, ng, hn], v [L, ng, hv] (this rank's slots), `plan` (CPSplit.attention_plan: the rows'
    chunk table [rows, 2] long, or the mask [L, cp * L] bool) -> context [L, np, hv]: this rank's queries
    against the keys and values gathered over the CP group (Llama 3's all-gather CP)."""
    keys, values = gather_over_cp(k, group), gather_over_cp(v, group)
    if plan.dtype == torch.bool:
        return _masked_attention(q, keys, values, plan, scale)
    import torch.distributed as dist

    return _chunked_attention(q, keys, values, plan, scale, dist.get_world_size(group), dist.get_rank(group))


def _masked_attention(q, keys, values, mask, scale):
    """One SDPA call against the mask [L, cp * L]; the kernel holds no score matrix, the mask is L * cp * L bytes."""
    import torch.nn.functional as F

    q, keys, values = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    return out[0].transpose(0, 1)


class _PrefixAndOwnChunk(torch.autograd.Function):
    """One query chunk q [1, h, c, d] against its row's earlier chunks kp / vp [1, h, t*c, d] (all visible) and its
    own chunk ko / vo [1, h, c, d] (causal): two flash calls merged by their log-sum-exps. Backward: each part's
    flash backward given the merged output and log-sum-exp, so each part's softmax is normalised over both."""

    @staticmethod
    def forward(ctx, q, kp, vp, ko, vo, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, ko, vo, 0.0, True, scale=scale)
        if kp.shape[2]:
            o1, l1 = flash(q, kp, vp, 0.0, False, scale=scale)
            both = torch.logaddexp(lse, l1)
            out = (out.float() * torch.exp(lse - both).unsqueeze(-1)
                   + o1.float() * torch.exp(l1 - both).unsqueeze(-1)).to(q.dtype)
            lse = both
        ctx.save_for_backward(q, kp, vp, ko, vo, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, ko, vo, out, lse = ctx.saved_tensors
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq, dko, dvo = flash_bwd(grad, q, ko, vo, out, lse, 0.0, True, scale=ctx.scale)
        if kp.shape[2]:
            dq1, dkp, dvp = flash_bwd(grad, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
            dq = dq + dq1
        else:
            dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
        return dq, dkp, dvp, dko, dvo, None


def _chunked_attention(q, keys, values, table, scale, cp, rank):
    """Every local query chunk against its row's chunks in causal order (the gathered keys' slots of rank rho are
    its rows' chunks rho then 2cp-1-rho, c each, row after row, then tail padding)."""
    L, h, hn = q.shape
    g, hv = keys.shape[1], values.shape[2]
    if hv < hn:  # multi-latent attention's narrower values: zero-padded for the kernel, the output cut back
        values = torch.nn.functional.pad(values, (0, hn - hv))

    def heads(x):  # [n, g | h, d] -> [1, h, n, d]
        x = x.repeat_interleave(h // x.shape[1], dim=1) if x.shape[1] != h else x
        return x.transpose(0, 1).unsqueeze(0)

    pieces, base = [], 0
    for c in table[:, 0].tolist():
        def block(t):  # the gathered slots of the row's chunk t
            rho = t if t < cp else 2 * cp - 1 - t
            start = rho * L + base + (0 if t < cp else c)
            return torch.arange(start, start + c, device=keys.device)

        for t, local in ((rank, base), (2 * cp - 1 - rank, base + c)):
            own = block(t)
            prefix = torch.cat([block(s) for s in range(t)]) if t else own[:0]
            out = _PrefixAndOwnChunk.apply(heads(q[local:local + c]), heads(keys[prefix]), heads(values[prefix]),
                                           heads(keys[own]), heads(values[own]), scale)
            pieces.append(out[0].transpose(0, 1)[..., :hv])
        base += 2 * c
    if base < L:  # tail padding: nobody reads its outputs
        pieces.append(q.new_zeros(L - base, h, hv))
    return torch.cat(pieces)
