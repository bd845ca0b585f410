"""One GPU rank of a config's colocated PPO step, rehearsed on one device with torch + megatron-core only (#67, #77):
the rank's shard shapes built as a one-process megatron model, the step's phases run in the trainer's order with
real allocations, and each phase's peak device memory set beside `megappo plan`'s for the same one-GPU job.

    python bench/gpu_rehearsal.py --config configs/ppo_7b.yaml            # on the lent GPU
    python bench/gpu_rehearsal.py --device cpu --config configs/ppo_tiny_moe.yaml \
        --config "configs/ppo_tiny_moe.yaml model.path=assets/tiny-deepseek_v3"   # the code path here (no memory read)

`--config` repeats (a config and its own overrides in one argument): each is rehearsed in turn in this process and
prints one JSON object (allocated_before_gib: what the earlier ones left on the device). The model's shapes are
model.path's config.json when it has one, else model.arch.

The shard: the actor's (TP, EP) rank of a dense, MoE or multi-latent-attention model (shard_config says how each
tensor is split), with as many of its pipeline stage's layers as the plan fits on this one GPU (DeepSeek-V3's rank
does not fit whole); shard_notes counts what it holds otherwise than the real rank. Random weights (no checkpoint
is read). Actor (trained), critic (value head, trained, `critic.offload` honoured) and reference (frozen) are
megatron engines of that shape, in the config's dtype, recompute and optimizer settings; `ran.backends` names the
layer spec, attention, experts and token dispatcher they built. Phases, as ray_trainer's step runs them:

- weight_sync: the actor's weights stream through the Resharder's buckets into one buffer the size of vLLM's
  weights (what vLLM's awake weights hold; its KV cache not yet);
- rollout: vLLM's wake-up: gpu_memory_utilization of the device less those weights allocated as one tensor (the
  KV cache and workspace), then freed as sleep frees them (the weights too at rollout.sleep_level 2);
- old_log_prob, ref_log_prob, values: forward passes over the step's micro-batches (prompt + response tokens);
- critic_update, actor_update: one optimizer step each over `--micro-batches` micro-batches.

Compared with: `megappo plan` of the shard (every role TP1 x PP1 x DP1 x EP1, rollout TP1, the shard's shapes, this
device's GiB), less its fixed overhead (NCCL buffers and CUDA contexts, which torch's allocator does not see). Not
rehearsed: vLLM itself (it cannot be carried to a lent machine), NCCL and the MoE alltoall, and what one GPU cannot
show of TP, DP and EP: the distributed optimizer runs over one rank (its states unsharded: the one-GPU plan counts
them so too; the config's own plan is printed beside), TP's sequence-parallel split of the norms' activations
(whole-sequence at TP1), and the routing's imbalance over EP ranks (here the rank's experts take exactly T * top-k
token copies, a balanced share). On CPU the phases run and no memory is read.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("weight_sync", "rollout", "old_log_prob", "ref_log_prob", "values", "critic_update", "actor_update")


def model_shapes(cfg):
    """The config with the shapes its run builds as model.arch: model.path's config.json when it has one (as the
    config checks read them: configs/ppo_tiny_moe.yaml model.path=assets/tiny-deepseek_v3 rehearses that model),
    else model.arch as written."""
    from omegaconf import OmegaConf

    from megappo.config.paths import hf_config_json
    from megappo.config.schema import ArchConfig
    from megappo.config.validate import arch_from_hf

    hf = hf_config_json(cfg)
    if hf is None:
        return cfg
    out = copy.deepcopy(cfg)
    out.model.arch = OmegaConf.merge(OmegaConf.structured(ArchConfig), arch_from_hf(hf))
    return out


def shard_config(cfg, device: str, gpu_gib: float):
    """The config made one GPU: model.arch is the actor's (TP, EP) rank's shard, every role TP1 x PP1 x DP1 x EP1,
    rollout TP1, one worker with `gpu_gib` of memory, and as many of the stage's layers as fit that GPU by
    `megappo plan` (fit_layers). A layout that does not divide the model is refused in one line.

    TP splits the attention heads (kv heads), the dense FFN, each expert's and the shared expert's FFN (expert TP =
    TP, as the engine builds it) and the padded vocabulary. EP keeps num_experts / ep experts with the family's
    top-k (at most the local experts): each rank's experts take T * top-k token copies of the EP group's balanced
    routing, as here; the router is over the local experts (router_params_left_out) and group-limited routing is
    dropped (the groups span ranks). Multi-latent attention: the heads' projections (q / kv up, the output) split by
    TP; the q / kv latents whole, as megatron gathers them over TP before their norms and every rank's up projection
    reads them whole, so the down projections, column-parallel on megatron's local spec, are whole here
    (mla_down_params_over_rank)."""
    from megappo.config import ConfigError
    from megappo.param_counts import moe_layers
    from megappo.parallel.model_dims import padded_vocab_size

    a, par = cfg.model.arch, cfg.actor.parallel
    experts = a.num_experts if moe_layers(a) else 0
    split = ("num_attention_heads", "num_kv_heads", "intermediate_size") + \
        (("moe_intermediate_size", "shared_expert_intermediate_size") if experts else ())
    bad = [f"{k}={a[k]}" for k in split if a[k] % par.tp]
    if bad or a.num_layers % par.pp or experts % par.ep:
        what = ", ".join(bad + ([f"num_layers={a.num_layers}"] if a.num_layers % par.pp else [])
                         + ([f"num_experts={experts}"] if experts % par.ep else []))
        raise ConfigError(f"actor.parallel tp={par.tp} pp={par.pp} ep={par.ep} does not divide the model's {what}; "
                          "pick sizes that divide them")
    out = copy.deepcopy(cfg)
    s = out.model.arch
    s.head_dim = a.head_dim or a.hidden_size // a.num_attention_heads
    for k in split:
        s[k] = a[k] // par.tp
    s.vocab_size = padded_vocab_size(a.vocab_size, par.tp) // par.tp
    if experts:
        s.num_experts = experts // par.ep
        s.num_experts_per_tok = min(a.num_experts_per_tok, s.num_experts)
    for role in ("actor", "critic", "ref"):
        p = out[role].parallel
        p.tp = p.pp = p.dp = p.ep = p.cp = 1
        p.vpp = None
    out.rollout.tp = 1
    out.resources.device, out.resources.nodes, out.resources.workers_per_node = device, 1, 1
    out.resources.gpu_memory_gb = gpu_gib
    return fit_layers(out, a.num_layers // par.pp)


def with_layers(cfg, layers: int):
    """The config with `layers` layers: its dense prefix (first_k_dense_replace, mlp_only_layers) cut to them, at
    least one routed layer kept in a MoE model."""
    out = copy.deepcopy(cfg)
    s = out.model.arch
    s.num_layers = layers
    if s.num_experts:
        s.first_k_dense_replace = min(s.first_k_dense_replace, layers - 1)
        s.mlp_only_layers = [i for i in s.mlp_only_layers if i < layers]
    return out


def fit_layers(shard, layers: int):
    """The shard with the most of its stage's `layers` for which `megappo plan` of it fits its one GPU (DeepSeek-V3's
    rank, 61 layers of 16 experts, holds ~8B parameters: with DP1's unsharded Adam states no GPU fits them all)."""
    from megappo.memory_model import plan

    for n in range(layers, 0, -1):
        out = with_layers(shard, n)
        if n == 1 or plan(out)["fits"]:
            return out


def shard_notes(cfg, shard) -> dict:
    """What the one-process shard holds otherwise than the real rank, in parameters (shard_config says why), and how
    many of the stage's layers it kept."""
    from megappo.param_counts import moe_layers, rollout_whole_params, router_params

    a, s, tp = cfg.model.arch, shard.model.arch, cfg.actor.parallel.tp
    notes = {"layers_of_stage": a.num_layers // cfg.actor.parallel.pp, "layers_rehearsed": s.num_layers}
    if moe_layers(s):
        notes["router_params_left_out"] = moe_layers(s) * (router_params(a) - router_params(s))
        notes["topk_rehearsed"] = s.num_experts_per_tok
    if s.kv_lora_rank:  # the down projections (what vLLM holds whole on every rank) are 1 / tp of them on a rank
        notes["mla_down_params_over_rank"] = rollout_whole_params(s) * (tp - 1) // tp
    return notes


def write_hf_config(cfg, out_dir: Path) -> Path:
    """config.json of the shard (no weights: the engines keep megatron's random init)."""
    from transformers import AutoConfig

    from megappo.config.validate import arch_as_hf

    hf = {k: v for k, v in arch_as_hf(cfg.model.arch).items() if v is not None}
    if cfg.model.arch.num_experts:  # one group: the shard drops group-limited routing (DeepseekV3Config's default: 8)
        hf.update(n_group=1, topk_group=1)
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
    out = {"vllm_weights_gib": round(vllm_weight_bytes / 2**30, 2), "backends": backends(actor)}

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


def backends(engine) -> dict:
    """The layer spec the engine chose (models/gpt.use_transformer_engine: TE on a GPU where it imports, never for
    multi-latent attention) and the classes its attention, routed experts and token dispatcher run, read off the
    built model (TE's DotProductAttention picks flash / fused / unfused kernels per call: not shown)."""
    found = {"layer_spec": "transformer_engine" if engine.uses_te else "local"}
    for m in (m for chunk in engine.inner_chunks() for m in chunk.modules()):
        if hasattr(m, "core_attention"):
            found.setdefault("self_attention", type(m).__name__)
            found.setdefault("core_attention", type(m.core_attention).__name__)
        if hasattr(m, "experts") and hasattr(m, "router"):
            found.setdefault("experts", type(m.experts).__name__)
            found.setdefault("token_dispatcher", type(m.token_dispatcher).__name__)
    return found


def run_one(config: str, overrides: list, args, torch) -> tuple[dict | None, str | None]:
    """One config's rehearsal: (its JSON object, None), or (None, the one-line refusal)."""
    import gc

    from megappo.config import ConfigError, load_config
    from megappo.memory_model import CUDA_CONTEXT_GB, OVERHEAD_GB, plan

    try:
        cfg = model_shapes(load_config(config, overrides))
        gpu_gib = (torch.cuda.get_device_properties(0).total_memory / 2**30 if args.device == "cuda"
                   else float(cfg.resources.gpu_memory_gb))
        shard = shard_config(cfg, args.device, gpu_gib)
    except ConfigError as e:
        return None, f"{config}: {e}"
    planned = plan(shard)
    overhead = OVERHEAD_GB + CUDA_CONTEXT_GB * planned["processes_per_gpu"]
    cuda = args.device == "cuda"
    before = round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None  # what an earlier config left
    meter = Meter(args.device)
    torch.manual_seed(int(cfg.trainer.seed))
    with tempfile.TemporaryDirectory() as d:
        ran = rehearse(cfg, shard, write_hf_config(shard, Path(d)), args.micro_batches, meter)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    phases = {}
    for name in PHASES:
        if name not in meter.phases:
            continue
        want = planned["phases_gb"].get(name)
        got = meter.phases[name]
        phases[name] = {**got, "planned_gib": None if want is None else round(want - overhead, 2)}
        if want is not None and got["reserved_peak_gib"] is not None:
            phases[name]["measured_over_planned"] = round(got["reserved_peak_gib"] / max(want - overhead, 1e-9), 3)
    keys = ("hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers",
            "vocab_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank")
    return {
        "config": " ".join([config, *overrides]), "device": args.device, "family": cfg.model.arch.family,
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "gpu_gib": round(gpu_gib, 2),
        "allocated_before_gib": before,
        "shard": {k: shard.model.arch[k] for k in keys if shard.model.arch[k] or k in keys[:7]},
        "shard_notes": shard_notes(cfg, shard), "shard_plan_fits": planned["fits"],
        "rows_per_phase": shard.actor.micro_batch_size * args.micro_batches,
        "tokens_per_row": cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        "planned_overhead_gib_left_out": round(overhead, 2), "phases": phases, "ran": ran,
        "config_plan": {k: plan(cfg)[k] for k in ("phases_gb", "peak_phase", "peak_gpu_gb", "fits")}}, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", required=True,
                   help="a config, with overrides of its own after it in the same argument "
                        "('configs/ppo_tiny_moe.yaml model.path=assets/tiny-deepseek_v3'); repeat it for several, "
                        "rehearsed one after another in this process, one JSON line each")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per forward / update phase")
    p.add_argument("overrides", nargs="*", help="config overrides for every config, key=value")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "gpu_rehearsal: --device cuda but torch sees no CUDA device; run it on the GPU machine, or "
                  "--device cpu to try the code path here\n")
    from megappo.parallel.launch import free_port
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron

    if not torch.distributed.is_initialized():  # one rank, TP1 x PP1 x DP1 x EP1, for every config
        init_distributed(0, 1, "127.0.0.1", free_port(),
                         backend="cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
        init_megatron(ParallelLayout(), seed=0)
    rc = 0
    for spec in args.config:
        config, *own = shlex.split(spec)
        out, refused = run_one(config, own + list(args.overrides), args, torch)
        if refused:
            print(f"gpu_rehearsal: {refused}", file=sys.stderr)
            rc = 2
            continue
        print(json.dumps(out), flush=True)
        rc = rc or (0 if out["ran"]["finite"] else 1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
