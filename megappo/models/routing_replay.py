"""MoE routing replay: a forward that routes each token to the experts it is given, not the ones its router picks.

    routes = RoutingReplay(model_chunks, num_layers, topk)   # on every megatron TopKRouter
    with routes.given(target):      # target [tokens, layers, k] global expert ids (-1: the router's own choice)
        model(...)                  #   the routers use the given experts, weighted by their current scores
    with routes.recording() as rec: # the routers' own choices, rec[layer] [tokens, k] after the call
        model(...)
    routes.metrics(count_here)      # collective: agreement of the routers with what they were given

Why: the ratio pi_new / pi_old (or pi_rollout) compares two networks when the trainer's router picks other
experts than the forward that sampled or scored a token (bf16 near-ties, kernel order, a weight update).
Replaying the routes of that forward keeps the network the same and lets the gradient flow only through
the selected experts' weights (Megatron-LM #4168: R3 on Qwen3-30B-A3B; verl, NeMo-RL, slime ship it).

megatron-core 0.19's routers call `router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
compute_topk)` when a router's `router_replay` is set (transformer/moe/moe_utils.py); this module puts one
`_LayerReplay` there per router, in megatron's place (its RouterReplay keeps every router of the process in
one global list, which would mix the actor's and the reference's routers). The facts kept from megatron's:
- the replayed experts' weights are the current router's scores gathered at them (softmax of the gathered
  logits, or the sigmoid scores without the correction bias, then normalised as megatron does), so the
  router's gradient is the one of a forward with those routes fixed, never zero;
- activation recompute re-runs a layer's forward during backward (megatron's CheckpointFunction, inside
  `is_checkpointing()` with grad enabled): the re-run takes the routes its forward took, first in first
  out per router (megatron's schedules run a chunk's backwards in its forwards' order).
A token whose given route is -1 (padding, the last sampled token nobody forwarded, a batch without routes
for some rows) keeps the router's own choice.

Metrics of one optimizer step, over the given routes only (the roles log them as `actor/moe_*`):
  moe_route_agreement             fraction of given (token, layer, slot) routes the router itself chose too
  moe_route_agreement_worst_layer the lowest agreement of one layer
  moe_replay_mismatch             given routes the forward did not send the token to (0 unless the experts'
                                  capacity factor drops tokens): the check that the replay took
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

ROUTES = "routed_experts"  # a MoE batch's routes [B, S, layers, k] int16 global expert ids (-1: none)


def _recomputing() -> bool:
    """Inside megatron's activation recompute (the backward's re-run of a checkpointed forward)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing() and torch.is_grad_enabled()


class _LayerReplay:
    """One router's replay (duck-typed to megatron's RouterReplay: `get_replay_topk`, `layer_number`)."""

    def __init__(self, owner: "RoutingReplay", layer: int):
        self.owner, self.layer = owner, layer
        self.layer_number = layer + 1
        self.target: Optional[torch.Tensor] = None  # [tokens, k] for the micro-batch's forward
        self.backward: list[torch.Tensor] = []  # targets the recompute re-runs will ask for, in order
        self.recorded: Optional[torch.Tensor] = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if _recomputing():
            if not self.backward:
                return own_probs, own
            target = self.backward.pop(0)
        else:
            if self.owner.recording_on:
                self.recorded = own.detach()
            target = self.target
            if target is None:
                return own_probs, own
            if self.owner.keep_for_recompute:
                self.backward.append(target)
            self.owner.count(self.layer, target, own.detach())
        target = target.to(scores.device)
        given = target >= 0
        idx = torch.where(given, target.long(), own)
        return scores.gather(1, idx), idx

    def check(self, module, args, output) -> None:
        """Forward hook on the router: the routing map [tokens, experts] must hold every given route."""
        if self.target is None or _recomputing():
            return
        target = self.target.to(output[1].device)
        given = target >= 0
        routing_map = output[1]
        if routing_map.dtype != torch.bool or routing_map.dim() != 2:
            return
        took = routing_map.gather(1, target.clamp(min=0).long())
        self.owner.counts(routing_map.device)[self.layer, 2] += (given & ~took).sum()


class RoutingReplay:
    def __init__(self, chunks: list, num_layers: int, topk: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.shape = (num_layers, topk)
        self.layers: dict[int, _LayerReplay] = {}
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    layer = _LayerReplay(self, int(module.layer_number) - 1)  # megatron's global, 1-based number
                    module.router_replay = layer
                    module.register_forward_hook(layer.check)
                    self.layers[layer.layer] = layer
        self.recording_on = False
        self.keep_for_recompute = False
        # per layer [agreed slots, given slots, given slots the forward did not take], on the routers' device
        # (allocated by the first count: no host sync per router call on GPU)
        self._counts: Optional[torch.Tensor] = None
        self.replayed = False

    def counts(self, device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(self.shape[0], 3, dtype=torch.int64, device=device)
        return self._counts

    def reset(self) -> None:
        if self._counts is not None:
            self._counts.zero_()
        self.replayed = False
        for layer in self.layers.values():
            layer.backward.clear()

    def count(self, layer: int, target: torch.Tensor, own: torch.Tensor) -> None:
        target = target.to(own.device)
        given = target >= 0
        agreed = (target[:, :, None] == own[:, None, :]).any(-1) & given
        counts = self.counts(own.device)
        counts[layer, 0] += agreed.sum()
        counts[layer, 1] += given.sum()
        self.replayed = True

    @contextlib.contextmanager
    def given(self, target: Optional[torch.Tensor], recompute: bool = False):
        """Route the next forward by `target` [tokens, layers, k] (the routers' flattened [s, b] tokens of this
        rank: megatron_step.micro_batch_routes). `recompute`: the model re-runs layers in backward."""
        if target is None:
            yield
            return
        self.keep_for_recompute = recompute
        for layer in self.layers.values():
            layer.target = target[:, layer.layer]
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.target = None

    @contextlib.contextmanager
    def recording(self):
        """The routers' own top-k of the next forward: yields {layer: [tokens, k]}, filled when the call returns."""
        out: dict[int, torch.Tensor] = {}
        self.recording_on = True
        try:
            yield out
        finally:
            self.recording_on = False
            for i, layer in self.layers.items():
                if layer.recorded is not None:
                    out[i] = layer.recorded
                layer.recorded = None

    def metrics(self, count_here: bool = True) -> dict:
        """Collective (default group), after a call that replayed: the agreement and mismatch counts summed
        over the ranks. `count_here=False` (TP > 1 without sequence parallel: the TP ranks route the same
        tokens) leaves this rank out of the sum."""
        n = self.shape[0]
        total = torch.zeros(n * 3 + 1, dtype=torch.float64)  # the counts, then whether any rank replayed
        if count_here and self._counts is not None:
            total[:-1] = self._counts.to(device="cpu", dtype=torch.float64).reshape(-1)
        total[-1] = float(self.replayed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)  # over gloo
        if not total[-1]:
            return {}
        counts = total[:-1].reshape(n, 3)
        layers = counts[:, 1] > 0
        out = {"moe_replay_mismatch": float(counts[:, 2].sum())}
        if bool(layers.any()):
            per_layer = counts[layers, 0] / counts[layers, 1]
            out.update(moe_route_agreement=float(counts[layers, 0].sum() / counts[layers, 1].sum()),
                       moe_route_agreement_worst_layer=float(per_layer.min()))
        return out
