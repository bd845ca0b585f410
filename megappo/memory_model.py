"""The memory model of `megappo plan` (planner.py: the command, its layout search and its report): the per-GPU
memory of every role of a colocated PPO job, phase by phase, term by term.

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
- A vision-language model's vision tower (vision_memory.py states it): on the first stage, whole on every TP rank;
  weights only where it is frozen (model.freeze_vision, LoRA, the reference, a teacher); its activations per image
  patch, for the patches data.max_image_tokens allows a micro-batch's rows.
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

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from megappo.config import ConfigError
from megappo.config.schema import ArchConfig
from megappo.config.validate import arch_from_hf
from megappo.parallel.context_parallel import chunk_size
from megappo.parallel.layout import same_layout, sliced_sync
from megappo.param_counts import (adapter_sync_params, kv_cache_bytes_per_token, lora_params, lora_rank, moe_layers,
                                  rollout_whole_params, shared_expert_params, stage_split, total_params)
from megappo.parallel.weight_mapping import MOE_FAMILIES, padded_vocab_size
from megappo.vision_memory import image_patches, vision_activation_bytes, vision_config, vision_params

GB = 1024**3  # "GB" in the planner is GiB, as the GPU reports its memory (resources.gpu_memory_gb)
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


def activation_terms(cfg, role_cfg, par, lm_head: bool, vc: dict | None = None, vision_trained: bool = True) -> dict:
    """The actor's / critic's activation bytes per rank, term by term (they sum to activation_bytes); `vc`: its vision
    tower's vision_config (a trained tower keeps the in-flight micro-batches' activations, a frozen one a block's)."""
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
    vision = vision_activation_bytes(cfg, vc, b, vision_trained) * (in_flight if vision_trained else 1)
    return {"layers": per_mb * in_flight, "cp_masks": masks, "logits": logits, "tokens_per_gpu": L,
            "bytes_per_token": per_token_bytes(a) // par.tp, "cp_kv_per_layer": kv, "cp_bias_per_layer": bias,
            "vision": vision, "image_patches": image_patches(cfg, vc, b) if vc else 0}


def activation_bytes(cfg, role_cfg, par, lm_head: bool, vc: dict | None = None, vision_trained: bool = True) -> int:
    t = activation_terms(cfg, role_cfg, par, lm_head, vc, vision_trained)
    return t["layers"] + t["cp_masks"] + t["logits"] + t["vision"]


def forward_bytes(cfg, shapes, role_cfg, par, vc: dict | None = None) -> int:
    """A frozen role's forward peak (no activations kept for a backward): one micro-batch's logits over the response
    columns (log_prob_micro_batch_size rows), one layer's activations, and the unfused attention's scores; at cp > 1
    one layer's gathered K/V, additive mask and bool mask; with a vision tower (`vc`) one block's for its images."""
    a = shapes.model.arch
    P, R = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    s = P + R
    b = role_cfg.log_prob_micro_batch_size
    packed = getattr(role_cfg, "pack_sequences", False) or par.cp > 1
    layer = 34 * a.hidden_size * local_tokens(s, b, par) // par.tp + unfused_attention_bytes(a, s, b, par.tp, packed) \
        + sum(cp_attention_terms(a, s, b, par))
    logits = response_columns(P, R, par.cp) * b * padded_vocab_size(a.vocab_size, par.tp) // par.tp \
        * FORWARD_LOGIT_BYTES
    return layer + logits + vision_activation_bytes(cfg, vc, b, trained=False)


@dataclass
class RoleMemory:
    params_per_gpu: int
    expert_params_per_gpu: int
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    terms: dict | None = None  # a trained role's activation_terms
    vision_params: int = 0  # its vision tower's, among params_per_gpu (vision_memory.py)
    vision_trained: bool = False

    @property
    def resident_gb(self) -> float:
        return self.weights_gb + self.grads_gb + self.optimizer_gb


def role_memory(cfg, role: str) -> RoleMemory:
    rcfg = cfg[role]
    par = rcfg.parallel
    shapes = teacher_shapes(cfg) if role == "teacher" else cfg
    vc = vision_config(cfg, role)
    v = vision_params(vc)  # on the first stage (the worst one with it), whole on every TP rank
    dense, experts = stage_split(shapes, par.tp, par.pp, par.ep, "value" if role == "critic" else "lm", v)
    n = dense + experts
    if role in ("ref", "teacher"):  # frozen: weights, and its forward's peak in its own phase (freed after it)
        return RoleMemory(n, experts, 2 * n / GB, 0.0, 0.0, forward_bytes(cfg, shapes, rcfg, par, vc) / GB,
                          vision_params=v)
    lora = role == "actor" and lora_rank(cfg)
    frozen = v if lora or cfg.model.freeze_vision else 0  # a frozen tower's parameters: bf16 weights only
    terms = activation_terms(cfg, rcfg, par, lm_head=(role == "actor"), vc=vc, vision_trained=not frozen)
    activations = activation_bytes(cfg, rcfg, par, role == "actor", vc, not frozen) / GB
    if lora:  # frozen base + adapters (trained; Adam sharded as their base's)
        k, k_exp = lora_params(cfg.model.arch, cfg.actor.lora, par.tp, par.pp, par.ep)
        k_all = k + k_exp
        return RoleMemory(n + k_all, experts, 2 * (n + k_all) / GB, 4 * k_all / GB,
                          12 * (k / (par.dp * par.cp) + k_exp / (par.dp * par.cp // par.ep)) / GB,
                          activations, terms, v)
    # the distributed optimizer shards dense params over dp * cp (megatron's data-parallel group with context
    # parallel), expert params over dp * cp / ep (expert data parallel); weights and grads are whole on each CP rank
    optimizer = 12 * ((dense - frozen) / (par.dp * par.cp) + experts / (par.dp * par.cp // par.ep))
    return RoleMemory(n, experts, 2 * n / GB, 4 * (n - frozen) / GB, optimizer / GB, activations, terms, v,
                      bool(v) and not frozen)


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
    return {"gpus": cfg.resources.teacher_workers, "layout": layout_str(cfg.teacher.parallel),
            "params_per_gpu_m": round(m.params_per_gpu / 1e6, 1), "weights_gb": round(m.weights_gb, 2),
            "peak_gpu_gb": round(peak, 2), "fits": peak <= (1 - HEADROOM) * cfg.resources.gpu_memory_gb}


def plan(cfg) -> dict:
    """The per-GPU memory of each phase, the peak, and the weight-sync volume."""
    gpu_gb = cfg.resources.gpu_memory_gb
    roles = {r: role_memory(cfg, r) for r in planned_roles(cfg)}
    offload = {r: bool(cfg[r].offload) for r in roles}
    vllm_gb = cfg.rollout.gpu_memory_utilization * gpu_gb
    tp = cfg.rollout.tp
    model_params = total_params(cfg) + vision_params(vision_config(cfg, "actor"))  # vLLM splits the tower over tp
    vllm_weights_gb = 2 * (model_params + (tp - 1) * rollout_whole_params(cfg.model.arch)) / tp / GB

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
        vllm_weights_gb * GB if sliced else 2 * model_params
    replicas = cfg.resources.nodes * cfg.resources.workers_per_node // cfg.rollout.tp
    # what the KV cache left beside the weights holds (workspace: this module's overhead), and one engine's
    # share of the step's samples, each at its longest (reported; vLLM queues what does not fit)
    own_teacher = teacher_pool(cfg)
    kv_tokens = int(max(0.0, vllm_gb - vllm_weights_gb) * GB // kv_cache_bytes_per_token(cfg))
    kv_needed = -(-cfg.data.train_batch_size * cfg.rollout.n // replicas) * (cfg.data.max_prompt_length
                                                                            + cfg.rollout.max_new_tokens)
    return {
        "layout": {r: layout_str(cfg[r].parallel) for r in roles} | {"rollout": f"TP{cfg.rollout.tp}"},
        "gpus": cfg.resources.nodes * cfg.resources.workers_per_node,
        "gpu_mem_gb": gpu_gb,
        "sample_tokens": cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
        "total_params_b": round(model_params / 1e9, 3),
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
                  | ({"vision_params_m": round(m.vision_params / 1e6, 1), "vision_trained": m.vision_trained}
                     | ({"vision_activations_gb": round(m.terms["vision"] / GB, 2),
                         "image_patches_per_micro_batch": m.terms["image_patches"]} if m.terms else {})
                     if m.vision_params else {})
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


def layout_str(par) -> str:
    v = f"xVPP{par.vpp}" if par.vpp else ""
    e = f"xEP{par.ep}" if par.ep > 1 else ""
    c = f"xCP{par.cp}" if getattr(par, "cp", 1) > 1 else ""
    return f"TP{par.tp}{c}xPP{par.pp}{v}xDP{par.dp}{e}"

