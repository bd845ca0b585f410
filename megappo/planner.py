"""Layout / memory planner: per-GPU memory of every role of a colocated PPO job, phase by phase.

`megappo plan --config configs/ppo_70b.yaml [--nodes N --gpus-per-node G --gpu-mem-gb M] [--json]`; `--max-len`: the
longest sample that fits the layout; `--seq-len N` plans N-token samples (with `--smallest`: the pool and cp for them)

The model (stated so it can be checked by hand):
- Parameters per GPU: the worst pipeline stage's parameters / tp (layers/pp of them, plus the
  embedding on the first stage and the output layer on the last; both vocab-parallel, vocab padded).
  Mixture of experts: a MoE layer's routed experts are split over ep (and tp: expert TP = tp), the
  router and attention over tp only; MoE layers are spread evenly over the stages. The distributed
  optimizer shards dense params over dp and expert params over the expert-data-parallel dp / ep.
  vLLM holds every expert on every rollout TP rank (TP-sliced; no vLLM expert parallel), and the
  weight sync sends every expert into every rollout GPU (merged; rollout.lora_sync=adapter: no expert, below).
- Weight sync traffic: each rollout GPU receives its own TP slice of every weight when the sync is sliced (the
  hybrid engine at rollout.tp = the actor's tp > 1, parallel/layout.sliced_sync), else every weight whole, the whole
  model's bf16 bytes into every rollout GPU (a TP8 trainer into rollout TP16, any async pool).
- Trained roles (actor, critic), megatron mixed precision with the distributed optimizer:
  weights bf16 2 B/param + fp32 grad buffer 4 B/param (full: DDP reduce-scatters into it)
  + fp32 main params and Adam m, v 12 B/param sharded over dp.  Frozen roles (ref, RM, an on-policy
  distillation teacher.model, planned with teacher.arch's shapes, else its config.json's): 2 B/param, and in
  their own phase their forward's peak (a micro-batch's logits over the R response columns, log_prob_micro_batch_size
  rows x V / tp at 10 B each, and one layer); a frozen role empties its cache after its forward on GPU
  (workers/role_batches._forward), so no other phase holds it.
- Activations (Korthikanti et al. 2022, flash attention, sequence parallel), bf16, per micro-batch:
  34*s*b*h/tp bytes per layer, plus 5*a*s^2*b/tp where attention runs unfused (multi-latent attention: megatron's
  local spec keeps each layer's s x s scores; at 32k tokens that is GBs a layer, so a long length is refused); a MoE layer's MLP (19 of the 34) is replaced by its top-k routed copies of
  each token: k*(4h + 6f) bytes per token (permuted input and fc2 output bf16, fc1's gated 2f output and the
  activation's f), f the expert FFN size. With full recompute only the layer input 2*s*b*h/tp is kept (plus
  one layer's full activations). 1F1B keeps min(pp, micro-batches) micro-batches in flight on stage 0.
  The last stage also holds the actor's logits and their fp32 log-prob temporaries: the LM head runs on the
  R response columns only (workers/megatron_step.head_on_outputs), R*b*V/tp logits at 16 B each at the
  backward's peak, 24 B with the entropy (an entropy bonus): measured with torch.profiler's memory
  events around models/logprobs.vocab_parallel_logprobs' forward and backward (bf16 logits, fp32 copy,
  exp, their grads).
- Context parallel (`<role>.parallel.cp`, parallel/context_parallel.py): a rank holds L = s*b / cp of a
  micro-batch's tokens (each row padded to 2*cp zigzag chunks, two per rank), so the per-token activations above
  are counted for L tokens; the LM head runs on the rank's own response columns (the most any rank holds).
  Attention all-gathers keys and values over the CP group: cp*L tokens of k and v per layer (the layer's kv heads /
  tp; MLA: every head's qk_nope + qk_rope key and head_dim value), bf16, kept for the backward. SDPA gets a
  boolean mask [L, cp*L] and converts it to an additive one in the query's dtype (2 B per element) that the fused
  kernel keeps for the backward, per layer; the boolean mask itself is one at a time (a micro-batch carries only
  its rows' chunk table; each attention call builds its mask from it). No unfused s x s scores: CP runs megappo's
  packed attention. Weights
  and grads are whole on every CP rank; the distributed optimizer shards over dp * cp (megatron's data-parallel
  group with context parallel), experts over dp * cp / ep.
- vLLM (rollout phase): gpu_memory_utilization * GPU memory (weights/rollout_tp + KV cache + workspace).
- Phases never overlap on a GPU: weight sync, rollout, ref/old-log-prob forward, critic update,
  actor update. A role with `offload: true` is resident only in its own phase (its memory goes back
  to the device: workers/offload.py empties PyTorch's cache); otherwise it stays resident, and its
  process keeps its activation peak reserved in PyTorch's caching allocator after its phase. vLLM
  sleeps (KV cache freed; weights discarded with rollout.sleep_level 2, kept in pinned host memory
  with 1) outside rollout when rollout.free_cache_engine is true.
- Weight sync (the hybrid engine's enter): vLLM's weights are awake, its KV cache not yet; the
  actor's weights only are resident (an offloaded actor brings back neither grads nor optimizer
  states for it), plus the resharder's buffers (about 2 x rollout.weight_sync_bucket_mb).
- LoRA (`actor.lora.rank > 0`, models/lora.py): the actor's base weights are frozen (bf16 2 B/param, no grad
  buffer, no optimizer state); its adapters (A [r, in], B [out, r] on every targeted linear_qkv /
  linear_proj / linear_fc1 / linear_fc2 of the stage; each local routed expert's fc1 / fc2 too with
  lora.experts, their Adam sharded over expert data parallel) take weights + grads
  + Adam as a trained role's params (column-parallel base: A replicated, B split over tp; row-parallel:
  A split, B replicated). No reference copy: the reference is the base with the adapters off.
  Activations as full fine-tuning (the adapters' r-wide ones are negligible). rollout.lora_sync=adapter:
  the weight sync is the whole adapter in peft's layout, bf16, into each rollout GPU (adapter_sync_params);
  vLLM keeps the base it loaded.
- Overhead per GPU: 3 GB (NCCL buffers, fragmentation) + a CUDA context of 0.6 GB per process on the
  GPU (one per worker group sharing the pool: actor/rollout/ref fused, critic, reward model, teacher).
- Host memory (pinned, per node): an offloaded role's weights and optimizer states (main params +
  Adam; its grad buffer is dropped, not copied), vLLM's sleeping weights with sleep_level 1, and on GPU
  a checkpoint save's snapshot: megatron's preload copies the actor's and critic's weights + optimizer
  states device-to-host into pinned memory (parallel/dist_checkpoint._snapshot), which torch's host
  allocator keeps cached for the next save. Pinned blocks are allocated at their size, not rounded up to
  a power of two (up to 2x): GPU workers start with pinned_max_round_threshold_mb set (parallel/device.py).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from megappo.config import ConfigError, load_config
from megappo.config.schema import ArchConfig, MegappoConfig
from megappo.parallel.context_parallel import chunk_size
from megappo.parallel.layout import same_layout, sliced_sync
from megappo.param_counts import (adapter_sync_params, kv_cache_bytes_per_token, lora_params, lora_rank, moe_layers,
                                  rollout_whole_params, shared_expert_params, stage_split, total_params)
from megappo.parallel.weight_mapping import MOE_FAMILIES, padded_vocab_size
from megappo.config.validate import arch_from_hf, max_positions, validate_config

GB = 1024**3  # "GB" in this module is GiB, as the GPU reports its memory (resources.gpu_memory_gb)
# a layout fits only with this share of the GPU left free: allocator fragmentation, NCCL's buffers past the
# estimate, kernels' workspaces; the plan is an estimate, not a measurement
HEADROOM = 0.05
OVERHEAD_GB = 3.0
CUDA_CONTEXT_GB = 0.6
ROLES = ("actor", "critic", "ref")
FROZEN = ("ref", "teacher")  # weights only outside their forward (workers/role_batches._forward: frozen)


LOGIT_BYTES = 16  # per logit at the actor update's peak (module docstring); +8 with the entropy
FORWARD_LOGIT_BYTES = 10  # per logit of a frozen forward: bf16 logits, their fp32 copy and log-softmax


def unfused_attention_bytes(a, s: int, b: int, tp: int, packed: bool = False) -> int:
    """One layer's s x s attention scores where no fused kernel runs: multi-latent attention on megatron's local
    spec (TE's MLA is not mapped), Korthikanti et al.'s 5 a s^2 b bytes (the scores, the softmax, its dropout mask)
    over the layer's heads / tp. Flash attention holds none of it, nor does megappo's packed / CP attention (`packed`:
    pack_sequences or cp > 1, models/packed_attention.py: one SDPA call)."""
    return 5 * (a.num_attention_heads // tp) * s * s * b if a.kv_lora_rank and not packed else 0


def local_tokens(s: int, b: int, par) -> int:
    """The tokens of one micro-batch (b rows of s) on one rank of its CP group: each row padded to 2*cp chunks, 2 of
    them per rank (parallel/context_parallel.chunk_size), the sum rounded up to tp (sequence parallel); s*b at cp 1."""
    if par.cp == 1:
        return s * b
    return -(-b * 2 * chunk_size(s, par.cp) // par.tp) * par.tp


def response_columns(prompt: int, response: int, cp: int) -> int:
    """The most response columns one CP rank holds of a row (rank r: chunks r and 2*cp-1-r of the zigzag split;
    its LM head runs on those, megatron_step.cp_local): the response at cp 1."""
    c = chunk_size(prompt + response, cp)
    return max(sum(max(0, min((k + 1) * c, prompt + response) - max(k * c, prompt)) for k in (r, 2 * cp - 1 - r))
               for r in range(cp))


def cp_attention_terms(a, s: int, b: int, par) -> tuple[int, int, int]:
    """Context parallel's attention memory on one rank (0s at cp 1; parallel/context_parallel.cp_attention), bytes:
    - per layer, the keys and values all-gathered over the CP group, cp*L tokens x (k + v) widths of the layer's
      heads / tp in bf16 (MLA: every head's qk_nope + qk_rope key and head_dim value), kept for the backward;
    - per layer, SDPA's additive mask: torch converts the bool mask into one of the query's dtype (2 B per element,
      L x cp*L; convert_boolean_attn_mask) and the fused kernel keeps it for the backward;
    - the bool mask itself, L x cp*L bytes, one at a time: a micro-batch carries only its rows' chunk table, and each
      attention call builds its mask from it (context_parallel.table_mask).
    Returns (K/V per layer, additive mask per layer, the bool mask)."""
    if par.cp == 1:
        return 0, 0, 0
    L = local_tokens(s, b, par)
    if a.kv_lora_rank:
        width = a.num_attention_heads // par.tp * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.head_dim)
    else:
        width = 2 * a.num_kv_heads // par.tp * (a.head_dim or a.hidden_size // a.num_attention_heads)
    return 2 * par.cp * L * width, 2 * L * par.cp * L, L * par.cp * L


def per_token_bytes(a) -> int:
    """One layer's activations per token, whole (Korthikanti et al.'s 34 h; a MoE layer's routed MLP instead of a
    dense one's, the larger of the two layers); a rank holds them / tp (sequence parallel) for its local tokens."""
    per_token = 34 * a.hidden_size
    if moe_layers(a):  # the routed MLP's activations instead of a dense one's (the larger of the two layers)
        h, k, f = a.hidden_size, a.num_experts_per_tok, getattr(a, MOE_FAMILIES[a.family].ffn_key)
        fs = a.shared_expert_intermediate_size if shared_expert_params(a)[0] else 0  # one more FFN per token
        per_token = max(per_token, 15 * h + k * (4 * h + 6 * f) + (4 * h + 6 * fs if fs else 0))
    return per_token


def activation_terms(cfg, role_cfg, par, lm_head: bool) -> dict:
    """The actor's / critic's activation bytes per rank, term by term (they sum to activation_bytes)."""
    a = cfg.model.arch
    s = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    b = role_cfg.micro_batch_size
    h = a.hidden_size
    layers = a.num_layers // par.pp
    L = local_tokens(s, b, par)
    packed = role_cfg.pack_sequences or par.cp > 1
    micro_batches = max(1, role_cfg.ppo_mini_batch_size // (par.dp * b))
    kv, bias, masks = cp_attention_terms(a, s, b, par)
    full_layer = per_token_bytes(a) * L // par.tp + unfused_attention_bytes(a, s, b, par.tp, packed) + kv + bias
    per_mb = (layers * 2 * L * h // par.tp + full_layer) if role_cfg.recompute_activations else layers * full_layer
    in_flight = min(par.pp, micro_batches)
    per_logit = LOGIT_BYTES + (8 if getattr(role_cfg, "entropy_coeff", 0) else 0)
    columns = response_columns(cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, par.cp)
    logits = columns * b * padded_vocab_size(a.vocab_size, par.tp) // par.tp * per_logit if lm_head else 0
    return {"layers": per_mb * in_flight, "cp_masks": masks, "logits": logits, "tokens_per_gpu": L,
            "bytes_per_token": per_token_bytes(a) // par.tp, "cp_kv_per_layer": kv, "cp_bias_per_layer": bias}


def activation_bytes(cfg, role_cfg, par, lm_head: bool) -> int:
    t = activation_terms(cfg, role_cfg, par, lm_head)
    return t["layers"] + t["cp_masks"] + t["logits"]


def forward_bytes(cfg, shapes, role_cfg, par) -> int:
    """A frozen role's forward peak (no activations kept for a backward): one micro-batch's logits over the response
    columns (log_prob_micro_batch_size rows), one layer's activations, and the unfused attention's scores; at cp > 1
    one layer's gathered K/V, additive mask and bool mask."""
    a = shapes.model.arch
    P, R = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    s = P + R
    b = role_cfg.log_prob_micro_batch_size
    packed = getattr(role_cfg, "pack_sequences", False) or par.cp > 1
    layer = 34 * a.hidden_size * local_tokens(s, b, par) // par.tp + unfused_attention_bytes(a, s, b, par.tp, packed) \
        + sum(cp_attention_terms(a, s, b, par))
    logits = response_columns(P, R, par.cp) * b * padded_vocab_size(a.vocab_size, par.tp) // par.tp \
        * FORWARD_LOGIT_BYTES
    return layer + logits


@dataclass
class RoleMemory:
    params_per_gpu: int
    expert_params_per_gpu: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    terms: dict | None = None  # a trained role's activation_terms

    @property
    def resident_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb


def role_memory(cfg, role: str) -> RoleMemory:
    rcfg = cfg[role]
    par = rcfg.parallel
    shapes = teacher_shapes(cfg) if role == "teacher" else cfg
    dense, experts = stage_split(shapes, par.tp, par.pp, par.ep, "value" if role == "critic" else "lm")
    n = dense + experts
    if role in ("ref", "teacher"):  # frozen: weights, and its forward's peak in its own phase (freed after it)
        return RoleMemory(n, experts, 2 * n / GB, 0.0, 0.0, forward_bytes(cfg, shapes, rcfg, par) / GB)
    if role == "actor" and lora_rank(cfg):  # frozen base + adapters (trained; Adam sharded as their base's)
        k, k_exp = lora_params(cfg.model.arch, cfg.actor.lora, par.tp, par.pp, par.ep)
        k_all = k + k_exp
        return RoleMemory(n + k_all, experts, 2 * (n + k_all) / GB, 4 * k_all / GB,
                          12 * (k / (par.dp * par.cp) + k_exp / (par.dp * par.cp // par.ep)) / GB,
                          activation_bytes(cfg, rcfg, par, lm_head=True) / GB,
                          activation_terms(cfg, rcfg, par, lm_head=True))
    # the distributed optimizer shards dense params over dp * cp (megatron's data-parallel group with context
    # parallel), expert params over dp * cp / ep (expert data parallel); weights and grads are whole on each CP rank
    optimizer = 12 * (dense / (par.dp * par.cp) + experts / (par.dp * par.cp // par.ep))
    return RoleMemory(n, experts, 2 * n / GB, 4 * n / GB, optimizer / GB,
                      activation_bytes(cfg, rcfg, par, lm_head=(role == "actor")) / GB,
                      activation_terms(cfg, rcfg, par, lm_head=(role == "actor")))


def teacher_shapes(cfg):
    """The config with the teacher's shapes as model.arch: teacher.arch, else teacher.model's config.json (a config
    planned without the teacher's dir at hand and no teacher.arch is refused: the student's shapes would be a
    guess)."""
    c = copy.deepcopy(cfg)
    if cfg.teacher.arch is not None:
        c.model.arch = cfg.teacher.arch
        return c
    hf = Path(cfg.teacher.model) / "config.json"
    if not hf.is_file():
        raise ConfigError(f"teacher.model {cfg.teacher.model} has no config.json to plan it from; set teacher.arch "
                          "(its shapes, as model.arch) or point teacher.model at the teacher's HF dir")
    c.model.arch = OmegaConf.merge(OmegaConf.structured(ArchConfig), arch_from_hf(json.loads(hf.read_text())))
    return c


def planned_roles(cfg) -> list[str]:
    """The Megatron models the run builds: the actor, the critic and reference when enabled (with LoRA the
    reference is the actor's base with the adapters off: no model), an on-policy distillation teacher.model."""
    return [r for r in ROLES if r == "actor" or cfg[r].enable and not (r == "ref" and lora_rank(cfg))] + \
        (["teacher"] if cfg.teacher.model and not cfg.resources.teacher_workers else [])


def teacher_pool(cfg) -> dict | None:
    """resources.teacher_workers: the teacher alone on its GPUs (its weights, the overhead, one CUDA context)."""
    if not (cfg.teacher.model and cfg.resources.teacher_workers):
        return None
    m = role_memory(cfg, "teacher")
    peak = m.weights_gb + m.activations_gb + OVERHEAD_GB + CUDA_CONTEXT_GB
    return {"gpus": cfg.resources.teacher_workers, "layout": _layout_str(cfg.teacher.parallel),
            "params_per_gpu_m": round(m.params_per_gpu / 1e6, 1), "weights_gb": round(m.weights_gb, 2),
            "peak_gpu_gb": round(peak, 2), "fits": peak <= (1 - HEADROOM) * cfg.resources.gpu_memory_gb}


def plan(cfg) -> dict:
    """The per-GPU memory of each phase, the peak, and the weight-sync volume."""
    gpu_gb = cfg.resources.gpu_memory_gb
    roles = {r: role_memory(cfg, r) for r in planned_roles(cfg)}
    offload = {r: bool(cfg[r].offload) for r in roles}
    vllm_gb = cfg.rollout.gpu_memory_utilization * gpu_gb
    tp = cfg.rollout.tp
    vllm_weights_gb = 2 * (total_params(cfg) + (tp - 1) * rollout_whole_params(cfg.model.arch)) / tp / GB

    def resident(active: str | None) -> float:
        """What the other roles hold on the GPU: weights + grads + optimizer, and the activation peak their allocator
        keeps cached (an offloaded role: nothing; a frozen role empties its cache after its forward: its weights)."""
        return sum(m.resident_gb + (0.0 if r in FROZEN else m.activations_gb) for r, m in roles.items()
                   if r != active and not offload[r])

    def sleeping_vllm() -> float:
        return 0.0 if cfg.rollout.free_cache_engine else vllm_gb

    a = roles["actor"]
    bucket_gb = 2 * cfg.rollout.weight_sync_bucket_mb / 1024
    actor_for_sync = a.weights_gb if offload["actor"] else a.resident_gb + a.activations_gb
    phases = {"weight_sync": resident("actor") + actor_for_sync + vllm_weights_gb + bucket_gb,
              "rollout": resident(None) + vllm_gb}
    for frozen in FROZEN:
        if frozen in roles:
            m = roles[frozen]
            phases[f"{frozen}_log_prob"] = resident(frozen) + m.weights_gb + m.activations_gb + sleeping_vllm()
    if "critic" in roles:
        c = roles["critic"]
        phases["critic_update"] = resident("critic") + c.resident_gb + c.activations_gb + sleeping_vllm()
    phases["actor_update"] = resident("actor") + a.resident_gb + a.activations_gb + sleeping_vllm()
    processes = 1 + sum(1 for r in ("critic", "teacher") if r in roles) + int(bool(cfg.reward.model.enable)) + \
        int("ref" in roles and not same_layout(cfg.ref.parallel, cfg.actor.parallel))
    overhead = OVERHEAD_GB + CUDA_CONTEXT_GB * processes
    phases = {k: v + overhead for k, v in phases.items()}
    peak_phase = max(phases, key=phases.get)
    host_gb = sum(m.weights_gb + m.optimizer_gb for r, m in roles.items() if offload[r])
    vllm_host_gb = vllm_weights_gb if cfg.rollout.free_cache_engine and cfg.rollout.sleep_level == 1 else 0.0
    # every run may save (save_every, the final checkpoint for export, a preemption's): count the snapshot on GPU
    saves = cfg.resources.device != "cpu"
    save_gb = sum(m.weights_gb + m.optimizer_gb for r, m in roles.items() if r in ("actor", "critic")) if saves else 0.0
    adapter_sync = bool(lora_rank(cfg)) and cfg.rollout.lora_sync == "adapter"  # vLLM keeps its base: adapters only
    # merged weights: each rollout GPU's own TP slice when the sync is sliced (the hybrid engine at the trainer's TP),
    # else every weight whole (gathered over the trainer's TP, EP-broadcast; the async modes' broadcast from rank 0)
    sliced = cfg.trainer.mode == "sync" and sliced_sync(cfg.actor.parallel.tp, cfg.rollout.tp)
    sync_bytes_per_gpu = 2 * adapter_sync_params(cfg.model.arch, cfg.actor.lora) if adapter_sync else \
        vllm_weights_gb * GB if sliced else 2 * total_params(cfg)
    replicas = cfg.resources.nodes * cfg.resources.workers_per_node // cfg.rollout.tp
    # what the KV cache left beside the weights holds (workspace: this module's overhead), and one engine's
    # share of the step's samples, each at its longest (reported; vLLM queues what does not fit)
    own_teacher = teacher_pool(cfg)
    kv_tokens = int(max(0.0, vllm_gb - vllm_weights_gb) * GB // kv_cache_bytes_per_token(cfg))
    kv_needed = -(-cfg.data.train_batch_size * cfg.rollout.n // replicas) * (cfg.data.max_prompt_length
                                                                            + cfg.rollout.max_new_tokens)
    return {
        "layout": {r: _layout_str(cfg[r].parallel) for r in roles} | {"rollout": f"TP{cfg.rollout.tp}"},
        "gpus": cfg.resources.nodes * cfg.resources.workers_per_node,
        "gpu_mem_gb": gpu_gb,
        "sample_tokens": cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        "total_params_b": round(total_params(cfg) / 1e9, 3),
        "roles": {r: {"params_per_gpu_m": round(m.params_per_gpu / 1e6, 1),
                      "expert_params_per_gpu_m": round(m.expert_params_per_gpu / 1e6, 1),
                      "weights_gb": round(m.weights_gb, 2),
                      "grads_gb": round(m.grads_gb, 2), "optimizer_gb": round(m.optimizer_gb, 2),
                      "activations_gb": round(m.activations_gb, 2), "offload": offload[r],
                      "freed_by_offload_gb": round(m.resident_gb + m.activations_gb, 2)}
                  | ({"tokens_per_gpu": m.terms["tokens_per_gpu"],
                      "activation_bytes_per_token": m.terms["bytes_per_token"],
                      "cp_kv_gb_per_layer": round(m.terms["cp_kv_per_layer"] / GB, 3),
                      "cp_mask_gb_per_layer": round(m.terms["cp_bias_per_layer"] / GB, 3),
                      "cp_masks_gb": round(m.terms["cp_masks"] / GB, 2)} if m.terms else {})
                  for r, m in roles.items()}
        | {"rollout": {"vllm_gb": round(vllm_gb, 2), "weights_gb": round(vllm_weights_gb, 2),
                       "kv_cache_and_workspace_gb": round(vllm_gb - vllm_weights_gb, 2),
                       "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg),
                       "kv_cache_tokens": kv_tokens,
                       "kv_cache_tokens_needed": kv_needed,
                       "sleeps_outside_rollout": bool(cfg.rollout.free_cache_engine)}},
        "phases_gb": {k: round(v, 2) for k, v in phases.items()},
        "peak_phase": peak_phase,
        "peak_gpu_gb": round(phases[peak_phase], 2),
        "usable_gpu_gb": round((1 - HEADROOM) * gpu_gb, 2),
        "fits": phases[peak_phase] <= (1 - HEADROOM) * gpu_gb and vllm_gb > vllm_weights_gb and
        (own_teacher is None or own_teacher["fits"]),
        "teacher_pool": own_teacher,
        "processes_per_gpu": processes,
        "host_offload_gb_per_gpu": round(host_gb, 2),
        "host_offload_gb_per_node": round(host_gb * cfg.resources.workers_per_node, 1),
        "host_vllm_sleep_gb_per_gpu": round(vllm_host_gb, 2),
        "host_save_snapshot_gb_per_gpu": round(save_gb, 2),
        "host_gb_per_node": round((host_gb + vllm_host_gb + save_gb) * cfg.resources.workers_per_node, 1),
        "weight_sync": {"sends": "adapters" if adapter_sync else "weights", "sliced": sliced and not adapter_sync,
                        "bytes_per_gpu": int(sync_bytes_per_gpu), "replicas": replicas,
                        "bytes_total": int(sync_bytes_per_gpu * cfg.rollout.tp * replicas),
                        # MoE, merged: every expert reaches every rollout TP rank (TP-sliced), from its EP rank
                        "experts_per_rollout_gpu": 0 if adapter_sync else cfg.model.arch.num_experts * moe_layers(cfg.model.arch)},
    }


def _layout_str(par) -> str:
    v = f"xVPP{par.vpp}" if par.vpp else ""
    e = f"xEP{par.ep}" if par.ep > 1 else ""
    c = f"xCP{par.cp}" if getattr(par, "cp", 1) > 1 else ""
    return f"TP{par.tp}{c}xPP{par.pp}{v}xDP{par.dp}{e}"


def with_pool(cfg, nodes: int | None, gpus_per_node: int | None, gpu_mem_gb: float | None):
    """Apply --nodes/--gpus-per-node/--gpu-mem-gb, refilling each role's dp to the new pool."""
    cfg = copy.deepcopy(cfg)
    if nodes:
        cfg.resources.nodes = nodes
    if gpus_per_node:
        cfg.resources.workers_per_node = gpus_per_node
    if gpu_mem_gb:
        cfg.resources.gpu_memory_gb = gpu_mem_gb
    world = cfg.resources.nodes * cfg.resources.workers_per_node
    for r in ROLES + (("teacher",) if cfg.teacher.model and not cfg.resources.teacher_workers else ()):
        par = cfg[r].parallel
        if world % (par.tp * par.cp * par.pp):
            what = ("tp*cp*pp", "tp/cp/pp") if par.cp > 1 else ("tp*pp", "tp/pp")
            raise ConfigError(f"{r}.parallel {what[0]} = {par.tp * par.cp * par.pp} does not divide the {world} GPUs; "
                              f"change {what[1]} or the node count")
        par.dp = world // (par.tp * par.cp * par.pp)
    return cfg


def _with_cp(cfg, cp: int):
    """cfg with every trained / frozen role (the pool's) at context parallel `cp`, dp refilling the pool."""
    cfg = copy.deepcopy(cfg)
    for r in ROLES:
        cfg[r].parallel.cp = cp
    return with_pool(cfg, None, None, None)


def larger_cps(cfg) -> tuple[int, ...]:
    """The actor's cp, then its doublings that divide the pool (context parallel for a longer sample)."""
    world = cfg.resources.nodes * cfg.resources.workers_per_node
    cp = cfg.actor.parallel.cp
    return tuple(cp * 2**k for k in range(8) if world % (cp * 2**k) == 0)


def suggest(cfg, cps: tuple[int, ...] | None = None) -> dict | None:
    """The nearest layout (fewest doublings/halvings of tp and pp, offload tried last) that fits, at the config's cp,
    else at each of `cps` in turn (default larger_cps: fewer tokens and a smaller CP mask per rank; dp * cp, which
    shards the optimizer, stays world / (tp * pp))."""
    world = cfg.resources.nodes * cfg.resources.workers_per_node
    a = cfg.model.arch
    tps = [t for t in (1, 2, 4, 8) if t <= cfg.resources.workers_per_node
           and a.num_attention_heads % t == 0 and a.num_kv_heads % t == 0]
    pps = [p for p in range(1, a.num_layers + 1) if a.num_layers % p == 0 and world % p == 0 and p <= 16]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if not a.num_experts and e == 1
           or a.num_experts and a.num_experts % e == 0 and e <= world]
    p0 = cfg.actor.parallel
    for cp in (larger_cps(cfg) if cps is None else cps):
        candidates = []
        for tp, pp, ep, off in itertools.product(tps, pps, eps, (False, True)):
            if world % (tp * cp * pp) or (world // (tp * pp)) % ep:  # validate_config has the ep rule
                continue
            cost = abs(math.log2(tp / p0.tp)) + abs(math.log2(pp / p0.pp)) + abs(math.log2(ep / p0.ep)) + \
                (4 if off else 0)
            candidates.append((cost, tp, pp, ep, off))
        for _, tp, pp, ep, off in sorted(candidates):
            c = OmegaConf.create(OmegaConf.to_container(cfg))
            dp = world // (tp * cp * pp)
            for r in ROLES:
                c[r].parallel.tp, c[r].parallel.pp, c[r].parallel.vpp, c[r].parallel.ep = tp, pp, None, ep
                c[r].parallel.cp, c[r].parallel.dp = cp, dp
                c[r].offload = off or bool(cfg[r].offload)
            try:
                validate_config(OmegaConf.merge(OmegaConf.structured(MegappoConfig), c))
            except ConfigError:
                continue
            result = plan(c)
            if result["fits"]:
                return {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "offload": off or None,
                        "peak_gpu_gb": result["peak_gpu_gb"]} | ({"cp": cp} if cp > 1 else {})
    return None


def smallest(cfg, max_nodes: int = 64, cps: tuple[int, ...] | None = None) -> dict | None:
    """The fewest nodes (of resources.workers_per_node GPUs) on which the config's layout, refilled with dp,
    or else suggest()'s nearest layout fits: {"nodes", "gpus", "tp", "pp", "dp", "ep", "offload", "peak_gpu_gb"}
    (and "cp" where > 1). `cps` (a long sample's search, --smallest --seq-len: the context-parallel sizes to try):
    the config's tp / pp / ep at the first of them that fits, on the fewest nodes; only where that fits on no pool,
    suggest()'s search at each of them. None: the config's cp only."""
    cp0 = cfg.actor.parallel.cp

    def own_layout(nodes: int, cp: int):
        at = copy.deepcopy(cfg)
        at.resources.nodes = nodes
        try:
            c = with_pool(at, None, None, None) if cp == cp0 else _with_cp(at, cp)
            validate_config(c)
        except ConfigError:
            return at, None
        result = plan(c)
        if not result["fits"]:
            return c, None
        p = c.actor.parallel
        return c, {"nodes": nodes, "gpus": nodes * cfg.resources.workers_per_node, "tp": p.tp, "pp": p.pp,
                   "dp": p.dp, "ep": p.ep, "offload": bool(c.actor.offload) or None,
                   "peak_gpu_gb": result["peak_gpu_gb"]} | ({"cp": cp} if cp > 1 else {})

    if cps:
        for nodes, cp in itertools.product(range(1, max_nodes + 1), cps):
            found = own_layout(nodes, cp)[1]
            if found:
                return found
    for nodes in range(1, max_nodes + 1):
        c, found = own_layout(nodes, cp0)
        if not found:
            world = nodes * cfg.resources.workers_per_node
            found = suggest(c, tuple(cp for cp in (cps or (cp0,)) if world % cp == 0))
            if found:
                found = {"nodes": nodes, "gpus": world, **found}
        if found:
            return found
    return None


def with_length(cfg, tokens: int, one_row: bool = False):
    """cfg with samples of `tokens` (prompt + response: the prompt as configured, the response the rest); `one_row`:
    one row per micro-batch in every Megatron role (a long sample's packing)."""
    cfg = copy.deepcopy(cfg)
    cfg.rollout.max_new_tokens = tokens - cfg.data.max_prompt_length
    if one_row:
        for r in ("actor", "critic"):
            cfg[r].micro_batch_size = 1
        for r in ("actor", "ref", "teacher"):
            if "log_prob_micro_batch_size" in cfg[r]:
                cfg[r].log_prob_micro_batch_size = 1
    return cfg


def max_len(cfg) -> dict:
    """The longest sample (prompt + response tokens, one row per micro-batch) that fits the GPU at the config's
    layout: a binary search over the response length with plan() (the memory grows with it), up to the model's
    positions. {"tokens", "prompt", "response", "peak_gpu_gb", "peak_phase", "bound": memory | positions, "layout"}
    ({"tokens": 0, ...} where even a one-token response does not fit)."""
    lo, hi = cfg.data.max_prompt_length, max_positions(cfg)  # plan(lo) "fits" by convention; lo + 1 is the shortest
    if not plan(with_length(cfg, lo + 1, True))["fits"]:
        lo = 0
    elif plan(with_length(cfg, hi, True))["fits"]:
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if plan(with_length(cfg, mid, True))["fits"] else (lo, mid)
    best = plan(with_length(cfg, max(lo, cfg.data.max_prompt_length + 1), True))
    return {"tokens": lo, "prompt": cfg.data.max_prompt_length, "response": max(0, lo - cfg.data.max_prompt_length),
            "peak_gpu_gb": best["peak_gpu_gb"], "peak_phase": best["peak_phase"],
            "bound": "positions" if lo == max_positions(cfg) else "memory", "layout": best["layout"]["actor"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, help="override resources.nodes (dp refills the pool)")
    parser.add_argument("--gpus-per-node", type=int, help="override resources.workers_per_node")
    parser.add_argument("--gpu-mem-gb", type=float, help="override resources.gpu_memory_gb")
    parser.add_argument("--host-mem-gb", type=float, help="host RAM per node: refuse when the pinned host copies "
                        "(offloaded roles, vLLM's sleeping weights with sleep_level 1) would not fit in 90%% of it "
                        "(the sbatch passes the job's memory limit per node)")
    parser.add_argument("--smallest", action="store_true", help="print the fewest nodes (and the layout) on which "
                        "the config fits, instead of planning its own pool")
    parser.add_argument("--seq-len", type=int, help="plan samples of this many tokens (prompt + response: the "
                        "response is the rest after data.max_prompt_length); with --smallest, the context parallel "
                        "size (powers of two) is chosen too, so that the sample fits")
    parser.add_argument("--max-len", action="store_true", help="print the longest sample (prompt + response "
                        "tokens, one row per micro-batch) that fits the GPU at the config's layout")
    parser.add_argument("--json", action="store_true", help="print one JSON object (peak_gpu_gb, per-role breakdown)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.parallel.tp=4")


def main(args: argparse.Namespace) -> int:
    seq_len = getattr(args, "seq_len", None)
    try:
        if getattr(args, "max_len", False) and (getattr(args, "smallest", False) or seq_len):
            raise ConfigError("--max-len finds the length at the config's layout: drop --smallest / --seq-len "
                              "(--smallest --seq-len N finds the pool and cp for N tokens)")
        cfg = load_config(args.config, args.overrides, validate=False)
        cfg = with_pool(cfg, args.nodes, args.gpus_per_node or None, args.gpu_mem_gb)
        if seq_len is not None:
            prompt, positions = cfg.data.max_prompt_length, max_positions(cfg)
            if not prompt < seq_len <= positions:
                raise ConfigError(f"--seq-len {seq_len} must be above data.max_prompt_length={prompt} (the prompt) "
                                  f"and at most the model's {positions} positions; pick a length in between")
            cfg = with_length(cfg, seq_len)
        validate_config(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    if getattr(args, "max_len", False):
        return _print_max_len(cfg, args.json)
    if getattr(args, "smallest", False):
        found = smallest(cfg, cps=tuple(cfg.actor.parallel.cp * 2**k for k in range(8)) if seq_len else None)
        print(json.dumps(found) if args.json or not found else
              f"smallest pool: {found['nodes']} node(s) x {cfg.resources.workers_per_node} GPUs, actor "
              f"{_found_layout(found)}" + (" offloaded" if found["offload"] else "") +
              f", peak {found['peak_gpu_gb']:.1f} GB" + (f" at {seq_len:,} tokens" if seq_len else ""))
        if not found and seq_len:
            m = max_len(cfg)
            print(f"no pool of up to 64 nodes fits a {seq_len:,}-token sample; at the config's layout "
                  f"({m['layout']}) the longest that fits is {m['tokens']:,} tokens; raise actor.parallel.cp or tp "
                  "(or the GPU memory), or shorten the sample", file=sys.stderr)
        return 0 if found else 1
    result = plan(cfg)
    if not result["fits"]:
        result["suggestion"] = suggest(cfg)
    host_msg = None
    host = getattr(args, "host_mem_gb", None)
    if host:
        result["host_mem_gb"] = host
        result["host_fits"] = result["host_gb_per_node"] <= 0.9 * host
        if not result["host_fits"]:
            host_msg = (f"offloaded roles, vLLM's sleeping weights and a checkpoint's snapshot need "
                        f"{result['host_gb_per_node']:.0f} GB of "
                        f"pinned host memory per node but the node has {host:.0f} GB (90% usable); offload fewer "
                        f"roles, set rollout.sleep_level=2, or add nodes (more dp shards the optimizer states)")
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    if not result["fits"]:
        print(refusal(result), file=sys.stderr)
        return 1
    if host_msg:
        print(host_msg, file=sys.stderr)
        return 1
    return 0


def _found_layout(found: dict) -> str:
    return _layout_str(argparse.Namespace(tp=found["tp"], cp=found.get("cp", 1), pp=found["pp"], vpp=None,
                                          dp=found["dp"], ep=found["ep"]))


def _print_max_len(cfg, as_json: bool) -> int:
    m = max_len(cfg)
    if as_json:
        print(json.dumps(m))
    if not m["tokens"]:
        print(f"not even a {cfg.data.max_prompt_length + 1}-token sample fits at {m['layout']} (the prompt is "
              f"data.max_prompt_length={cfg.data.max_prompt_length}); raise actor.parallel.cp or tp, or add nodes "
              "(more dp shards the optimizer states)", file=sys.stderr)
        return 1
    if not as_json:
        bound = "the model's positions bound it" if m["bound"] == "positions" else "bound by GPU memory"
        print(f"longest sample at {m['layout']}: {m['tokens']:,} tokens (prompt {m['prompt']:,} + response "
              f"{m['response']:,}, one row per micro-batch), peak {m['peak_gpu_gb']:.1f} GB ({m['peak_phase']}); "
              f"{bound}")
    return 0


def refusal(result: dict) -> str:
    t = result.get("teacher_pool")
    if t and not t["fits"] and result["peak_gpu_gb"] <= result["usable_gpu_gb"]:
        return (f"the teacher does not fit its pool: {t['peak_gpu_gb']:.1f} GiB per GPU at {t['layout']} but "
                f"{result['usable_gpu_gb']:g} GiB are usable; raise teacher.parallel.tp or pp (and "
                "resources.teacher_workers)")
    phase = result["peak_phase"]
    msg = (f"layout does not fit: the {phase} phase needs {result['peak_gpu_gb']:.1f} GiB per GPU but the GPU has "
           f"{result['gpu_mem_gb']:g} GiB, {result['usable_gpu_gb']:g} of them usable ({HEADROOM:.0%} kept free)")
    vllm = result["roles"]["rollout"]
    if vllm["vllm_gb"] <= vllm["weights_gb"]:
        msg += "; vLLM's share is smaller than its weights (raise rollout.tp or rollout.gpu_memory_utilization)"
    s = result.get("suggestion")
    if s:
        off = " with actor/critic/ref offload=true" if s["offload"] else ""
        ep = f" ep={s['ep']}" if s.get("ep", 1) > 1 else ""
        cp = f" cp={s['cp']}" if s.get("cp", 1) > 1 else ""
        msg += (f"; nearest layout that fits: tp={s['tp']}{cp} pp={s['pp']} dp={s['dp']}{ep}{off} "
                f"({s['peak_gpu_gb']:.1f} GB)")
    else:
        msg += "; no layout of this pool fits: add nodes"
    return msg


def render(result: dict) -> str:
    lines = [f"{result['total_params_b']}B params on {result['gpus']} GPUs x {result['gpu_mem_gb']:g} GiB; "
             f"layouts: " + ", ".join(f"{k} {v}" for k, v in result["layout"].items())]
    lines.append(f"{'role':8} {'params/GPU':>11} {'experts':>9} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8}"
                 "  offload")
    for r, m in result["roles"].items():
        if r == "rollout":
            continue
        lines.append(f"{r:8} {m['params_per_gpu_m']:>10.1f}M {m['expert_params_per_gpu_m']:>8.1f}M "
                     f"{m['weights_gb']:>7.2f}G {m['grads_gb']:>7.2f}G "
                     f"{m['optimizer_gb']:>7.2f}G {m['activations_gb']:>7.2f}G  {m['offload']}"
                     f" (frees {m['freed_by_offload_gb']:.1f}G)")
    v = result["roles"]["rollout"]
    lines.append(f"vLLM     {v['vllm_gb']:.2f}G (weights {v['weights_gb']:.2f}G + KV/workspace "
                 f"{v['kv_cache_and_workspace_gb']:.2f}G), sleeps outside rollout: {v['sleeps_outside_rollout']}")
    lines.append(f"vLLM KV cache: {v['kv_cache_bytes_per_token'] / 1024:.1f} KiB per token per GPU, room for "
                 f"{v['kv_cache_tokens']:,} tokens; a step's samples need {v['kv_cache_tokens_needed']:,} per engine"
                 + ("" if v["kv_cache_tokens"] >= v["kv_cache_tokens_needed"] else " (vLLM queues the rest)"))
    for r, m in result["roles"].items():
        if m.get("cp_kv_gb_per_layer") or m.get("cp_mask_gb_per_layer"):
            lines.append(f"{r} context parallel: {m['tokens_per_gpu']:,} of the {result['sample_tokens']:,}-token "
                         f"sample's tokens per GPU at {m['activation_bytes_per_token']:,} B per token per layer; "
                         f"per layer gathered K/V {m['cp_kv_gb_per_layer']:.2f}G + SDPA's mask "
                         f"{m['cp_mask_gb_per_layer']:.2f}G, the bool mask {m['cp_masks_gb']:.2f}G")
    lines.append("phases (GB/GPU incl. overhead): " + ", ".join(f"{k} {g:.1f}" for k, g in result["phases_gb"].items()))
    ws = result["weight_sync"]
    experts = f"; every one of {ws['experts_per_rollout_gpu']} (layer, expert) pairs, TP-sliced" \
        if ws.get("experts_per_rollout_gpu") else ""
    what = " (LoRA adapters only, rollout.lora_sync=adapter)" if ws["sends"] == "adapters" else ""
    lines.append(f"weight sync per step{what}: {ws['bytes_per_gpu'] / GB:.3f} GB into each rollout GPU, "
                 f"{ws['bytes_total'] / GB:.1f} GB in all ({ws['replicas']} vLLM replicas){experts}")
    if result["host_gb_per_node"]:
        lines.append(f"pinned host memory: offloaded roles {result['host_offload_gb_per_gpu']:.1f} GB + vLLM asleep "
                     f"{result['host_vllm_sleep_gb_per_gpu']:.1f} GB + checkpoint snapshot "
                     f"{result['host_save_snapshot_gb_per_gpu']:.1f} GB per GPU, {result['host_gb_per_node']:.0f} GB per node")
    t = result.get("teacher_pool")
    if t:
        lines.append(f"teacher pool: {t['gpus']} GPUs at {t['layout']}, {t['params_per_gpu_m']:.1f}M params/GPU, "
                     f"peak {t['peak_gpu_gb']:.1f} GB: " + ("fits" if t["fits"] else "DOES NOT FIT"))
    lines.append(f"peak {result['peak_gpu_gb']:.1f} GB ({result['peak_phase']}): " + ("fits" if result["fits"] else "DOES NOT FIT"))
    return "\n".join(lines)
