"""MegatronEngine: the shared train / forward engine on megatron-core (used by actor, critic, ref).

One instance per worker process, after `parallel.megatron_init.init_distributed()` + `init_megatron()`:

    engine = MegatronEngine(hf_dir, layout, EngineConfig(role="actor", optim=OptimConfig(lr=1e-6)))
    out = engine.forward_only(batch, response_length=R, micro_batch_size=4)   # {"logprobs", "entropy"}
    metrics = engine.train_step(batch, loss_fn, normalizer=n_tokens, response_length=R, micro_batch_size=2)
    engine.save_checkpoint(dir); engine.load_checkpoint(dir)

Batch: a dict of tensors with the same first dim (this DP rank's share of the mini-batch):
`input_ids` [B, S] (left-padded prompt + right-padded response), `attention_mask` [B, S] (1 = token),
optional `position_ids` (default: from the mask), plus anything the loss needs (sliced per
micro-batch). Outputs cover the last `response_length` positions: `logprobs[:, j]` is
log p(input_ids[:, S-R+j] | prefix) and `values[:, j]` the critic's value of the state before it.

Loss normalisation: `loss_fn(outputs, micro_batch) -> (loss_sum, metrics)` returns a SUM over the
micro-batch's tokens/sequences; the engine divides by the caller's `normalizer` (the global token or
sequence count of the whole mini-batch, over all DP ranks) and sums gradients over micro-batches and
DP ranks. So loss and gradients do not depend on micro-batch size, DP size or PP size.
Metrics returned by loss_fn are summed the same way (over micro-batches and DP ranks).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megappo.config.schema import OptimConfig as SchemaOptimConfig
from megappo.models.gpt import build_gpt_chunks, build_transformer_config, global_named_parameters, load_hf_config, \
    load_hf_weights
from megappo.models.logprobs import vocab_parallel_logprobs
from megappo.parallel.layout import ParallelLayout
from megappo.parallel.weight_mapping import ModelDims
from megappo.workers.offload import HostOffload


@dataclass
class OptimConfig(SchemaOptimConfig):
    """The config's optimizer keys (megappo.config.schema.OptimConfig) plus the LR schedule length."""

    total_steps: int = 1000  # optimizer steps the LR schedule spans


@dataclass
class EngineConfig:
    role: str = "actor"  # actor (LM head: log-probs, entropy) | critic (value head)
    optim: Optional[OptimConfig] = None  # None: forward-only engine (ref policy, scoring)
    params_dtype: Optional[torch.dtype] = None  # default: bf16 on GPU, fp32 on CPU
    recompute: bool = False  # full activation recompute, one layer at a time
    sequence_parallel: bool = False
    offload: bool = False  # keep params / grads / optimizer states in host memory outside `resident()`
    seed: int = 1234
    temperature: float = 1.0
    extra: dict = field(default_factory=dict)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded rows: the first real token gets position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] (1 = token) -> bool [b, 1, s, s], True = masked: future keys and pad keys."""
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad_key = (attention_mask == 0)[:, None, None, :]
    return causal[None, None] | pad_key


def is_dist_checkpoint(path) -> bool:
    """A megatron dist_checkpointing dir (metadata.json) without HF safetensors."""
    p = Path(path)
    return (p / "metadata.json").exists() and not any(p.glob("*.safetensors"))


def _split(batch: dict, mbs: int) -> list[dict]:
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + mbs] for k, v in batch.items()} for i in range(0, n, mbs)]


class MegatronEngine:
    def __init__(self, model_path, layout: ParallelLayout, config: Optional[EngineConfig] = None):
        from megatron.core import parallel_state as mpu

        self.config = config or EngineConfig()
        if self.config.role not in ("actor", "critic"):
            raise ValueError(f"role must be actor or critic, got {self.config.role!r}")
        self.layout = layout
        self.model_path = Path(model_path)
        self.hf_config = load_hf_config(model_path)
        self.critic = self.config.role == "critic"
        self.dims = ModelDims.from_hf_config(self.hf_config, tp=layout.tp, value_head=self.critic)
        layout.validate(self.dims.num_heads, self.dims.num_kv_heads, self.dims.num_layers)
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.tf_config = build_transformer_config(self.hf_config, layout, params_dtype=self.config.params_dtype,
                                                  recompute=self.config.recompute,
                                                  sequence_parallel=self.config.sequence_parallel)
        chunks = build_gpt_chunks(self.hf_config, self.tf_config, layout, critic=self.critic, seed=self.config.seed)
        from_dist_ckpt = is_dist_checkpoint(model_path)
        self.value_head_initialised = [] if from_dist_ckpt else \
            load_hf_weights(chunks, model_path, self.dims, self.tp_rank, layout.tp)
        self.optimizer = None
        self.scheduler = None
        self.steps = 0
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
        if o.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be constant or cosine, got {o.lr_schedule!r}")
        oc = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=self.tf_config.bf16, fp16=False, params_dtype=self.tf_config.params_dtype,
            use_distributed_optimizer=o.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(oc, self.model)
        decay_steps = max(o.total_steps, o.warmup_steps + 1)
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

    def _offload_sets(self) -> tuple[list, list]:
        keep = [p for c in self.inner_chunks() for p in c.parameters()]
        discard = []
        for m in self.model:  # megatron DDP: the contiguous grad buffers (main_grad views)
            bufs = []
            for attr in ("buffers", "expert_parallel_buffers"):  # lists on DDP (`buffers` is a method otherwise)
                if isinstance(getattr(m, attr, None), list):
                    bufs.extend(getattr(m, attr))
            for buf in bufs:
                if getattr(buf, "grad_data", None) is not None:
                    discard.append(buf.grad_data)
        if self.optimizer is not None:
            opts = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
            for o in opts:
                inner = getattr(o, "optimizer", None)  # the torch optimizer under megatron's wrapper
                if inner is None:
                    continue
                for st in inner.state.values():
                    keep.extend(v for v in st.values() if isinstance(v, torch.Tensor))
                for g in inner.param_groups:
                    keep.extend(g["params"])  # main (fp32) params: the distributed optimizer's shards
        return keep, discard

    def offload(self) -> int:
        """Move this engine's params, optimizer states (values kept) and grad buffers (dropped) off
        the device now; returns the bytes freed. No-op if already offloaded."""
        if self._host.offloaded:
            return 0
        keep, discard = self._offload_sets()
        return self._host.offload(keep, discard)

    def reload(self) -> int:
        """Bring everything `offload()` moved back onto the device (same tensors, same values)."""
        return self._host.reload()

    @property
    def offloaded(self) -> bool:
        return self._host.offloaded

    @property
    def offload_stats(self) -> dict:
        """Of the last offload: device bytes freed, bytes now in host copies (0 when resident)."""
        return {"device_bytes_freed": self._host.device_bytes_freed, "host_bytes": self._host.host_bytes}

    @contextlib.contextmanager
    def resident(self):
        """The engine's weights (and optimizer) on the device for the block; with offload enabled
        they leave again when the outermost block exits. Re-entrant."""
        if self._resident_depth == 0:
            self.reload()
        self._resident_depth += 1
        try:
            yield self
        finally:
            self._resident_depth -= 1
            if self._resident_depth == 0 and self.config.offload:
                self.offload()

    # ---- pipeline plumbing -----------------------------------------------------------------------

    def _prepare(self, batch: dict) -> dict:
        b = dict(batch)
        b["attention_mask"] = b["attention_mask"].long()
        if "position_ids" not in b:
            b["position_ids"] = position_ids_from_mask(b["attention_mask"])
        return b

    def _model_outputs(self, output: torch.Tensor, mb: dict, response_length: int, temperature: float,
                       compute_entropy: bool) -> dict:
        s = mb["input_ids"].shape[1]
        r = response_length
        if self.critic:
            return {"values": output[:, s - r - 1:s - 1, 0].float()}
        logits = output[:, s - r - 1:s - 1, :]
        targets = mb["input_ids"][:, s - r:]
        logp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=self.dims.vocab_size,
                                            temperature=temperature, compute_entropy=compute_entropy)
        out = {"logprobs": logp}
        if ent is not None:
            out["entropy"] = ent
        return out

    def _run(self, batch: dict, response_length: int, micro_batch_size: int, forward_only: bool,
             loss_fn: Optional[Callable], normalizer: Optional[float], temperature: float,
             compute_entropy: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = self._prepare(batch)
        bsz, seq = batch["input_ids"].shape
        if not 1 <= response_length < seq:
            raise ValueError(f"response_length must be in [1, {seq - 1}], got {response_length}")
        micro = _split(batch, micro_batch_size)
        if self.layout.virtual_pp and len(micro) % self.layout.pp:
            raise ValueError(f"interleaved pipeline (vpp={self.layout.vpp}) needs the number of micro-batches "
                             f"({len(micro)}) to be a multiple of pp={self.layout.pp}")
        if len({m["input_ids"].shape[0] for m in micro}) != 1:
            raise ValueError(f"batch size {bsz} is not a multiple of micro_batch_size {micro_batch_size}")

        def loss_func(mb, output):
            outs = self._model_outputs(output, mb, response_length, temperature, compute_entropy)
            if forward_only and loss_fn is None:
                return torch.zeros((), dtype=torch.float32), torch.ones((), dtype=torch.int), \
                    {k: v.detach() for k, v in outs.items()}
            loss_sum, metrics = loss_fn(outs, mb)
            loss = loss_sum / normalizer
            reported = {"loss": loss.detach().clone()}
            reported.update({k: torch.as_tensor(v).detach().float() for k, v in (metrics or {}).items()})
            return loss, torch.ones((), dtype=torch.int), reported

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb["input_ids"], mb["position_ids"], causal_padding_mask(mb["attention_mask"]))
            return output, partial(loss_func, mb)

        iters = [iter(micro) for _ in self.model] if len(self.model) > 1 else iter(micro)
        fb = get_forward_backward_func()
        return fb(forward_step_func=forward_step, data_iterator=iters, model=self.model if len(self.model) > 1
                  else self.model[0], num_microbatches=len(micro), seq_length=seq,
                  micro_batch_size=micro_batch_size, forward_only=forward_only)

    # ---- public API ------------------------------------------------------------------------------

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @torch.no_grad()
    def forward_only(self, batch: dict, response_length: int, micro_batch_size: int = 1,
                     temperature: Optional[float] = None, compute_entropy: bool = True) -> Optional[dict]:
        """Actor: {"logprobs", "entropy"} [B, R]; critic: {"values"} [B, R]. On the last pipeline stage
        (every TP rank); None on the other stages."""
        for m in self.model:
            m.eval()
        t = self.config.temperature if temperature is None else temperature
        with self.resident():
            store = self._run(batch, response_length, micro_batch_size, True, None, None, t, compute_entropy)
        if not self.is_last_stage:
            return None
        return {k: torch.cat([d[k] for d in store], dim=0) for k in store[0]}

    def train_step(self, batch: dict, loss_fn: Callable, normalizer: float, response_length: int,
                   micro_batch_size: int = 1, temperature: Optional[float] = None) -> dict:
        """One optimizer step over this DP rank's share of a mini-batch. Returns metrics (same on every
        rank): loss and loss_fn's metrics (summed over micro-batches and DP), grad_norm, lr."""
        if self.optimizer is None:
            raise RuntimeError("this engine was built without an optimizer (EngineConfig.optim=None)")
        if not normalizer or normalizer <= 0:
            raise ValueError(f"normalizer must be a positive global count, got {normalizer!r}")
        with self.resident():
            return self._train_step(batch, loss_fn, normalizer, response_length, micro_batch_size, temperature)

    def _train_step(self, batch, loss_fn, normalizer, response_length, micro_batch_size, temperature) -> dict:
        from megatron.core import parallel_state as mpu

        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        t = self.config.temperature if temperature is None else temperature
        store = self._run(batch, response_length, micro_batch_size, False, loss_fn, float(normalizer), t,
                          compute_entropy=True)
        ok, grad_norm, _ = self.optimizer.step()
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
        vec = torch.zeros(len(keys), dtype=torch.float64)
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
        return metrics

    # ---- weights ---------------------------------------------------------------------------------

    def inner_chunks(self) -> list:
        return [getattr(m, "module", m) for m in self.model]

    @torch.no_grad()
    def named_parameters_global(self):
        """(global megatron name, this rank's shard) over all chunks (for resharding / tests)."""
        for c in self.inner_chunks():
            yield from global_named_parameters(c)

    # ---- checkpoints -----------------------------------------------------------------------------

    def _sharded_state_dict(self, is_loading: bool) -> dict:
        chunks = self.inner_chunks()
        model_sd = {}
        if len(chunks) == 1:
            model_sd["model"] = chunks[0].sharded_state_dict()
        else:
            for i, c in enumerate(chunks):
                model_sd[f"model{i}"] = c.sharded_state_dict()
        sd = dict(model_sd)
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
            sd["scheduler"] = self.scheduler.state_dict()
            sd["steps"] = self.steps
        return sd

    def save_checkpoint(self, path) -> None:
        """megatron dist_checkpointing (torch_dist) of model (+ optimizer, scheduler): loadable into any
        other layout of the same model. Collective: every rank calls it."""
        from megappo.parallel import dist_checkpoint

        with self.resident():
            dist_checkpoint.save(path, self._sharded_state_dict(is_loading=False))

    def load_checkpoint(self, path, load_optimizer: bool = True) -> None:
        from megappo.parallel import dist_checkpoint

        with self.resident():
            dist_checkpoint.load(path, self, load_optimizer=load_optimizer)
