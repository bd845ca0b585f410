"""Per-step expert load of a mixture-of-experts model: how many real tokens each routed expert got.

    load = ExpertLoad(model_chunks, num_layers, num_experts)   # forward hooks on megatron's routers
    load.reset()
    with load.tokens(valid):        # around each micro-batch's forward: [s, b] bool, True on real tokens
        model(...)
    load.metrics(count_here)        # collective over the default group: summary of the counts so far

Each router's forward returns (probs, routing_map [tokens, experts]); the hook adds the routing map's
column sums over the real tokens (padding columns of a right-aligned or packed micro-batch are not
counted) while `tokens()` is open: the forward of each micro-batch, not the re-run of a layer's forward
that activation recompute does during backward. With sequence parallelism a TP rank routes its own slice of the sequence, so the counts of
every rank add up: data-parallel and expert-parallel ranks route different rows, pipeline stages
different layers. `count_here=False` (TP > 1 without sequence parallelism: the TP ranks route the same
tokens) leaves a rank out of the sum.

Metrics of one optimizer step (the roles log them as `actor/moe_*`, `critic/moe_*`, averaged over the
step's mini-batches), summarised over the MoE layers from each layer's max and mean tokens per expert:
  moe_load_max_over_mean        mean over layers of max / mean tokens per expert (1 = perfectly even)
  moe_load_max_over_mean_worst  the worst layer's max / mean
  moe_idle_experts              (layer, expert) pairs that got no token
  moe_tokens_routed             real tokens x top-k routed, all layers
The shared experts (Qwen2-MoE, GLM-4.5, DeepSeek-V3: every token through them, beside the routed ones) are
reported apart, by a hook on megatron's SharedExpertMLP, and never enter the routed counts above:
  moe_shared_tokens             real tokens through the shared experts, all MoE layers
  moe_shared_gate_mean          the mean sigmoid gate a shared expert's output is scaled by (Qwen2-MoE's gate)
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist


def sequence_parallel_share(x: torch.Tensor) -> torch.Tensor:
    """[s, b, ...] over a micro-batch -> the rows this TP rank holds under sequence parallelism (its slice of s),
    in the order megatron's layers see them."""
    from megatron.core import parallel_state as mpu

    s = x.shape[0] // mpu.get_tensor_model_parallel_world_size()
    r = mpu.get_tensor_model_parallel_rank()
    return x[r * s:(r + 1) * s]


class ExpertLoad:
    def __init__(self, chunks: list, num_layers: int, num_experts: int):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        # on the routers' device (allocated by the first count): no host sync per router call on GPU
        self.counts: Optional[torch.Tensor] = None
        self._shape = (num_layers, num_experts)
        self._valid: Optional[torch.Tensor] = None
        self._active = False  # inside `tokens()`: a recomputed forward (activation recompute) is not counted
        self.shared: Optional[torch.Tensor] = None  # [real tokens, sum of their gates] through shared experts
        self.has_shared = self.shared_gated = False
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    layer = int(module.layer_number) - 1  # megatron's global, 1-based layer number
                    module.register_forward_hook(self._hook(layer))
                elif isinstance(module, SharedExpertMLP):
                    self.has_shared = True
                    self.shared_gated = self.shared_gated or bool(module.use_shared_expert_gate)
                    module.register_forward_hook(self._shared_hook)

    def _real_rows(self, n: int) -> Optional[torch.Tensor]:
        """The real-token mask over a layer input's n flattened [s, b] rows (None: all real)."""
        valid = self._valid
        if valid is None:
            return None
        flat = valid.reshape(-1)
        if flat.numel() != n:  # sequence parallel: this TP rank's slice of s
            flat = sequence_parallel_share(valid).reshape(-1)
        return flat

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not self._active:  # activation recompute re-runs the router during backward: counted once
                return
            routing_map = output[1].detach()
            rows = self._real_rows(routing_map.shape[0])
            if rows is not None:  # masked, not indexed: a boolean index waits for the device (its size) every layer
                routing_map = routing_map & rows.to(routing_map.device)[:, None]
            if self.counts is None:
                self.counts = torch.zeros(self._shape, dtype=torch.int64, device=routing_map.device)
            self.counts[layer] += routing_map.sum(0)
        return hook

    @torch.no_grad()
    def _shared_hook(self, module, args, output):
        if not self._active:
            return
        h = args[0].detach()
        h = h.reshape(-1, h.shape[-1])
        rows = self._real_rows(h.shape[0])
        rows = None if rows is None else rows.to(h.device)
        if self.shared is None:
            self.shared = torch.zeros(2, dtype=torch.float64, device=h.device)
        self.shared[0] += h.shape[0] if rows is None else rows.sum()
        if module.use_shared_expert_gate:  # the gate megatron's forward scales the shared output by
            gate = torch.sigmoid(torch.nn.functional.linear(h.float(), module.gate_weight.float())).squeeze(-1)
            self.shared[1] += (gate if rows is None else torch.where(rows, gate, 0.0)).sum()

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()
        if self.shared is not None:
            self.shared.zero_()

    @contextlib.contextmanager
    def tokens(self, valid: Optional[torch.Tensor]):
        """The real-token mask [s, b] of the micro-batch the model is about to run (None: count all)."""
        self._valid, self._active = valid, True
        try:
            yield
        finally:
            self._valid, self._active = None, False

    def metrics(self, count_here: bool = True) -> dict:
        """Collective (default group): the counts since `reset()`, summed over the ranks, summarised."""
        E = self._shape[1]  # routed counts [layers, experts], then the shared experts' two sums, in one reduce
        total = torch.zeros(self._shape[0] * E + 2, dtype=torch.float64, device="cpu")  # reduced over gloo
        if count_here and self.counts is not None:
            total[:-2] += self.counts.to(device="cpu", dtype=torch.float64).reshape(-1)
        if count_here and self.shared is not None:
            total[-2:] += self.shared.to("cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        counts = total[:-2].reshape(self._shape)
        layers = [i for i in range(counts.shape[0]) if counts[i].sum() > 0]  # the MoE layers of every stage
        if not layers:
            return {}
        per = counts[layers]  # [moe layers, experts]
        mean = per.mean(1).clamp_min(1e-12)
        ratio = per.max(1).values / mean
        out = {"moe_load_max_over_mean": float(ratio.mean()), "moe_load_max_over_mean_worst": float(ratio.max()),
               "moe_idle_experts": float((per == 0).sum()), "moe_tokens_routed": float(per.sum())}
        if self.has_shared:
            out["moe_shared_tokens"] = float(total[-2])
            if self.shared_gated:
                out["moe_shared_gate_mean"] = float(total[-1] / total[-2].clamp_min(1.0))
        return out
