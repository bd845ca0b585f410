"""Context parallelism's split (issue #72, first slice): how one packed micro-batch (workers/packing.py: rows
concatenated into one sequence [T], `segments` [T] the row of each column, -1 for the tail padding) is cut over
`cp` ranks, and the attention mask each rank's queries need against the keys / values all-gathered over the CP
group. Pure functions on index tensors, and the two collectives CP attention and the CP outputs need (with their
autograd). The engine's use of them: workers/megatron_step.cp_local and model_outputs, models/packed_attention.py.

    split = zigzag_split(segments, cp, multiple=1)          # every rank's slots, computed the same on each rank
    local = split.take(input_ids[0], rank)                  # [L]: this rank's tokens (0 on padding)
    table = split.chunk_sizes()                             # [rows, 2]: each row's chunk size and length
    out = cp_attention(q, k, v, table, scale, group)        # this rank's queries against the gathered k / v

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
  and a causal chunk's blocks above the diagonal are skipped.
- "mask": one SDPA call against the mask [L, cp * L] (L * cp * L bytes, which the kernel widens to floats), built
  from the chunk table for that call only: devices without that CPU kernel, and the tests' reference.
Either way the micro-batch carries only its rows' chunk table [rows, 2] (CPSplit.chunk_sizes).
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
    table: torch.Tensor  # [rows, 2]: each row's chunk size c and real length (chunk_sizes)

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
        return _visible(self.row[rank], self.place[rank], self.row.reshape(-1), self.place.reshape(-1))

    def chunk_sizes(self) -> torch.Tensor:
        """[rows, 2]: each row's chunk size c (the row padded to 2 * cp * c) and its real length, in row order."""
        return self.table

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


def _visible(rq, pq, rk, pk) -> torch.Tensor:
    """The CP mask's rule: a query (row rq, place pq) sees a key (rk, pk) in the same row at a place <= its own."""
    return (rq[:, None] == rk[None, :]) & (pk[None, :] <= pq[:, None])


def rank_slots(table: torch.Tensor, cp: int, rank: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's slots from the rows' chunk table [rows, 2] (chunk size c, real length n): the row of each slot
    [width] (-1: padding) and its place in the row [width] (0 on tail padding). Row after row, chunk `rank` then
    chunk 2cp-1-rank, c slots each; then tail padding."""
    rows, places = [], []
    for m, (c, n) in enumerate(table.tolist()):
        for chunk in (rank, 2 * cp - 1 - rank):
            p = torch.arange(chunk * c, (chunk + 1) * c)
            rows.append(torch.where(p < n, m, -1))
            places.append(p)
    own = sum(int(x.numel()) for x in rows)
    if width < own:
        raise ValueError(f"local width {width} must be >= {own}")
    tail = torch.full((width - own,), -1, dtype=torch.long)
    return torch.cat(rows + [tail]), torch.cat(places + [torch.zeros_like(tail)])


def zigzag_split(segments: torch.Tensor, cp: int, multiple: int = 1, width: int | None = None) -> CPSplit:
    """The split of a packed micro-batch whose columns belong to rows `segments` [T] (-1: tail padding).
    `width`: the local length every rank gets (>= the split's own; one width for every micro-batch of a
    pipeline call, whose p2p buffers have one shape); None: the split's own, rounded up to `multiple`."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    spans = [(a, b) for a, b in segment_spans(segments) if int(segments[a]) >= 0]
    table = torch.tensor([[chunk_size(b - a, cp), b - a] for a, b in spans], dtype=torch.long).reshape(-1, 2)
    own = 2 * int(table[:, 0].sum())
    need = -(-max(own, 1) // multiple) * multiple
    if width is None:
        width = need
    if width < own or width % multiple:
        raise ValueError(f"local width {width} must be >= {own} and a multiple of {multiple}")
    starts = torch.tensor([a for a, _ in spans] + [0], dtype=torch.long)  # [rows + 1]: row -1 reads the last
    slots = [rank_slots(table, cp, r, width) for r in range(cp)]
    row = torch.stack([r for r, _ in slots])
    place = torch.stack([p for _, p in slots])
    source = torch.where(row >= 0, starts[row] + place, -1)
    return CPSplit(cp, source, row, place, table)


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


def cp_attention(q, k, v, table, scale, group, impl: str | None = None):
    """q [L, np, hn], k [L, ng, hn], v [L, ng, hv] (this rank's slots), `table` (CPSplit.chunk_sizes: the rows'
    chunk size and length [rows, 2]) -> context [L, np, hv]: this rank's queries against the keys and values
    gathered over the CP group (Llama 3's all-gather CP). `impl`: CP_ATTENTION's choices (None: CP_ATTENTION;
    auto = chunks on CPU, where their flash kernel is, else the mask, built here for this call only)."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    keys, values = gather_over_cp(k, group), gather_over_cp(v, group)
    impl = impl or CP_ATTENTION
    if impl == "auto":
        impl = "chunks" if q.device.type == "cpu" else "mask"
    if impl == "chunks":
        return _chunked_attention(q, keys, values, table, scale, cp, rank)
    if impl == "mask":
        return _masked_attention(q, keys, values, table_mask(table, cp, rank, q.shape[0]).to(q.device), scale)
    raise ValueError(f"CP attention impl {impl!r}: choose auto, chunks or mask")


def table_mask(table: torch.Tensor, cp: int, rank: int, width: int) -> torch.Tensor:
    """CPSplit.mask(rank) from the rows' chunk table alone: [width, cp * width]."""
    slots = [rank_slots(table.cpu(), cp, r, width) for r in range(cp)]
    return _visible(*slots[rank], torch.cat([r for r, _ in slots]), torch.cat([p for _, p in slots]))


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
    hv = values.shape[2]
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
