"""Vocab-parallel log-probs and entropy: each TP rank holds logits for its slice of the (padded)
vocab only; the log-sum-exp, the target logit and the entropy's expectation are combined with
all-reduces over the TP group. Columns past the real vocab (padding) are masked to -inf, so they
never get probability. Differentiable (grads flow to every rank's local logits), temperature-aware.

    logprobs, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=V, temperature=T)
"""

from __future__ import annotations

from typing import Optional

import torch


def _tp():
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        return mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank(), \
            mpu.get_tensor_model_parallel_world_size()
    return None, 0, 1


def _all_reduce_sum(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """Forward: sum over TP; backward: identity (every TP rank computes the same downstream loss)."""
    if world == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                            temperature: float = 1.0, compute_entropy: bool = True,
                            tp_group=None, tp_rank: Optional[int] = None, tp_size: Optional[int] = None):
    """logits [..., V_local] (this rank's vocab slice, V_local * tp = padded vocab), targets [...]
    (global token ids) -> (log p(target) [...], entropy [...] or None), both in fp32."""
    if tp_size is None:
        tp_group, tp_rank, tp_size = _tp()
    import torch.distributed as dist

    v_local = logits.shape[-1]
    start = tp_rank * v_local
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    col = torch.arange(start, start + v_local, device=logits.device)
    valid = col < vocab_size  # padded vocab columns never get probability
    if not bool(valid.all()):
        logits = logits.masked_fill(~valid, float("-inf"))

    with torch.no_grad():
        gmax = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - gmax.unsqueeze(-1)
    exp_shifted = shifted.exp()
    sum_exp = _all_reduce_sum(exp_shifted.sum(dim=-1), tp_group, tp_size)
    lse = sum_exp.log()  # log-sum-exp of shifted logits

    local_t = targets - start
    in_range = (local_t >= 0) & (local_t < v_local)
    idx = local_t.clamp(0, v_local - 1).unsqueeze(-1)
    tgt = torch.where(in_range, torch.gather(shifted, -1, idx).squeeze(-1), torch.zeros((), dtype=shifted.dtype, device=shifted.device))
    tgt = _all_reduce_sum(tgt, tp_group, tp_size)
    logp = tgt - lse

    entropy = None
    if compute_entropy:
        # H = lse - E_p[l] with E_p[l] = sum(exp(l) * l) / sum(exp(l)): every global quantity is an
        # all-reduced sum of terms that depend on local logits only, so identity-backward is exact.
        weighted = (exp_shifted * torch.where(valid, shifted, torch.zeros_like(shifted))).sum(dim=-1)
        entropy = lse - _all_reduce_sum(weighted, tp_group, tp_size) / sum_exp
    return logp, entropy
