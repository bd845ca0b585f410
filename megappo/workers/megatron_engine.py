"""MegatronEngine: the shared train / forward engine on megatron-core (used by actor, critic, ref).

One instance per worker process, after `parallel.megatron_init.init_distributed()` + `init_megatron()`:

    engine = MegatronEngine(hf_dir, layout, EngineConfig(head="lm", optim=OptimConfig(lr=1e-6)))
    out = engine.forward_only(batch, response_length=R, micro_batch_size=4)   # {"logprobs", "entropy"}
    metrics = engine.train_step(batch, loss_fn, normalizer=n_tokens, response_length=R, micro_batch_size=2)
    engine.save_checkpoint(dir); engine.load_checkpoint(dir)

`engine_config_from(cfg, role)` (engine_config.py) is the one translation from the run's config to an EngineConfig.

Batch: a dict of tensors with the same first dim (this DP rank's share of the mini-batch), on any
device (the engine moves them to its own, `EngineConfig.device`): `input_ids` [B, S] (left-padded
prompt + right-padded response), `attention_mask` [B, S] (1 = token, one contiguous run per row),
optional `position_ids` (default: from the mask), plus anything the loss needs (sliced per
micro-batch). Outputs cover the last `response_length` positions: `logprobs[:, j]` is
log p(input_ids[:, S-R+j] | prefix) and `values[:, j]` the value head's value of the state before it;
they are on the engine's device (a role worker hands CPU copies to the driver).

Inside, every row is moved to start at column 0 and the batch is cut to its longest row
(`right_align`): the model then runs with plain causal attention and no mask tensor, which every
attention backend supports (Transformer Engine's flash / fused kernels included: an arbitrary
[b, 1, s, s] mask would make TE fall back to unfused attention), and no compute goes to the columns
that are padding in every row.

Split by responsibility: this file builds the engine (model chunks, DDP, optimizer, offload) and
holds its public API; what it is asked to be is engine_config.py (EngineConfig, engine_config_from), its
checkpoints engine_checkpoint.py (mixed in); one pass over a batch (its micro-batches, megatron's
forward-step and loss functions, the head on the output columns, packed RoPE) is megatron_step.py,
which gets what a micro-batch needs as arguments and keeps nothing between calls; what a pass computed
comes back from the call (train_step's `computed_tokens`), nothing is left on the engine.

Loss normalisation: `loss_fn(outputs, micro_batch) -> (loss_sum, metrics)` returns a SUM over the
micro-batch's tokens/sequences; the engine divides by the caller's `normalizer` (the global token or
sequence count of the whole mini-batch, over all DP ranks) and sums gradients over micro-batches and
DP ranks. So loss and gradients do not depend on micro-batch size, DP size or PP size.
Metrics returned by loss_fn are summed the same way (over micro-batches and DP ranks).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megappo.models.gpt import build_gpt_chunks, build_transformer_config, load_hf_config, use_transformer_engine, \
    load_hf_weights
from megappo.models.expert_load import ExpertLoad
from megappo.models.routing_replay import ROUTES, RoutingReplay
from megappo.models.vision import IMAGE_KEYS, IMAGE_MASK, mrope_positions
from megappo.models.lora import apply_lora, lora_disabled, merged_named_parameters, reseed_dropout
from megappo.parallel.cpu_compat import causal_mask
from megappo.parallel.layout import ParallelLayout
from megappo.parallel.weight_mapping import ModelDims, global_named_parameters
from megappo.utils.checkpoint import is_dist_checkpoint
from megappo.workers import megatron_step
from megappo.workers.engine_checkpoint import EngineCheckpoints
# OptimConfig: what callers build an EngineConfig from (MegatronEngine(path, layout, EngineConfig(optim=OptimConfig())))
from megappo.workers.engine_config import HEADS, EngineConfig, OptimConfig  # noqa: F401
from megappo.workers.megatron_step import right_align
from megappo.workers.offload import HostOffload

class MegatronEngine(EngineCheckpoints):
    def __init__(self, model_path, layout: ParallelLayout, config: Optional[EngineConfig] = None):
        from megatron.core import parallel_state as mpu

        self.config = config or EngineConfig()
        if self.config.head not in HEADS:
            raise ValueError(f"EngineConfig.head must be one of {', '.join(HEADS)}, got {self.config.head!r}")
        self.layout = layout
        self.model_path = Path(model_path)
        self.hf_config = load_hf_config(model_path)
        self.value_head = self.config.head == "value"
        self.dims = ModelDims.from_hf_config(self.hf_config, tp=layout.tp, value_head=self.value_head)
        layout.validate(self.dims.num_heads, self.dims.num_kv_heads, self.dims.num_layers,
                        num_experts=self.dims.num_experts)
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.cp_rank = mpu.get_context_parallel_rank()
        # context parallel runs on the packed path: each packed micro-batch cut over the CP group, megappo's
        # own CP attention (models/packed_attention.py); TE's CP on GPU is not wired yet
        self.packed = self.config.pack_sequences or layout.cp > 1
        if self.dims.vision and layout.cp > 1:
            raise ValueError(f"context parallel (cp={layout.cp}) with a vision-language model ({self.dims.model_type}) "
                             "is not supported yet: set cp 1")
        self.uses_te = use_transformer_engine(self.config.device, self.config.transformer_engine,
                                              packed=self.packed,
                                              lora=self.config.lora, mla=self.dims.mla)
        self.tf_config = build_transformer_config(self.hf_config, layout, device=self.config.device,
                                                  params_dtype=self.config.params_dtype,
                                                  recompute=self.config.recompute,
                                                  sequence_parallel=self.config.sequence_parallel,
                                                  use_te=self.uses_te, moe=self._moe_overrides())
        self.device = torch.device(self.config.device)
        # megatron allocates on the GPU itself (on CPU: on the host); what it leaves elsewhere (the value
        # head) moves before the HF weights are copied in
        chunks = [c.to(self.device) for c in build_gpt_chunks(self.hf_config, self.tf_config, layout,
                                                               value_head=self.value_head, seed=self.config.seed,
                                                               use_te=self.uses_te, packed=self.packed,
                                                               freeze_vision=self.config.freeze_vision)]
        # the LM / value head runs on the R output columns only (megatron_step.head_on_outputs); not under
        # sequence parallel, where the head's input is a sequence shard that the head all-gathers itself
        self.head_on_outputs = not self.tf_config.sequence_parallel
        # MoE: tokens per expert in each update (forward hooks on the routers)
        self.expert_load = ExpertLoad(chunks, self.dims.num_layers, self.dims.num_experts) \
            if self.dims.num_experts else None
        # MoE: routes given to the routers (a batch's `routed_experts`) or recorded from them (models/routing_replay.py)
        self.routing = RoutingReplay(chunks, self.dims.num_layers, int(self.tf_config.moe_router_topk)) \
            if self.dims.num_experts else None
        if self.packed and self.uses_te:
            what = f"context parallel (cp={layout.cp})" if layout.cp > 1 else "pack_sequences"
            raise ValueError(f"{what} with Transformer Engine needs megatron's THD / cp_comm_type path, not wired "
                             "yet: set model.transformer_engine=false" + ("" if layout.cp > 1 else
                                                                         " or pack_sequences=false"))
        from_dist_ckpt = is_dist_checkpoint(model_path)
        self.value_head_initialised = [] if from_dist_ckpt else \
            load_hf_weights(chunks, model_path, self.dims, self.tp_rank, layout.tp)
        self.lora = self.config.lora
        if self.lora is not None:  # before DDP / the optimizer: they skip the frozen base (requires_grad False)
            if self.config.optim is None:
                raise ValueError("EngineConfig.lora needs a training engine (optim set): a forward-only LoRA engine "
                                 "would run untrained adapters")
            apply_lora(chunks, self.lora, pp_group=mpu.get_pipeline_model_parallel_group() if layout.pp > 1 else None)
        self.optimizer = None
        self.scheduler = None
        self.steps = 0
        self._pending_save = None  # a background save whose files a thread is still writing
        if self.config.optim is not None:
            self.model = self._wrap_ddp(chunks)
            self._build_optimizer()
        else:
            self.model = chunks
            for c in chunks:
                c.eval()
        self._host = HostOffload()
        self._resident_depth = 0
        if from_dist_ckpt:  # a megatron dist checkpoint (+ HF config.json) instead of HF weights
            self.load_checkpoint(model_path, load_optimizer=False)
        if self.config.offload:
            self.offload()

    # ---- setup ------------------------------------------------------------------------------------

    def _moe_overrides(self) -> dict:
        """megatron TransformerConfig fields from the MoE knobs (none for a dense model)."""
        if not self.dims.num_experts:
            return {}
        c = self.config
        out = {"moe_token_dispatcher_type": c.moe_token_dispatcher, "moe_z_loss_coeff": c.moe_z_loss_coeff or None}
        if c.moe_aux_loss_coeff:
            out.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=c.moe_aux_loss_coeff)
        return out

    def _wrap_ddp(self, chunks):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.optim.distributed_optimizer,
        )
        wrapped = []
        for i, c in enumerate(chunks):
            m = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=c,
                                        disable_bucketing=i > 0)
            m.broadcast_params()
            wrapped.append(m)

        def _finalize(model, num_tokens, **kw):
            # the loss is already divided by the caller's global normaliser: sum, never rescale
            return finalize_model_grads(model, None, **kw)

        self.tf_config.finalize_model_grads_func = _finalize
        self.tf_config.grad_scale_func = None
        return wrapped

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.config.optim
        oc = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=self.tf_config.bf16, fp16=False, params_dtype=self.tf_config.params_dtype,
            use_distributed_optimizer=o.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(oc, self.model)
        decay_steps = max(self.config.schedule_steps, o.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr,
            min_lr=o.min_lr if o.lr_schedule == "cosine" else o.lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=o.lr_schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        )

    # ---- host offload ----------------------------------------------------------------------------
    # With EngineConfig.offload the engine's device memory is in use only inside `resident()` (every
    # public method below enters it; a role worker wraps a whole phase in it so the mini-batches of
    # one update do not each move the weights). See workers/offload.py.

    def _offload_groups(self) -> dict:
        """{part: (tensors, keep)}: the weights, the optimizer (states + main params: the distributed
        optimizer's shards) and the grad buffers (dropped, zeroed at every step anyway)."""
        params = [p for c in self.inner_chunks() for p in c.parameters()]
        grads, optim = [], []
        for m in self.model:  # megatron DDP: the contiguous grad buffers (main_grad views)
            for attr in ("buffers", "expert_parallel_buffers"):  # lists on DDP (`buffers` is a method otherwise)
                for buf in getattr(m, attr, None) if isinstance(getattr(m, attr, None), list) else []:
                    if getattr(buf, "grad_data", None) is not None:
                        grads.append(buf.grad_data)
        if self.optimizer is not None:
            for o in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                inner = getattr(o, "optimizer", None)  # the torch optimizer under megatron's wrapper
                if inner is None:
                    continue
                for st in inner.state.values():
                    optim.extend(v for v in st.values() if isinstance(v, torch.Tensor))
                for g in inner.param_groups:
                    optim.extend(g["params"])
        return {"params": (params, True), "optimizer": (optim, True), "grads": (grads, False)}

    def offload(self) -> int:
        """Move what is still on the device of this engine's params, optimizer states (values kept) and
        grad buffers (dropped) off it now; returns the bytes freed."""
        return self._host.offload(self._offload_groups())

    def reload(self, parts=None) -> int:
        """Bring back what `offload()` moved (`parts`: "params", "optimizer", "grads"; None: all)."""
        return self._host.reload(parts)

    @property
    def offloaded(self) -> bool:
        return self._host.offloaded

    @property
    def offload_stats(self) -> dict:
        """Of the last offload: device bytes freed, bytes now in host copies (0 when resident)."""
        return {"device_bytes_freed": self._host.device_bytes_freed, "host_bytes": self._host.host_bytes}

    @contextlib.contextmanager
    def resident(self, parts=None):
        """The engine's weights (and optimizer and grads; `parts=["params"]`: the weights only, e.g.
        for a weight sync) on the device for the block; with offload enabled they leave again when
        the outermost block exits. Re-entrant (an inner block may ask for more parts)."""
        self.reload(parts)
        self._resident_depth += 1
        try:
            yield self
        finally:
            self._resident_depth -= 1
            if self._resident_depth == 0 and self.config.offload:
                self.offload()

    # ---- pipeline plumbing -----------------------------------------------------------------------

    def _run(self, batch: dict, response_length: int, micro_batch_size: int, forward_only: bool,
             loss_fn: Optional[Callable], normalizer: Optional[float], temperature: float,
             compute_entropy: bool, record_routes: Optional[torch.Tensor] = None) -> tuple[list, int]:
        """One pass of megatron's pipeline schedule over the batch (megatron_step.py); returns its
        per-micro-batch outputs (on the last pipeline stage) and the tokens this rank computed (padding in).
        A batch's `routed_experts` [B, S, layers, k] are replayed (MoE); `record_routes` [B * S, layers, k]
        gets the routers' own choices."""
        seq = batch["input_ids"].shape[1]
        if not 1 <= response_length < seq:
            raise ValueError(f"response_length must be in [1, {seq - 1}], got {response_length}")
        batch = dict(batch)
        given = batch.pop(ROUTES, None)
        if given is not None or record_routes is not None:
            shape = self._route_shape()
            b, s = batch["input_ids"].shape
            if given is not None:
                if tuple(given.shape) != (b, s, *shape):
                    raise ValueError(f"{ROUTES} {tuple(given.shape)} does not match the batch [{b}, {s}] with "
                                     f"{shape[0]} layers x top-{shape[1]} routes")
                given = given.to(self.device).reshape(b * s, *shape)
            batch["_token_index"] = torch.arange(b * s, device=batch["input_ids"].device).view(b, s)
        if self.dims.vision:  # M-RoPE positions and the prompts' image pads, from the rows' images (models/vision.py)
            batch["position_ids"], batch[IMAGE_MASK] = mrope_positions(
                batch["input_ids"], batch["attention_mask"], batch.get("image_grid_thw"), self.hf_config.image_token_id,
                self.hf_config.vision_config.spatial_merge_size, prompt_end=seq - response_length,
                response_mask=batch.get("response_mask"))  # an agent's later images sit among its responses
        elif any(k in batch for k in IMAGE_KEYS):
            raise ValueError(f"the batch carries images ({', '.join(k for k in IMAGE_KEYS if k in batch)}) but "
                             f"{self.model_path} is a text model ({self.dims.model_type}): drop the images or use a "
                             "vision-language model")
        # the batch on the engine's device, right-aligned and cut to its longest row
        multiple = self.layout.tp if self.tf_config.sequence_parallel else 1
        batch = right_align({k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                             for k, v in batch.items()}, response_length, seq_multiple=multiple)
        from megatron.core import parallel_state as mpu

        packed = self.packed
        cp = (self.layout.cp, self.cp_rank) if self.layout.cp > 1 else None
        micro = megatron_step.micro_batches(batch, micro_batch_size, packed=packed, pp=self.layout.pp,
                                            vpp=self.layout.vpp if self.layout.virtual_pp else None,
                                            seq_multiple=multiple,
                                            max_tokens=self.config.max_tokens_per_micro_batch, cp=cp)
        spec = megatron_step.StepSpec(
            value_head=self.value_head, vocab_size=self.dims.vocab_size, head_on_outputs=self.head_on_outputs,
            packed=packed,
            # right-aligned rows: causal attention is exact for every real token (see right_align). TE's
            # attention applies it itself; megatron's local attention gets it as a tensor (cpu_compat shim 6)
            mask=None if self.uses_te or packed else causal_mask(micro.seq, self.device),
            forward_only=forward_only, loss_fn=loss_fn, normalizer=normalizer, temperature=temperature,
            compute_entropy=compute_entropy, expert_load=self.expert_load,
            routing=self.routing, sequence_parallel=self.tf_config.sequence_parallel, given_routes=given,
            record_routes=record_routes, recompute=self.config.recompute and not forward_only)
        return megatron_step.run(spec, micro, self.model), micro.computed_tokens

    # ---- public API ------------------------------------------------------------------------------

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @torch.no_grad()
    def forward_only(self, batch: dict, response_length: int, micro_batch_size: int = 1,
                     temperature: float = 1.0, compute_entropy: bool = True,
                     record_routes: bool = False) -> Optional[dict]:
        """LM head: {"logprobs", "entropy"} [B, R] (log-softmax of logits / temperature); value head:
        {"values"} [B, R]. On the last pipeline stage (every TP rank); None on the other stages.
        MoE: a batch's `routed_experts` are replayed; `record_routes` adds the routers' own choices,
        {"routed_experts"} [B, S, layers, k] (int16, -1 on padding; collective over TP, CP and PP)."""
        for m in self.model:
            m.eval()
        record = None
        if record_routes:
            b, s = batch["input_ids"].shape
            record = torch.full((b * s, *self._route_shape()), -1, dtype=torch.int16, device=self.device)
        with self.resident(parts=["params"]):  # a forward needs the weights only: optimizer and grads stay off
            store, _ = self._run(batch, response_length, micro_batch_size, True, None, None, temperature,
                                 compute_entropy, record_routes=record)
        if record is not None:  # each rank holds its tokens (CP, sequence parallel) of its layers (PP)
            self._gather_routes(record)
        if not self.is_last_stage:
            return None
        out = {k: torch.cat([d[k] for d in store], dim=0) for k in store[0]}
        rows = out.pop("_rows", None)
        if rows is not None:  # packed micro-batches may hold the rows in another order (token budget)
            for k, v in out.items():
                back = torch.empty_like(v)
                back[rows.to(v.device)] = v
                out[k] = back
        if record is not None:
            out[ROUTES] = record.view(*batch["input_ids"].shape, *self.routing.shape)
        return out

    def _route_shape(self) -> tuple[int, int]:
        """(layers, top-k) of the routes a MoE model replays or records; a dense model has none."""
        if self.routing is None:
            raise ValueError(f"routing replay needs a mixture-of-experts model; {self.model_path} is dense: set "
                             "actor.router_replay=off")
        return self.routing.shape

    def _gather_routes(self, record: torch.Tensor) -> None:
        """Every rank's recorded routes (-1 where another rank routed the token) -> the whole batch's, in place."""
        from megatron.core import parallel_state as mpu

        groups = [(self.layout.tp, mpu.get_tensor_model_parallel_group),
                  (self.layout.cp, mpu.get_context_parallel_group),
                  (self.layout.pp, mpu.get_pipeline_model_parallel_group)]
        for size, group in groups:
            if size > 1:
                wide = record.to(torch.int32)  # gloo reduces no int16
                dist.all_reduce(wide, op=dist.ReduceOp.MAX, group=group())
                record.copy_(wide)

    def train_step(self, batch: dict, loss_fn: Callable, normalizer: float, response_length: int,
                   micro_batch_size: int = 1, temperature: float = 1.0, compute_entropy: bool = True) -> dict:
        """One optimizer step over this DP rank's share of a mini-batch. Returns metrics (same on every
        rank): loss and loss_fn's metrics (summed over micro-batches and DP), grad_norm, lr; and
        computed_tokens, the tokens this rank ran through the model (padding in: the tokens/*_computed metric).
        compute_entropy=False: loss_fn's outputs carry no "entropy" (one pass over the vocab less)."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (EngineConfig.optim=None)")
        if not normalizer or normalizer <= 0:
            raise ValueError(f"normalizer must be a positive global count, got {normalizer!r}")
        with self.resident():
            return self._train_step(batch, loss_fn, normalizer, response_length, micro_batch_size, temperature,
                                    compute_entropy)

    def _train_step(self, batch, loss_fn, normalizer, response_length, micro_batch_size, temperature,
                    compute_entropy) -> dict:
        from megatron.core import parallel_state as mpu

        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.expert_load is not None:
            self.expert_load.reset()
        if self.routing is not None:
            self.routing.reset()
        if self.lora is not None and self.lora.dropout > 0:  # the TP ranks' column masks agree, after a resume too
            reseed_dropout((self.config.seed * 1_000_003 + self.steps * 101 + self.pp_rank) % 2**63, self.device)
        store, computed = self._run(batch, response_length, micro_batch_size, False, loss_fn, float(normalizer),
                                    temperature, compute_entropy=compute_entropy)
        finite = self._loss_is_finite(store)
        if finite:
            ok, grad_norm, _ = self.optimizer.step()
        else:  # a NaN / inf loss: its gradients would poison the weights and Adam's moments
            if self.config.on_nan == "stop":
                raise FloatingPointError(f"non-finite loss in this {self.config.head}-head update (optimizer step "
                                         f"{self.steps + 1}); lower the learning rate or check the rewards, or set "
                                         "trainer.on_nan=skip to skip such steps")
            ok, grad_norm = False, float("nan")
        if ok:
            self.scheduler.step(increment=1)
            self.steps += 1
        keys = sorted(store[0].keys()) if store else []
        # metric names are known on the last stage only: broadcast them over the pipeline group
        pp_group = mpu.get_pipeline_model_parallel_group()
        last = dist.get_global_rank(pp_group, self.layout.pp - 1) if self.layout.pp > 1 else dist.get_rank()
        names = [keys]
        if self.layout.pp > 1:
            dist.broadcast_object_list(names, src=last, group=pp_group)
        keys = names[0]
        vec = torch.zeros(len(keys), dtype=torch.float64, device="cpu")  # over gloo (cpu:gloo,cuda:nccl)
        if self.is_last_stage:
            for i, k in enumerate(keys):
                vec[i] = sum(float(d[k]) for d in store)
            if self.layout.dp > 1:
                dist.all_reduce(vec, group=mpu.get_data_parallel_group())
        if self.layout.pp > 1:
            dist.broadcast(vec, src=last, group=pp_group)
        metrics = {k: float(vec[i]) for i, k in enumerate(keys)}
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["update_successful"] = bool(ok)
        metrics["nan_skipped"] = float(not finite)
        metrics["computed_tokens"] = float(computed)  # this DP replica's (padding in); the caller sums over DP
        if self.expert_load is not None:  # TP ranks route the same tokens unless sequence parallel splits them
            metrics.update(self.expert_load.metrics(self.tf_config.sequence_parallel or self.tp_rank == 0))
        if self.routing is not None:
            metrics.update(self.routing.metrics(self.tf_config.sequence_parallel or self.tp_rank == 0))
        return metrics

    def _loss_is_finite(self, store) -> bool:
        """Every micro-batch's loss finite, agreed by every rank (the last stage knows the losses)."""
        bad = torch.zeros(1, dtype=torch.float64, device="cpu")
        if self.is_last_stage and any(not math.isfinite(float(d["loss"])) for d in store):
            bad[0] = 1.0
        if dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    # ---- weights ---------------------------------------------------------------------------------

    def inner_chunks(self) -> list:
        return [getattr(m, "module", m) for m in self.model]

    @torch.no_grad()
    def named_parameters_global(self):
        """(global megatron name, this rank's shard) over all chunks (for resharding, weight sync, export):
        the model's own weights in HF-mappable names. With LoRA: the base with each adapted linear's weight
        merged (W + scaling * B @ A), the adapters' own parameters not listed (models/lora.py)."""
        if self.lora is not None:
            yield from merged_named_parameters(self.inner_chunks())
            return
        for c in self.inner_chunks():
            yield from global_named_parameters(c)

    def base_model(self):
        """A context in which the engine's forwards run the base model (LoRA adapters off): the PPO
        reference of a LoRA actor. A no-op context without LoRA."""
        return lora_disabled(self.inner_chunks()) if self.lora is not None else contextlib.nullcontext()

    def export_lora_adapter(self, out) -> None:
        """Write the trained adapter as a peft adapter dir (collective; global rank 0 writes): loads onto the
        HF base with peft.PeftModel.from_pretrained(base, out)."""
        from megappo.models.lora_peft import gather_hf_lora, save_peft_adapter

        if self.lora is None:
            raise ValueError("export_lora_adapter: this engine has no LoRA adapters (actor.lora.rank=0)")
        with self.resident(parts=["params"]):
            hf = gather_hf_lora(self.inner_chunks(), ModelDims.from_hf_config(self.hf_config, tp=self.layout.tp))
        if hf is not None:
            save_peft_adapter(hf, self.lora, self.model_path, out)

    def trained_param_counts(self) -> dict:
        """Parameters (this rank) in the model, in the optimizer, and the grad buffers' bytes: what LoRA saves."""
        params = sum(p.numel() for c in self.inner_chunks() for p in c.parameters())
        trained = sum(p.numel() for c in self.inner_chunks() for p in c.parameters() if p.requires_grad)
        grad_bytes = 0
        for m in self.model:
            for buf in getattr(m, "buffers", None) if isinstance(getattr(m, "buffers", None), list) else []:
                grad_bytes += buf.grad_data.numel() * buf.grad_data.element_size()
        in_optim = 0
        if self.optimizer is not None:
            for o in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                for g in getattr(o, "optimizer", o).param_groups:
                    in_optim += sum(p.numel() for p in g["params"])
        return {"params": params, "trainable": trained, "optimizer_params": in_optim, "grad_buffer_bytes": grad_bytes}

    # ---- a fresh run on the same engine (warm workers: ppo/workers.WarmWorkers) ---------------------

    def _state_tensors(self):
        for i, c in enumerate(self.inner_chunks()):
            for name, t in [*c.named_parameters(), *c.named_buffers()]:
                yield f"{i}.{name}", t

    @torch.no_grad()
    def keep_initial_state(self) -> None:
        """Copy the weights (and buffers) as built, for `reset`: a second copy of the model in host memory,
        which only a caller that reuses this engine for another run asks for."""
        with self.resident(parts=["params"]):
            self._initial = {n: t.detach().to("cpu", copy=True) for n, t in self._state_tensors()}

    @torch.no_grad()
    def reset(self, config: EngineConfig) -> None:
        """The engine as `MegatronEngine(model_path, layout, config)` would build it, without rebuilding the
        model: the weights and buffers kept by `keep_initial_state`, zero gradients, a new optimizer and LR
        schedule (`config.optim`, `config.schedule_steps`: what may differ from the config it was built
        with), step 0. Any other difference in `config` is a ValueError: that engine must be built anew."""
        import dataclasses

        if getattr(self, "_initial", None) is None:
            raise RuntimeError("MegatronEngine.reset needs keep_initial_state() right after the engine was built")
        differ = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("optim", "schedule_steps")
                  and getattr(config, f.name) != getattr(self.config, f.name)]
        if differ:
            raise ValueError(f"MegatronEngine.reset: {', '.join(differ)} differ from the engine as built; build a "
                             "new engine for that config")
        self.finish_save()
        with self.resident():
            for name, t in self._state_tensors():
                t.copy_(self._initial[name])
            self.config = config
            self.steps = 0
            if config.optim is not None:
                for m in self.model:
                    m.zero_grad_buffer()
                self._build_optimizer()
        if self.expert_load is not None:
            self.expert_load.reset()
