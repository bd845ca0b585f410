"""HybridEngine: the actor's Megatron weights and this worker's vLLM engine sharing one process.

    rollout = VLLMRollout(hf_dir, cfg.rollout, seed=...)      # after init_distributed + init_megatron
    hybrid = HybridEngine(megatron_engine, rollout, bucket_mb=cfg.rollout.weight_sync_bucket_mb)
    with hybrid:                                              # enter: reshard weights in + wake rollout
        out = hybrid.generate_sequences(prompts)              # this replica's share; gathered by default
    metrics = hybrid.metrics                                  # rollout/*, timing/*
    metrics.update(hybrid.logprob_parity(out))                # vLLM vs Megatron log-probs

Enter: save the trainer's RNG state, wake the weights (GPU), stream the Megatron shards through
parallel/resharding.py into vLLM bucket by bucket (`rollout.weight_load`: the model's load_weights,
then on CPU a re-pack of the packed linears it loaded, or vLLM's reload_weights; via
collective_rpc) with the actor resident (an `offload=true` actor is brought back for the sync and
leaves again before generation), reset the prefix cache, check the weight fingerprint (a mismatch
raises `WeightSyncError`), wake the KV cache.
With actor.lora and rollout.lora_sync=adapter, a sync sends only the adapters (a peft dir for vLLM's own
LoRA serving); vLLM keeps the base it loaded, fingerprinted against the actor's at every sync.
Exit: put vLLM to sleep (GPU: KV cache freed, weights discarded with rollout.sleep_level 2) and
restore the trainer's RNG state. The engine is put to sleep once when the HybridEngine is built too.

Rollout data parallelism (`replicated_generate`, also used by a standalone rollout pool): vLLM's TP
groups are consecutive blocks of `rollout.tp` global ranks, so the world holds world/rollout_tp
replicas (megatron DP replicas and pipeline stages alike); replica k generates chunk k of the prompts,
with the call's seed offset by the chunk's first row (sampling does not depend on the replica count). Metrics (logged every step):
rollout/weights_fingerprint_ok, rollout/logprob_diff_mean, rollout/logprob_diff_max,
rollout/token_mult_prob_error (mean over response tokens of exp|logp_vllm - logp_megatron|),
timing/weight_sync_s, timing/rollout_s.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megappo.parallel import device
from megappo.models.lora import base_named_parameters, lazily_merged_named_parameters
from megappo.models.lora_peft import gather_hf_lora
from megappo.workers.role_batches import model_keys
from megappo.parallel.model_dims import VISION_PREFIX
from megappo.parallel.resharding import Resharder
from megappo.protocol import DataProto
from megappo.utils.checkpoint import rng_state, set_rng_state
from megappo.workers.rollout.adapter_dirs import AdapterDirs
from megappo.workers.rollout.fingerprint import compare, tensor_fingerprint_on_device, tolerance_for, \
    with_tied_head


class WeightSyncError(RuntimeError):
    """The weights vLLM holds after a sync differ from the trainer's."""


class HybridEngine:
    def __init__(self, engine, rollout, bucket_mb: Optional[int] = None, check_fingerprint: bool = True,
                 transport: str = "auto"):
        self.engine = engine
        self.rollout = rollout
        cfg = rollout.config
        mb = bucket_mb if bucket_mb is not None else cfg.weight_sync_bucket_mb
        # rollout.lora_sync=adapter: vLLM keeps the base it loaded from model.path (the actor's frozen base)
        # and samples with the adapters, sent as a peft dir at every sync; else every weight, adapters merged
        self.adapter_sync = getattr(engine, "lora", None) is not None and getattr(cfg, "lora_sync", "") == "adapter"
        self.adapter_dirs = AdapterDirs()
        self.resharder = Resharder(engine.inner_chunks(), engine.dims, engine.layout, rollout_tp=rollout.tp,
                                   bucket_bytes=int(mb * (1 << 20)),
                                   fingerprint_fn=tensor_fingerprint_on_device if check_fingerprint else None,
                                   transport=transport,
                                   named_weights=base_named_parameters if self.adapter_sync
                                   else lazily_merged_named_parameters)  # LoRA: merged when read
        self.check_fingerprint = check_fingerprint
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.replica = self.rank // rollout.tp
        self.num_replicas = self.world // rollout.tp
        self.metrics: dict = {}
        self._rng = None
        self.corrupt_hook: Optional[Callable] = None  # tests: modify a bucket after fingerprinting
        # a new vLLM engine starts awake, holding its weights and KV cache: put it to sleep now, or the
        # first rollout's weight sync would find the actor's weights and vLLM's whole footprint resident
        self.rollout.sleep()

    # ---- weights ---------------------------------------------------------------------------------

    def sync_weights(self) -> dict:
        """Stream the trainer's weights into vLLM (collective over the actor world)."""
        if self.adapter_sync:
            return self._sync_adapter()
        t0 = time.perf_counter()
        with self._resident():  # an offloaded actor comes back for the sync only
            for bucket in self.resharder.buckets(corrupt=self.corrupt_hook):
                self.rollout.load_weights(bucket.tensors, reset_prefix_cache=False)
        self.rollout.reset_prefix_cache()
        sync_s = time.perf_counter() - t0
        m = {"timing/weight_sync_s": sync_s,
             "rollout/weight_sync_bytes_received": float(self.resharder.stats.get("bytes_received", 0)),
             "rollout/weight_sync_buckets": float(self.resharder.num_buckets),
             "rollout/weight_sync_shm": float(self.resharder.transport == "shm")}
        self._check_fingerprints(m)
        self.metrics.update(m)
        return m

    def _sync_adapter(self) -> dict:
        """rollout.lora_sync=adapter: every rank gathers the whole adapter (r x (in + out) per linear), writes
        it as a peft dir on tmpfs and has its vLLM engine sample with it (a new LoRARequest). The base is
        streamed once, to fingerprint it (vLLM loaded it from model.path; nothing is loaded into vLLM),
        and vLLM's copy is fingerprinted against that at every sync."""
        t0 = time.perf_counter()
        with self._resident():  # an offloaded actor's params (adapters too) come back for the sync only
            if self.adapter_dirs.version == 0 and self.check_fingerprint:
                self.resharder.fingerprints()  # the base's, kept as expected_fingerprints for every later check
            adapter = gather_hf_lora(self.engine.inner_chunks(), self.engine.dims, everywhere=True)
        path = self.adapter_dirs.write(adapter, self.engine.lora, self.engine.model_path)
        self.rollout.load_adapter(path, self.adapter_dirs.version)
        m = {"timing/weight_sync_s": time.perf_counter() - t0,
             "rollout/weight_sync_bytes_received": float(sum(a.nbytes + b.nbytes for a, b in adapter.values())),
             "rollout/lora_adapter_version": float(self.adapter_dirs.version)}
        self._check_fingerprints(m)
        self.metrics.update(m)
        return m

    def close(self) -> None:
        """Remove this process's adapter dir (rollout.lora_sync=adapter): /dev/shm is memory."""
        self.adapter_dirs.close()

    def _check_fingerprints(self, m: dict) -> None:
        """vLLM's weights against the trainer's (the last streamed buckets' fingerprints): a mismatch on any
        rank raises WeightSyncError on every rank."""
        if self.check_fingerprint:
            expected = with_tied_head(self.resharder.expected_fingerprints, self.engine.dims.tied_embeddings)
            held = self.rollout.fingerprint()
            bad = compare(expected, held, tolerance_for(self.rollout.weights_dtype))
            ok = torch.tensor([0 if bad else 1], dtype=torch.int32, device="cpu")
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            m["rollout/weights_fingerprint_ok"] = float(ok.item())
            if self.engine.dims.vision:  # the vision tower's tensors among the compared (parallel/model_dims.py)
                m["rollout/weights_fingerprint_vision_tensors"] = float(sum(n.startswith(VISION_PREFIX) for n in expected))
            if bad:
                raise WeightSyncError(
                    f"rank {self.rank}: weights held by vLLM differ from the trainer's after the sync "
                    f"({len(bad)} tensor(s)): " + "; ".join(bad[:5]))
            if not ok.item():
                raise WeightSyncError(f"rank {self.rank}: weight fingerprint mismatch on another rank")

    def _resident(self):
        """The actor's weights only (not its optimizer, not its grad buffers) on the device for a sync."""
        resident = getattr(self.engine, "resident", None)
        return resident(parts=["params"]) if resident is not None else contextlib.nullcontext()

    # ---- context manager ------------------------------------------------------------------------

    def __enter__(self) -> "HybridEngine":
        self._rng = rng_state()
        self.metrics = {}
        try:
            self.rollout.wake_up(tags=["weights"])
            self.sync_weights()
            self.rollout.wake_up(tags=["kv_cache"])
        except BaseException:
            set_rng_state(self._rng)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.rollout.sleep()
            if device.on_gpu():
                torch.cuda.empty_cache()
        finally:
            set_rng_state(self._rng)

    # ---- generation -----------------------------------------------------------------------------

    def generate_sequences(self, prompts: DataProto, gather: bool = True) -> DataProto:
        """Every rank passes the same full prompt batch; replica k generates chunk k. gather=True:
        every rank returns the whole output (replicas' chunks in order), else only its own chunk."""
        t0 = time.perf_counter()
        out = replicated_generate(self.rollout, prompts, gather=gather)
        self.metrics["timing/rollout_s"] = time.perf_counter() - t0
        return out


    # ---- parity ---------------------------------------------------------------------------------

    @torch.no_grad()
    def logprob_parity(self, out: DataProto, micro_batch_size: int = 4) -> dict:
        """Megatron's log-probs of the generated tokens (same temperature) vs vLLM's. `out` is the
        full (gathered) rollout on every rank; each megatron DP rank scores its chunk. Collective."""
        layout = self.engine.layout
        # an interleaved pipeline runs a multiple of pp micro-batches; padding rows are not counted
        padded, _ = out.pad_to_divisor(layout.dp * micro_batch_size * (layout.pp if layout.virtual_pp else 1))
        mine = padded.chunk(layout.dp)[self.engine.dp_rank]
        n_real = len(out)
        R = mine.batch["responses"].shape[1]
        temperature = float(out.meta_info["sampling"].logprob_temperature)
        batch = {k: mine.batch[k] for k in model_keys(mine)}  # a vision-language rollout's rows carry their images
        res = self.engine.forward_only(batch, response_length=R, micro_batch_size=micro_batch_size,
                                       temperature=temperature, compute_entropy=False)
        vec = torch.zeros(3, dtype=torch.float64, device="cpu")  # sum |d|, count, sum exp|d| (over gloo)
        mx = torch.zeros(1, dtype=torch.float64, device="cpu")
        if res is not None and self.engine.tp_rank == 0 and self.engine.cp_rank == 0:  # one rank per DP replica
            per = len(mine)
            start = self.engine.dp_rank * per
            keep = torch.arange(start, start + per, device="cpu") < n_real  # drop the padding rows
            mask = mine.batch["response_mask"].bool() & keep.unsqueeze(1)
            d = (res["logprobs"].cpu().double() - mine.batch["rollout_log_probs"].double()).abs()[mask]
            vec += torch.tensor([d.sum().item(), float(d.numel()), torch.exp(d).sum().item()], dtype=torch.float64,
                                device="cpu")
            if d.numel():
                mx[0] = d.max()
            self.last_megatron_logprobs = res["logprobs"].cpu()
        dist.all_reduce(vec)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        cnt = max(vec[1].item(), 1.0)
        m = {"rollout/logprob_diff_mean": vec[0].item() / cnt, "rollout/logprob_diff_max": mx.item(),
             "rollout/token_mult_prob_error": vec[2].item() / cnt}
        self.metrics.update(m)
        return m


def replicated_generate(rollout, prompts: DataProto, gather: bool = True) -> DataProto:
    """Data-parallel generation over the replicas of this process group (consecutive blocks of
    `rollout.tp` ranks form one vLLM replica): every rank passes the same full batch, replica k
    generates chunk k. A `seed` in meta_info is offset by the chunk's first row, so request i of the
    whole batch is always sampled with seed + i * n + j, whatever the number of replicas.
    Without torch.distributed (one standalone engine) this is a plain generate."""
    if not (dist.is_available() and dist.is_initialized()):
        return rollout.generate_sequences(prompts)
    world, rank = dist.get_world_size(), dist.get_rank()
    num_replicas, replica = world // rollout.tp, rank // rollout.tp
    padded, pad = prompts.pad_to_divisor(num_replicas)
    if pad:  # a padding prompt's rows (later segments' too: assemble repeats every non-tensor) are dropped below
        padded.non_tensor_batch["_padding"] = np.arange(len(padded)) >= len(prompts)
    mine = padded.chunk(num_replicas)[replica]
    spec = prompts.meta_info.get("sampling") or rollout.default_sampling
    if spec.seed is not None:
        mine.meta_info["sampling"] = spec.with_seed(spec.seed + replica * len(mine) * spec.num_samples)
    out = rollout.generate_sequences(mine)
    if gather and num_replicas > 1:
        parts = [None] * world
        dist.all_gather_object(parts, out if rank % rollout.tp == 0 else None)
        from megappo.workers.rollout.vllm_rollout import left_pad_prompts

        # replicas' prompt widths differ where an agent sent its own prompt (rollout.agent): to the widest
        out = DataProto.concat(left_pad_prompts([p for p in parts if p is not None], rollout.pad_token_id))
    if pad:
        keep = ~np.asarray(out.non_tensor_batch.pop("_padding"), dtype=bool)
        out = out[np.nonzero(keep)[0]]
    return out
