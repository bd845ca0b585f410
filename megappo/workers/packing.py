"""Sequence packing for the Megatron engine: a micro-batch's rows concatenated into one sequence, so the
model computes real tokens only (no padding columns), with per-row positions and attention that never
crosses rows. Pure functions over the engine's right-aligned batch (megatron_step.right_align):

    groups = plan_micro_batches(lengths, micro_batch_size=4, max_tokens=None)   # rows per micro-batch
    mb = pack(batch, groups[0], width=T)       # input_ids / position_ids [1, T], _segments [T], per-row keys

- A micro-batch is `micro_batch_size` rows in order, or, with a token budget (`max_tokens`), rows taken
  longest first into the first micro-batch with room (first-fit decreasing; a row longer than the
  budget gets one of its own): micro-batches of ~equal tokens whatever the lengths.
- Every micro-batch of one call is padded to the same width T (the pipeline's p2p buffers have one
  shape); the padding is one extra segment (id -1) whose outputs nobody reads.
- A micro-batch's response window is its own longest response (and the output at its rows' last token: a reward
  model's score), w <= R (the batch's): every per-row
  [rows, R] key is cut to [rows, w] (the cut columns are padding after every row's last response token,
  masked out of every loss), and `_out_index` [1, rows*w] is the packed column predicting each response
  token (the row's own segment, clamped inside it for a short row), so the LM / value head and the fp32
  log-prob temporaries over the vocabulary run on rows*w columns, not rows*R (issue #41: with a long
  tail, R is several times a typical micro-batch's w). `_response_width` (R) is what forward-only outputs
  are padded back to (megatron_step.loss_func). `TRIM_RESPONSES = False` keeps the full R window
  (bench/packing.py's before / after).
The model attends within each row through models/packed_attention.py (the segment ids stand where
megatron's mask would): the attention work is sum(len^2) over rows, as unpacked. TE's THD path
(cu_seqlens) is the GPU route and is not wired yet.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megappo.models.vision import IMAGE_KEYS, IMAGE_MASK

# per-token keys [B, S, *], laid out with the tokens (right_align, pack, the CP split), and their padding's value:
# routing replay's `_token_index` (each column's token in the batch as given), a vision model's M-RoPE positions
# [B, S, 3] and its image mask (models/vision.py)
TOKEN_KEYS = {"input_ids": 0, "position_ids": 0, "_token_index": -1, IMAGE_MASK: 0}
# per-row keys the packed micro-batch recomputes; every other [B, ...] key is selected by row (and cut to the
# response window unless it is a row's images)
_PACKED_KEYS = tuple(TOKEN_KEYS) + ("attention_mask", "_out_index")
TRIM_RESPONSES = True


def plan_micro_batches(lengths: Sequence[int], micro_batch_size: int, max_tokens: Optional[int] = None) -> list[list[int]]:
    """Row indices of each micro-batch (see the module docstring)."""
    n = len(lengths)
    if max_tokens is None:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} must be >= 1")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(n), key=lambda k: (-int(lengths[k]), k)):
        size = int(lengths[i])
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(max_tokens - size)
    return bins


def packed_width(lengths: Sequence[int], groups: list[list[int]], multiple: int = 1) -> int:
    """The one width every packed micro-batch of the call gets: the fullest one's tokens, rounded up."""
    widest = max(sum(int(lengths[i]) for i in g) for g in groups)
    return -(-max(widest, 1) // multiple) * multiple


def pack(batch: dict, rows: list[int], width: int) -> dict:
    """One packed micro-batch of `rows` of a right-aligned batch (tokens from column 0, `attention_mask`
    1 on them, `_out_index` [B, R] columns within each row), its response window cut to the output columns
    inside its rows' tokens."""
    valid = batch["attention_mask"].bool()
    lengths = valid.sum(-1)
    device = batch["input_ids"].device
    full = batch["_out_index"].shape[1]
    # a row's output columns: those inside its tokens, i.e. its response tokens' predicting columns and the output
    # at its last token (a reward model's score, compute_rm_score: predicting nothing); the response is
    # right-padded, so they are a prefix of the R columns
    responses = (batch["_out_index"][rows] <= (lengths[rows] - 1)[:, None]).sum(-1)
    w = max(int(responses.max()), 1) if TRIM_RESPONSES and rows else full
    laid = {k: torch.full((width, *batch[k].shape[2:]), fill, dtype=batch[k].dtype, device=device)
            for k, fill in TOKEN_KEYS.items() if k in batch}
    seg = torch.full((width,), -1, dtype=torch.long, device=device)
    out_index, start = [], 0
    for k, r in enumerate(rows):
        n = int(lengths[r])
        if start + n > width:
            raise ValueError(f"packed micro-batch needs {start + n} columns, width is {width}")
        for key, t in laid.items():
            t[start:start + n] = batch[key][r, :n]
        seg[start:start + n] = k
        out_index.append(start + batch["_out_index"][r, :w].clamp(0, max(n - 1, 0)))
        start += n
    out = {k: v[rows] for k, v in batch.items() if torch.is_tensor(v) and k not in _PACKED_KEYS
           and v.dim() >= 1 and v.shape[0] == valid.shape[0]}
    out = {k: v[:, :w] if v.dim() >= 2 and v.shape[1] == full and k not in IMAGE_KEYS else v for k, v in out.items()}
    out.update({k: t[None] for k, t in laid.items()})
    out.update(_segments=seg, _response_width=full,
               _out_index=torch.cat(out_index)[None] if out_index else torch.zeros(1, 0, dtype=torch.long),
               _rows=torch.tensor(rows, dtype=torch.long, device="cpu"))
    return out


def balance_across_dp(lengths: Sequence[int], dp: int, mini_batch_size: int) -> list[int]:
    """A row order for an update whose rows are cut into `dp` contiguous shards (rank d: rows
    [d * N/dp, (d+1) * N/dp)), each read as consecutive local mini-batches of m = mini_batch_size/dp rows,
    so that global mini-batch k is local mini-batch k of every rank: rows d * N/dp + [k*m, (k+1)*m).
    Every global mini-batch keeps its rows (its loss and normaliser are unchanged), but they are dealt
    longest first to the rank with the fewest tokens so far (among those still short of m rows): DP
    ranks wait less for the slowest one."""
    n = len(lengths)
    if dp <= 1 or n % mini_batch_size or mini_batch_size % dp:
        return list(range(n))
    per_rank, shard = mini_batch_size // dp, n // dp
    shards: list[list[int]] = [[] for _ in range(dp)]
    for k in range(n // mini_batch_size):
        rows = [d * shard + k * per_rank + j for d in range(dp) for j in range(per_rank)]
        load, taken = [0] * dp, [[] for _ in range(dp)]
        for i in sorted(rows, key=lambda i: (-int(lengths[i]), i)):
            d = min((d for d in range(dp) if len(taken[d]) < per_rank), key=lambda d: (load[d], d))
            taken[d].append(i)
            load[d] += int(lengths[i])
        for d in range(dp):
            shards[d] += sorted(taken[d])
    return [i for shard_rows in shards for i in shard_rows]
