"""One forward (/ backward) pass of the Megatron engine over a batch: the batch's preparation, its
micro-batches, and the forward-step / loss functions megatron's pipeline schedule calls.

Data flow is explicit: `micro_batches()` turns a batch into the micro-batches the schedule's data
iterator yields (each a dict of this micro-batch's tensors), `run()` hands them to megatron's
forward_backward_func with a `StepSpec` (what every micro-batch of the call shares: head, loss,
temperature, mask, ...) bound as an argument of `forward_step`, and returns what the schedule produced
(per micro-batch, on the last pipeline stage) together with the tokens it computed. Nothing is kept
between calls, on the engine or elsewhere:

- the LM / value head on the output columns only: the model call's `output_processor` (megatron
  GPTModel.forward) gets the micro-batch's `_out_index` as its context (`head_on_outputs`);
- packed rows' RoPE by token position: a forward hook on the chunk's RotaryEmbedding registered for
  the one model call (`packed_rope`), since GPTModel.forward takes no positions for its rope.

Batch layout (see megatron_engine.py): every row is moved to start at column 0 and the batch is cut to
its longest row (`right_align`), so the model runs with plain causal attention.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch

from megappo.models.logprobs import vocab_parallel_logprobs
from megappo.models.vision import images_of
from megappo.workers import packing


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded rows: the first real token gets position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def right_align(batch: dict, response_length: int, seq_multiple: int = 1) -> dict:
    """Rows of [left padding, prompt, response, right padding] -> every row's tokens from column 0,
    cut to the longest row (rounded up to `seq_multiple`, e.g. the TP size for sequence parallel).
    Causal attention alone is then exact for every real token (pads only follow them). Adds
    `_out_index` [B, R], the column whose output belongs to response token j (the logits that
    predict it, the value of the state before it), and `_targets` [B, R], the response token ids."""
    ids, mask = batch["input_ids"], batch["attention_mask"].long()
    b, s = ids.shape
    r = response_length
    lengths = mask.sum(-1)
    lead = (mask.cumsum(-1) == 0).sum(-1)  # padding columns before each row's first token
    width = int(lengths.max()) if b else 1
    width = min(-(-width // seq_multiple) * seq_multiple, -(-s // seq_multiple) * seq_multiple)
    cols = torch.arange(width, device=ids.device)
    src = (cols[None] + lead[:, None]).clamp(max=s - 1)
    valid = cols[None] < lengths[:, None]
    if bool(((mask.gather(1, src) * valid).sum(-1) != lengths).any()):
        raise ValueError("attention_mask rows must hold one contiguous run of tokens (left-padded prompt + "
                         "right-padded response); a row has a gap")
    # the column predicting response token 0, after the shift; a row whose tokens do not fill the last
    # R + 1 columns (a short row in a scoring batch) gets clamped columns there: outputs for padding
    first = s - r - 1 - lead
    pos = batch.get("position_ids")
    out = dict(batch, position_ids=position_ids_from_mask(mask) if pos is None else pos)
    for key, fill in packing.TOKEN_KEYS.items():  # the per-token keys, each row's from column 0
        if key in out:
            out[key] = take_columns(out[key], src, valid, fill)
    out["attention_mask"] = valid.long()
    out["_out_index"] = (first[:, None] + torch.arange(r, device=ids.device)[None]).clamp(0, width - 1)
    out["_targets"] = ids[:, s - r:]
    return out


def take_columns(x: torch.Tensor, src: torch.Tensor, valid: torch.Tensor, fill) -> torch.Tensor:
    """[B, S, *] -> [B, W, *]: row b's columns src[b] where `valid` [B, W], `fill` elsewhere."""
    extra = (1,) * (x.dim() - 2)
    taken = x.gather(1, src.view(*src.shape, *extra).expand(*src.shape, *x.shape[2:]))
    return torch.where(valid.view(*valid.shape, *extra), taken, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


def split_rows(batch: dict, mbs: int) -> list[dict]:
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + mbs] for k, v in batch.items()} for i in range(0, n, mbs)]


@dataclass(frozen=True)
class MicroBatches:
    """A prepared batch cut for the schedule: `items` (one dict per micro-batch), their sequence length
    `seq` and row count `rows` as the schedule sees them, and the tokens the model computes for them."""
    items: list
    seq: int
    rows: int
    computed_tokens: int


def micro_batches(batch: dict, micro_batch_size: int, *, packed: bool, pp: int, vpp: Optional[int],
                  seq_multiple: int, max_tokens: Optional[int], cp: Optional[tuple[int, int]] = None) -> MicroBatches:
    """A right-aligned batch as the schedule's micro-batches: rows of `micro_batch_size`, or (`packed`)
    each micro-batch one sequence of real tokens (workers/packing.py) that carries its rows' ids per
    column (`_segments`), which the model's attention (models/packed_attention.py) gets where a mask
    would go; the schedule then sees [width, 1] micro-batches. `cp` (size, rank) > 1: each packed
    micro-batch is this context-parallel rank's share of it (`cp_local`)."""
    if packed or cp:
        lengths = batch["attention_mask"].sum(-1).tolist()
        groups = packing.plan_micro_batches(lengths, micro_batch_size, max_tokens)
        if vpp and len(groups) % pp:
            raise ValueError(f"interleaved pipeline (vpp={vpp}) needs a multiple of pp={pp} micro-batches; the "
                             f"token budget gave {len(groups)}: set max_tokens_per_micro_batch null (row-count "
                             "micro-batches) or turn vpp off")
        width = packing.packed_width(lengths, groups, 1 if cp else seq_multiple)
        items = [packing.pack(batch, g, width) for g in groups]
        if cp:  # each packed micro-batch cut over the CP group (parallel/context_parallel.py)
            from megappo.parallel.context_parallel import local_width

            size, rank = cp
            local = local_width([m["_segments"] for m in items], size, seq_multiple)
            items = [cp_local(m, size, rank, local) for m in items]
            return MicroBatches(items, local, 1, local * size * len(items))  # the replica's CP ranks' together
        return MicroBatches(items, width, 1, width * len(groups))
    bsz, seq = batch["input_ids"].shape
    items = split_rows(batch, micro_batch_size)
    if vpp and len(items) % pp:
        raise ValueError(f"interleaved pipeline (vpp={vpp}) needs the number of micro-batches "
                         f"({len(items)}) to be a multiple of pp={pp}")
    if len({m["input_ids"].shape[0] for m in items}) != 1:
        raise ValueError(f"batch size {bsz} is not a multiple of micro_batch_size {micro_batch_size}")
    return MicroBatches(items, seq, micro_batch_size, int(batch["input_ids"].numel()))


def cp_local(mb: dict, cp: int, rank: int, width: int) -> dict:
    """A packed micro-batch -> context-parallel rank `rank`'s share: its tokens and positions [1, L], its
    slots' rows `_segments` [L] (-1: padding), what its attention needs against the keys gathered over the
    group `_cp_attention` (CPSplit.chunk_sizes: the rows' chunk table [rows, 2]), and of the output columns
    (`_out_index`) the ones it holds: `_out_index` [1, m] (its slots) and `_cp_where` [m] (their places among the
    micro-batch's outputs). Per-row keys stay whole: every CP rank computes the loss from the outputs summed over
    the group (model_outputs)."""
    from megappo.parallel.context_parallel import zigzag_split

    split = zigzag_split(mb["_segments"].cpu(), cp, width=width)
    device = mb["input_ids"].device
    owner, slot = split.owner(mb["_out_index"][0].cpu())
    mine = owner == rank
    out = dict(mb)
    out.update(input_ids=split.take(mb["input_ids"][0].cpu(), rank)[None].to(device),
               position_ids=split.take(mb["position_ids"][0].cpu(), rank)[None].to(device),
               _segments=split.row[rank].to(device), _cp_attention=split.chunk_sizes().to(device),
               _out_index=slot[mine][None].to(device), _cp_where=torch.nonzero(mine).flatten().to(device),
               _cp_positions=int(mb["_segments"].numel()))
    if "_token_index" in mb:
        out["_token_index"] = split.take(mb["_token_index"][0].cpu(), rank, fill=-1)[None].to(device)
    return out


@dataclass(frozen=True)
class StepSpec:
    """What every micro-batch of one engine call shares (bound to `forward_step` / `loss_func`)."""
    value_head: bool
    vocab_size: int
    head_on_outputs: bool  # the head runs on the `_out_index` columns only (not under sequence parallel)
    packed: bool
    mask: Optional[torch.Tensor]  # the explicit causal mask (megatron's local attention), or None
    forward_only: bool
    loss_fn: Optional[Callable]
    normalizer: Optional[float]
    temperature: float
    compute_entropy: bool
    expert_load: Any = None  # models/expert_load.ExpertLoad of a MoE model, else None
    # routing replay (models/routing_replay.py) of a MoE model: the routes to give the routers, [tokens of the
    # batch as given (B * S), layers, k], and / or where to record theirs (same shape); the micro-batches'
    # `_token_index` says which of those tokens each column is
    routing: Any = None
    sequence_parallel: bool = False
    given_routes: Optional[torch.Tensor] = None
    record_routes: Optional[torch.Tensor] = None
    recompute: bool = False


def run(spec: StepSpec, micro: MicroBatches, model: list) -> list:
    """megatron's forward_backward_func over the micro-batches; returns the schedule's per-micro-batch
    outputs (the loss functions' reported dicts; on the last pipeline stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.core import parallel_state as mpu

    iters = [iter(micro.items) for _ in model] if len(model) > 1 else iter(micro.items)
    fb = get_forward_backward_func()
    # the schedule's p2p shape is seq_length / the CP size (its own CP's split): micro.seq is a CP rank's already
    seq = micro.seq * mpu.get_context_parallel_world_size()
    return fb(forward_step_func=partial(forward_step, spec), data_iterator=iters,
              model=model if len(model) > 1 else model[0], num_microbatches=len(micro.items), seq_length=seq,
              micro_batch_size=micro.rows, forward_only=spec.forward_only)


def forward_step(spec: StepSpec, data_iterator, model):
    """megatron's forward_step_func (bound to `spec`): the next micro-batch through `model` (a chunk)."""
    mb = next(data_iterator)
    head = {"output_processor": head_on_outputs, "output_processor_context": mb["_out_index"]} \
        if spec.head_on_outputs else {}
    # context parallel runs packed (MegatronEngine.packed): a CP rank's mask against the gathered keys, or the rows' ids
    mask = mb.get("_cp_attention", mb.get("_segments")) if spec.packed else spec.mask
    # packed rows restart their positions: RoPE by token (M-RoPE, positions [b, s, 3], takes them per token itself)
    by_token = spec.packed and mb["position_ids"].dim() == 2
    with expert_tokens(spec.expert_load, mb, spec.packed), routes_of(spec, mb), \
            packed_rope(model, mb["position_ids"][0] if by_token else None, mb.get("_cp_positions")):
        output = model(mb["input_ids"], mb["position_ids"], mask, **head, **images_of(mb))
    return output, partial(loss_func, spec, mb)


def loss_func(spec: StepSpec, mb: dict, output: torch.Tensor):
    """megatron's loss_func (bound to `spec` and the micro-batch): (loss, 1, reported)."""
    outs = model_outputs(spec, output, mb)
    one = torch.ones((), dtype=torch.int, device=output.device)
    if spec.forward_only and spec.loss_fn is None:
        rows = {"_rows": mb["_rows"]} if spec.packed else {}  # forward_only puts the rows back in order
        width = mb.get("_response_width")  # packed: the micro-batch's window padded back to the batch's R
        return torch.zeros((), dtype=torch.float32, device=output.device), one, \
            {**{k: pad_columns(v.detach(), width) for k, v in outs.items()}, **rows}
    loss_sum, metrics = spec.loss_fn(outs, mb)
    loss = loss_sum / spec.normalizer
    reported = {"loss": loss.detach().clone()}
    reported.update({k: torch.as_tensor(v, device=output.device).detach().float()
                     for k, v in (metrics or {}).items()})
    return loss, one, reported


def pad_columns(x: torch.Tensor, width: Optional[int]) -> torch.Tensor:
    """[rows, w] -> [rows, width], zeros on the right (the columns past every row's response)."""
    if width is None or x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def model_outputs(spec: StepSpec, output: torch.Tensor, mb: dict) -> dict:
    """The model's output at the response positions: {"values"} (value head) or {"logprobs"[, "entropy"]}."""
    idx = mb["_out_index"]
    if spec.head_on_outputs:  # [b, R, *]: already the output columns
        logits = output
    else:
        logits = output.gather(1, idx.unsqueeze(-1).expand(-1, -1, output.shape[-1]))
    rows, r = mb["_targets"].shape
    where = mb.get("_cp_where")
    if where is not None:  # context parallel: this rank's output columns [1, m]; the rest are other ranks'
        out = _head(spec, logits, mb["_targets"].reshape(-1)[where][None])
        from megatron.core import parallel_state as mpu

        from megappo.parallel.context_parallel import sum_over_cp

        group = mpu.get_context_parallel_group()
        return {k: sum_over_cp(v.new_zeros(rows * r).index_copy(0, where, v[0]), group).reshape(rows, r)
                for k, v in out.items()}
    if logits.shape[0] != rows:  # packed: [1, rows * R, *] -> [rows, R, *]
        logits = logits.reshape(rows, r, logits.shape[-1])
    return _head(spec, logits, mb["_targets"])


def _head(spec: StepSpec, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    if spec.value_head:
        return {"values": logits[..., 0].float()}
    logp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=spec.vocab_size,
                                        temperature=spec.temperature, compute_entropy=spec.compute_entropy)
    out = {"logprobs": logp}
    if ent is not None:
        out["entropy"] = ent
    return out


def head_on_outputs(*, hidden_states, output_layer, output_weight, runtime_gather_output, context, scale_logits,
                    **_):
    """GPTModel's `output_processor` on the last stage: the hidden states [s, b, h] cut to the columns
    whose outputs are used (`context`: `_out_index` [b, R], the positions predicting the response
    tokens) -> [R, b, h], then the output layer as GPTModel applies it -> logits [b, R, *]. The head's
    matmul and every op over the vocabulary then scale with the response length, not the sequence
    length (a prompt is often the longer part); the gather's backward puts the gradients back in place."""
    idx = context
    picked = hidden_states.gather(0, idx.t().unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1]))
    logits, _ = output_layer(picked, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return scale_logits(logits).transpose(0, 1).contiguous()


@contextlib.contextmanager
def packed_rope(model, positions: Optional[torch.Tensor], width: Optional[int] = None):
    """For one model call: megatron's RoPE is indexed by column; a packed micro-batch's rows restart at
    their own positions (`positions` [T]), so the chunk's RotaryEmbedding looks the frequencies up per
    token: the GPTModel's one, or under multi-latent attention each layer's own (a YaRN embedding, which
    returns (frequencies, mscale)). None: the chunk's own RoPE."""
    if positions is None:
        yield
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    # the table of the packed width's positions: a row's positions run 0..n-1 over its n columns (left-padded
    # prompts' cumsum), so it holds every one; a host-side length, where positions.max() waited for the device in
    # each layer's RoPE (multi-latent attention: one per layer). Row p depends on p alone: the same values.
    # `width`: a context-parallel rank's tokens hold positions of the whole packed micro-batch
    width = width or positions.numel()

    def by_position(module, args, output):
        full = type(module).forward(module, width)  # [width, 1, 1, d] (no hooks)
        if isinstance(full, tuple):  # YaRN: (frequencies, mscale)
            return (full[0].index_select(0, positions.to(full[0].device)),) + tuple(full[1:])
        return full.index_select(0, positions.to(full.device))

    handles = [m.register_forward_hook(by_position)
               for m in getattr(model, "module", model).modules() if isinstance(m, RotaryEmbedding)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def expert_tokens(expert_load, mb: dict, packed: bool):
    """MoE: the micro-batch's real tokens [s, b] for the expert-load counts (models/expert_load.py)."""
    if expert_load is None:
        return contextlib.nullcontext()
    if packed:
        valid = (mb["_segments"] >= 0)[:, None]
    else:
        valid = mb["attention_mask"].bool().t() if "attention_mask" in mb else None
    return expert_load.tokens(valid)


def router_tokens(token_index: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """A micro-batch's `_token_index` [b, s] -> the tokens its routers see, in their order: megatron flattens the
    hidden states [s, b, h] (s major); under sequence parallelism a TP rank routes its own slice of s."""
    from megappo.models.expert_load import sequence_parallel_share

    tokens = token_index.t()
    return (sequence_parallel_share(tokens) if sequence_parallel else tokens).reshape(-1)


@contextlib.contextmanager
def routes_of(spec: StepSpec, mb: dict):
    """MoE routing replay for one model call: the routers get the micro-batch's given routes (-1 where a
    token has none: padding), and / or their own choices are written to `spec.record_routes` by token."""
    if spec.routing is None or (spec.given_routes is None and spec.record_routes is None):
        yield
        return
    tokens = router_tokens(mb["_token_index"], spec.sequence_parallel)
    real = tokens >= 0
    target = None
    if spec.given_routes is not None:
        given = spec.given_routes
        target = torch.where(real.to(given.device)[:, None, None], given[tokens.clamp(min=0).to(given.device)], -1)
    with spec.routing.given(target, recompute=spec.recompute), contextlib.ExitStack() as stack:
        recorded = stack.enter_context(spec.routing.recording()) if spec.record_routes is not None else None
        yield
    if recorded:
        into = spec.record_routes
        where = tokens[real].to(into.device)
        for layer, idx in recorded.items():
            into[where, layer] = idx[real.to(idx.device)].to(into.dtype).to(into.device)
