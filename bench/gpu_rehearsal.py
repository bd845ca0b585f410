"""One GPU rank of a config's colocated PPO step, rehearsed on one device with torch + megatron-core only (#67):
the rank's shard shapes built as a one-process megatron model, the step's phases run in the trainer's order with
real allocations, and each phase's peak device memory set beside `megappo plan`'s for the same one-GPU job.

    python bench/gpu_rehearsal.py --config configs/ppo_7b.yaml            # on the lent GPU
    python bench/gpu_rehearsal.py --config configs/ppo_tiny.yaml --device cpu   # the code path here (no memory read)

The shard: the actor's TP rank of a dense model (attention heads, kv heads, FFN and the padded vocabulary / tp;
layers / pp; hidden size whole), random weights (no checkpoint is read). Actor (trained), critic
(value head, trained, `critic.offload` honoured) and reference (frozen) are megatron engines of that shape, in the
config's dtype, recompute and optimizer settings. Phases, as ray_trainer's step runs them:

- weight_sync: the actor's weights stream through the Resharder's buckets into one buffer the size of vLLM's
  weights (what vLLM's awake weights hold; its KV cache not yet);
- rollout: vLLM's wake-up: gpu_memory_utilization of the device less those weights allocated as one tensor (the
  KV cache and workspace), then freed as sleep frees them (the weights too at rollout.sleep_level 2);
- old_log_prob, ref_log_prob, values: forward passes over the step's micro-batches (prompt + response tokens);
- critic_update, actor_update: one optimizer step each over `--micro-batches` micro-batches.

Compared with: `megappo plan` of the same config made one GPU (every role TP1 x PP1 x DP1, rollout TP1, the
shard's shapes, this device's GiB), less its fixed overhead (NCCL buffers and CUDA contexts, which torch's
allocator does not see). Not rehearsed: vLLM itself (it cannot be carried to a lent machine), NCCL, and what one
GPU cannot show of TP and DP: the distributed optimizer runs over one rank (its states unsharded: the one-GPU plan
counts them so too; the config's own plan is printed beside), and TP's sequence-parallel split of the norms'
activations (whole-sequence at TP1). Prints one JSON object; on CPU the phases run and no memory is read.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
import tempfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("weight_sync", "rollout", "old_log_prob", "ref_log_prob", "values", "critic_update", "actor_update")


def shard_config(cfg, device: str, gpu_gib: float):
    """The config made one GPU: model.arch is the actor's TP rank's shard (of a dense model), every role TP1 x PP1
    x DP1, rollout TP1, one worker with `gpu_gib` of memory. A MoE or MLA model is refused in one line."""
    from megappo.config import ConfigError
    from megappo.parallel.model_dims import MLA_MODEL_TYPES, padded_vocab_size

    a, par = cfg.model.arch, cfg.actor.parallel
    if a.num_experts or a.family in MLA_MODEL_TYPES:
        raise ConfigError(f"this rehearsal shards dense models only ({a.family} has experts or multi-latent "
                          "attention); rehearse a dense config such as configs/ppo_7b.yaml")
    if a.num_attention_heads % par.tp or a.num_kv_heads % par.tp or a.num_layers % par.pp:
        raise ConfigError(f"actor.parallel tp={par.tp} pp={par.pp} does not divide the model's heads / layers")
    out = copy.deepcopy(cfg)
    s = out.model.arch
    s.head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    s.num_attention_heads, s.num_kv_heads = a.num_attention_heads // par.tp, a.num_kv_heads // par.tp
    s.intermediate_size, s.num_layers = a.intermediate_size // par.tp, a.num_layers // par.pp
    s.vocab_size = padded_vocab_size(a.vocab_size, par.tp) // par.tp
    for role in ("actor", "critic", "ref"):
        out[role].parallel.tp = out[role].parallel.pp = out[role].parallel.dp = 1
        out[role].parallel.vpp = None
    out.rollout.tp = 1
    out.resources.device, out.resources.nodes, out.resources.workers_per_node = device, 1, 1
    out.resources.gpu_memory_gb = gpu_gib
    return out


def write_hf_config(cfg, out_dir: Path) -> Path:
    """config.json of the shard (no weights: the engines keep megatron's random init)."""
    from transformers import AutoConfig

    from megappo.config.validate import arch_as_hf

    hf = {k: v for k, v in arch_as_hf(cfg.model.arch).items() if v is not None}
    AutoConfig.for_model(**hf).save_pretrained(out_dir)
    return out_dir


class Meter:
    """Peak device memory per phase: allocated (tensors) and reserved (torch's caching allocator), in GiB."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.phases: dict = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        yield
        self.phases[name] = self.read()

    def read(self) -> dict:
        if not self.cuda:
            return {"allocated_peak_gib": None, "reserved_peak_gib": None}
        import torch

        torch.cuda.synchronize()
        return {"allocated_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def random_weights(chunks, *_args) -> list:
    """In load_hf_weights' place (megappo builds with perform_initialization off, the weights coming from HF):
    normal(0, 0.02) matrices, norms at 1, biases at 0, on the device the engine built them."""
    import torch

    with torch.no_grad():
        for chunk in chunks:
            for name, t in chunk.named_parameters():
                if "norm" in name.rsplit(".", 2)[-2] or name.endswith("layer_norm_weight"):
                    t.fill_(1.0)
                elif name.endswith("bias") or t.dim() < 2:
                    t.zero_()
                else:
                    t.normal_(0.0, 0.02)
    return []


def make_batch(cfg, rows: int, vocab: int, device: str) -> dict:
    import torch

    s, r = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, s), generator=g)
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(rows, r, generator=g),
             "returns": torch.randn(rows, r, generator=g), "response_mask": mask[:, -r:].float()}
    return {k: v.to(device) for k, v in batch.items()}


def policy_loss(out, mb):
    m = mb["response_mask"]
    return -(out["logprobs"] * mb["advantages"] * m).sum(), {}


def value_loss(out, mb):
    m = mb["response_mask"]
    return (((out["values"] - mb["returns"]) ** 2) * m).sum(), {}


def rehearse(cfg, shard, model_dir: Path, micro_batches: int, meter: Meter) -> dict:
    """The phases in the trainer's order on one device; returns what each measured."""
    import torch

    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.resharding import Resharder
    from megappo.param_counts import total_params
    from megappo.workers.engine_config import engine_config_from
    from megappo.workers.megatron_engine import MegatronEngine

    device = shard.resources.device
    layout = ParallelLayout()
    with mock.patch("megappo.workers.megatron_engine.load_hf_weights", random_weights):  # no checkpoint is read
        actor = MegatronEngine(model_dir, layout, engine_config_from(shard, "actor"))
        critic = MegatronEngine(model_dir, layout, engine_config_from(shard, "critic")) if shard.critic.enable else None
        ref = MegatronEngine(model_dir, layout, engine_config_from(shard, "ref")) if shard.ref.enable else None
    r, mbs = shard.rollout.max_new_tokens, shard.actor.micro_batch_size
    batch = make_batch(shard, mbs * micro_batches, shard.model.arch.vocab_size, device)
    norm = float(batch["response_mask"].sum())
    vllm_weight_bytes = 2 * total_params(shard)  # bf16, rollout TP1: the whole shard
    out = {"vllm_weights_gib": round(vllm_weight_bytes / 2**30, 2)}

    with meter("weight_sync"):
        weights = torch.empty(vllm_weight_bytes, dtype=torch.uint8, device=device)  # vLLM's awake weights
        offset, sent = 0, 0
        sync = Resharder(actor.inner_chunks(), actor.dims, actor.layout, rollout_tp=1,
                         bucket_bytes=int(shard.rollout.weight_sync_bucket_mb) << 20)
        with actor.resident(parts=["params"]):
            for bucket in sync.buckets():
                for _, t in bucket.tensors:
                    flat = t.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8)
                    n = min(flat.numel(), weights.numel() - offset)
                    weights[offset:offset + n].copy_(flat[:n])
                    offset, sent = offset + n, sent + flat.numel()
        out["weight_sync_bytes"] = sent
        del sync
    with meter("rollout"):
        total = (torch.cuda.get_device_properties(0).total_memory if device == "cuda"
                 else int(shard.resources.gpu_memory_gb * 2**30))
        kv_bytes = max(0, int(shard.rollout.gpu_memory_utilization * total) - vllm_weight_bytes)
        kv = torch.empty(kv_bytes if device == "cuda" else 1, dtype=torch.uint8, device=device)  # KV cache + workspace
        out["kv_cache_gib"] = round(kv_bytes / 2**30, 2)
        del kv  # sleep frees the KV cache ...
        if shard.rollout.free_cache_engine and shard.rollout.sleep_level == 2:
            del weights  # ... and level 2 the weights
            weights = None
        if device == "cuda":
            torch.cuda.empty_cache()  # vLLM's sleep returns its memory to the device
    with meter("old_log_prob"):
        actor.forward_only(batch, r, mbs)
    if ref is not None:
        with meter("ref_log_prob"):
            ref.forward_only(batch, r, mbs)
    if critic is not None:
        with meter("values"), critic.resident():
            critic.forward_only(batch, r, mbs)
        with meter("critic_update"), critic.resident():
            out["critic_loss"] = critic.train_step(batch, value_loss, norm, r, mbs)["loss"]
    with meter("actor_update"):
        out["actor_loss"] = actor.train_step(batch, policy_loss, norm, r, mbs)["loss"]
    out["finite"] = all(math.isfinite(v) for k, v in out.items() if k.endswith("_loss"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per forward / update phase")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "gpu_rehearsal: --device cuda but torch sees no CUDA device; run it on the GPU machine, or "
                  "--device cpu to try the code path here\n")
    from megappo.config import ConfigError, load_config
    from megappo.parallel.launch import free_port
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.memory_model import CUDA_CONTEXT_GB, OVERHEAD_GB, plan

    try:
        cfg = load_config(args.config, args.overrides)
        gpu_gib = (torch.cuda.get_device_properties(0).total_memory / 2**30 if args.device == "cuda"
                   else float(cfg.resources.gpu_memory_gb))
        shard = shard_config(cfg, args.device, gpu_gib)
    except ConfigError as e:
        p.exit(2, f"gpu_rehearsal: {e}\n")
    planned = plan(shard)
    overhead = OVERHEAD_GB + CUDA_CONTEXT_GB * planned["processes_per_gpu"]
    init_distributed(0, 1, "127.0.0.1", free_port(), backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    init_megatron(ParallelLayout(), seed=int(cfg.trainer.seed))
    meter = Meter(args.device)
    with tempfile.TemporaryDirectory() as d:
        ran = rehearse(cfg, shard, write_hf_config(shard, Path(d)), args.micro_batches, meter)
    phases = {}
    for name in PHASES:
        if name not in meter.phases:
            continue
        want = planned["phases_gb"].get(name)
        got = meter.phases[name]
        phases[name] = {**got, "planned_gib": None if want is None else round(want - overhead, 2)}
        if want is not None and got["reserved_peak_gib"] is not None:
            phases[name]["measured_over_planned"] = round(got["reserved_peak_gib"] / max(want - overhead, 1e-9), 3)
    print(json.dumps({
        "config": args.config, "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "gpu_gib": round(gpu_gib, 2),
        "shard": {k: shard.model.arch[k] for k in ("hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                                                   "intermediate_size", "num_layers", "vocab_size")},
        "rows_per_phase": shard.actor.micro_batch_size * args.micro_batches,
        "tokens_per_row": cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        "planned_overhead_gib_left_out": round(overhead, 2), "phases": phases, "ran": ran,
        "config_plan": {k: plan(cfg)[k] for k in ("phases_gb", "peak_phase", "peak_gpu_gb", "fits")}}))
    return 0 if ran["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
