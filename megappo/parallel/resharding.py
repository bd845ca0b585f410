"""Megatron shards (TP / PP / VPP) -> HF-named tensors, streamed in bounded buckets (the hybrid
engine feeds each bucket into this rank's vLLM engine). Every name and layout conversion goes
through parallel/weight_mapping.py (`hf_names`, `megatron_shards_to_hf`, `tp_split_dim`).

    rs = Resharder(chunks, dims, layout, rollout_tp=1, bucket_bytes=256 << 20)
    for bucket in rs.buckets():          # COLLECTIVE: every rank iterates the same buckets in lockstep
        vllm_load(bucket.tensors)        # [(hf_name, tensor), ...]: fused groups kept together
    rs.expected_fingerprints             # {hf_name: (fp, scale)} of the trainer's weights (all ranks)
    rs.fingerprints()                    # the same, the buckets built and dropped (a sampler holding them)
    rs.stats                             # bytes received per rank, buckets, seconds

Plan (computed once from metadata all-gathered over the pipeline group):
- units: one megatron MODULE (its weight and bias together), so fused groups never split:
  linear_qkv -> q,k,v (+ biases), linear_fc1 -> gate,up. Units are packed in model order into
  buckets of at most `bucket_bytes` (HF bytes; a unit larger than that gets a bucket of its own).
  Collective transport: a bucket never spans two pipeline stages (its owning stage broadcasts it).
  Shared-memory transport: the stages' units are interleaved, so a bucket holds units of every
  stage and all stages write their parts at once (one barrier per bucket for the whole model).
- per bucket, on the owning stage: one all-gather over the TP group of the bucket's shards (flat),
  `megatron_shards_to_hf` -> HF tensors written into one flat buffer; then one broadcast of that
  buffer over the pipeline group, so every stage's vLLM gets it (PP stages are extra DP replicas at
  rollout). Without PP nothing is shipped: the HF tensors are yielded as they come out of
  `megatron_shards_to_hf(copy=False)`, views of the local shards (or of the TP gather) wherever the
  layout allows, so a consumer must only read them. DP replicas of the trainer hold identical
  weights and each does the same independently.
- "sliced" mode (train TP == rollout TP): vLLM's TP rank r only reads the rows/columns that
  megatron's TP rank r already holds (same head groups, same gate/up halves, same row-parallel
  columns), so those units skip the TP all-gather: each rank ships (over PP) and loads only its own
  shard, placed into a zero HF tensor via `megatron_shards_to_hf` (zeros for the other ranks'
  shards: vLLM never reads them). Vocab-parallel tensors are still gathered (megatron pads the vocab
  to a multiple of lcm(128, TP), vLLM to 64, so the row boundaries differ).
- transport "shm" (default when every rank is on one host and the weights are on CPU): instead of
  the TP all-gather and the PP broadcast, the owning stage's ranks write their shards once into a
  node-wide shared-memory slot, each straight into its place in the full HF tensors, and every rank
  hands views of the slot to vLLM (see `_shm_bucket`). "collective" (GPU,
  or ranks on several hosts): the all-gather / broadcast path above.
- memory: besides its own shards a rank holds one bucket at a time: its flat broadcast buffer, plus
  on the owning stage the TP gather buffer and the HF tensors of one megatron param while they are
  copied in (`stats["peak_bucket_bytes"]`). The caller must finish with a bucket before the next.

Fingerprints (`fingerprint_fn`, e.g. workers/rollout/fingerprint.tensor_fingerprint: linear in
the tensor, so zero-padded slices add up to the full value) are taken on the owning stage from the
weights BEFORE they are packed and shipped (shm: from the slot right after the owners wrote it), and
summed over the world (only one rank of each DP replica group contributes), so a bucket corrupted
after that point does not match what vLLM ends up holding. A `fingerprint_fn` may leave its (value, scale)
on the device as a tensor [2] (fingerprint.tensor_fingerprint_on_device): a bucket's are then read back
with one device-to-host copy (a MoE model has thousands of expert tensors per sync).

Split by responsibility: this file is the Resharder (its set-up and `buckets()`: the fingerprints and stats
of a sync), the plan is reshard_plan.py, the two transports reshard_transport.py (both mixed into it).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megappo.parallel.layout import ParallelLayout, sliced_sync
from megappo.parallel.reshard_plan import ReshardPlan, _Param
from megappo.parallel.reshard_transport import CollectiveTransport, ShmTransport, _ShmSlots, _shm_free_bytes, \
    choose_transport
from megappo.parallel.weight_mapping import ModelDims, global_named_parameters, hf_names, ROUTER_BIAS


@dataclass
class Bucket:
    index: int
    stage: int  # -1: several stages
    tensors: list  # [(hf_name, tensor)]
    nbytes: int


class Resharder(ReshardPlan, ShmTransport, CollectiveTransport):
    def __init__(self, chunks: list, dims: ModelDims, layout: ParallelLayout, rollout_tp: int,
                 bucket_bytes: int = 256 << 20, dtype: Optional[torch.dtype] = None,
                 fingerprint_fn: Optional[Callable[[torch.Tensor], Any]] = None, transport: str = "auto",
                 named_weights: Optional[Callable[[list], Iterable[tuple[str, torch.Tensor]]]] = None):
        """`named_weights(chunks)`: (global megatron name, tensor) of what to send, read at every sync; default
        every parameter (weight_mapping.global_named_parameters); a LoRA actor passes
        models/lora.lazily_merged_named_parameters (the adapted linears merged when read, the adapters left
        out: any value with shape, dtype, device, numel() and detach() -> tensor will do)."""
        from megatron.core import parallel_state as mpu

        self.chunks, self.dims, self.layout = chunks, dims, layout
        self.named_weights = named_weights or _all_parameters
        self.rollout_tp = int(rollout_tp)
        self.bucket_bytes = int(bucket_bytes)
        self.fingerprint_fn = fingerprint_fn  # HF tensor -> (value, scale) or a tensor [2]; linear in the tensor
        self.fingerprint = fingerprint_fn is not None
        self.world = dist.get_world_size()
        if self.world % self.rollout_tp:
            raise ValueError(f"rollout tp={self.rollout_tp} must divide the actor world size {self.world}")
        self.sliced = sliced_sync(layout.tp, self.rollout_tp)
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        # the rank among the replicas holding the same weights: data parallel x context parallel (a cp rank holds
        # its replica's whole weights), so exactly one replica writes and fingerprints each weight
        self.dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group) if layout.pp > 1 else [dist.get_rank()]
        # expert parallel: an EP rank holds E/ep of every MoE layer's experts; its expert-data-parallel
        # replicas (dp/ep of them) hold the same ones
        self.ep = layout.ep
        self.ep_rank = mpu.get_expert_model_parallel_rank() if self.ep > 1 else 0
        self.edp_rank = mpu.get_expert_data_parallel_rank() if self.ep > 1 else self.dp_rank
        self.ep_group = mpu.get_expert_model_parallel_group() if self.ep > 1 else None
        self._borrowed: dict = {}  # collective transport: other EP ranks' experts of the current bucket

        # this rank's params by global name (tied output layer: the embedding is the one sent)
        self._local = self._collect()
        # one transfer dtype: the one most elements have (bf16 mixed precision keeps a few params, e.g.
        # norms of the local spec, in fp32; they travel cast, as vLLM holds them in its dtype anyway)
        by_dtype: dict = {}
        for p in self._local.values():
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        self.dtype = dtype or max(by_dtype, key=by_dtype.get)
        self.elem = torch.empty(0, dtype=self.dtype, device="cpu").element_size()  # bytes per transferred element
        self.device = next(iter(self._local.values())).device  # transfer buffers live here (nccl on GPU)
        meta = [(n, tuple(p.shape)) for n, p in self._local.items()]
        per_stage, owners = self._stage_meta(meta)
        units = self._stage_units(per_stage, owners)
        self._plan = self._make_plan(units, interleave=False)
        self.expected_fingerprints: dict = {}
        self.stats: dict = {}
        if transport not in ("auto", "shm", "collective"):
            raise ValueError(f"transport must be auto, shm or collective, got {transport!r}")
        self._shm = None
        self._shm_seq = 0  # buckets ever shipped through shm: consecutive buckets alternate slots
        # TP1 x PP1 (dense or EP1): every rank holds the whole model, nothing to move
        if transport != "collective" and (layout.tp > 1 or layout.pp > 1 or self.ep > 1):
            info = [None] * self.world  # decided together: every rank takes the same branch
            dist.all_gather_object(info, (socket.gethostname(), _shm_free_bytes()))
            shm_plan = self._make_plan(units, interleave=True)
            layouts = [self._slot_layout(b) for b in shm_plan]
            slot_bytes = max(total for _, total in layouts)
            if choose_transport(transport, info, self.device.type == "cpu", slot_bytes) == "shm":
                self._shm = _ShmSlots(slot_bytes)
                self._plan = shm_plan
                self._slot_layouts = layouts  # per bucket, fixed for the resharder's life
        self.transport = "shm" if self._shm is not None else "collective"

    def _collect(self) -> dict:
        """This rank's (global name -> shard) to send, read again at every sync (`named_weights`: with LoRA
        each adapted linear's weight merged now, the adapters left out). The tied output layer: the
        embedding is the one sent."""
        return {name: p for name, p in self.named_weights(self.chunks)
                if not (name == "output_layer.weight" and self.dims.tied_embeddings)}

    def fingerprints(self) -> dict:
        """Every bucket built and dropped (collective): the fingerprints of the weights as they are now, for a
        sampler that holds them already (rollout.lora_sync=adapter: vLLM's base, loaded from model.path)."""
        for _ in self.buckets():
            pass
        return self.expected_fingerprints

    @torch.no_grad()
    def buckets(self, corrupt: Optional[Callable[[Bucket], None]] = None) -> Iterator[Bucket]:
        """Yield every bucket on every rank (collective). `corrupt(bucket)` is a test hook that may
        modify a bucket's tensors after the fingerprints were taken (simulating corruption in flight)."""
        t0 = time.perf_counter()
        self._local = self._collect()  # the same names and shapes; a LoRA engine's freshly merged values
        names = self.hf_name_list()
        index = {n: i for i, n in enumerate(names)}
        fp = torch.zeros(2 * len(names), dtype=torch.float64, device="cpu")
        elem = self.elem
        # comm_s: TP all-gathers, PP broadcasts, shm writes + barrier; consumer_s: in the caller's
        # hands (e.g. vLLM loading the bucket)
        self._run = {"broadcast_received": 0, "tp_gathered": 0, "shm_read": 0, "ep_received": 0, "comm_s": 0.0}
        consumer_s, peak = 0.0, 0

        pending: list = []  # (name index, (value, scale)) of the current bucket, read back at its end

        def add_fingerprints(p: _Param, hf: dict) -> None:
            pending.extend((index[n], self.fingerprint_fn(hf[n])) for n in p.hf)

        def read_fingerprints() -> None:
            """fp += the bucket's fingerprints, in the order taken; values left on a device come back in one
            copy per device (not one synchronising read per tensor)."""
            on_device: dict = {}
            for j, (_, v) in enumerate(pending):
                if isinstance(v, torch.Tensor):
                    on_device.setdefault(v.device, []).append(j)
            vals = [v for _, v in pending]
            for js in on_device.values():
                for j, pair in zip(js, torch.stack([pending[j][1] for j in js]).tolist()):
                    vals[j] = pair
            for (i, _), (v, sc) in zip(pending, vals):
                fp[i] += v
                fp[len(names) + i] += sc
            pending.clear()

        add = add_fingerprints if self.fingerprint else None
        for bi, b in enumerate(self._plan):
            if self._shm is not None:
                tensors, buffer_bytes = self._shm_tensors(bi, add)
            else:
                tensors, buffer_bytes = self._collective_tensors(b, add)
            read_fingerprints()
            nbytes = sum(t.numel() for _, t in tensors) * elem
            peak = max(peak, nbytes + buffer_bytes)
            if corrupt is not None:  # the hook edits copies: the trainer's weights / the slot stay intact
                tensors = [(n, t.clone()) for n, t in tensors]
            bucket = Bucket(bi, b.stage, tensors, nbytes)
            if corrupt is not None:
                corrupt(bucket)
            t_y = time.perf_counter()
            yield bucket
            consumer_s += time.perf_counter() - t_y
            del tensors, bucket
        exact = self._exact_tensors()
        if exact:  # after the rounded copies the buckets carried: vLLM keeps these values
            t_y = time.perf_counter()
            yield Bucket(len(self._plan), -1, exact, sum(t.numel() * t.element_size() for _, t in exact))
            consumer_s += time.perf_counter() - t_y
        if self.fingerprint:
            dist.all_reduce(fp)
            k = len(names)
            self.expected_fingerprints = {n: (float(fp[i]), float(fp[k + i])) for i, n in enumerate(names)}
            for n, t in exact:  # what vLLM keeps: the full-precision values (the same on every rank), not the rounded
                self.expected_fingerprints[n] = tuple(float(x) for x in torch.as_tensor(self.fingerprint_fn(t)).tolist())
        run = self._run
        self.stats = {"buckets": len(self._plan), "transport": self.transport, "sliced": self.sliced,
                      "bytes_received": run["broadcast_received"] + run["tp_gathered"] + run["shm_read"]
                      + run["ep_received"], "bytes_ep_received": run["ep_received"],
                      "bytes_broadcast_received": run["broadcast_received"], "bytes_tp_gathered": run["tp_gathered"],
                      "bytes_shm_read": run["shm_read"], "seconds": time.perf_counter() - t0,
                      "peak_bucket_bytes": peak, "comm_s": run["comm_s"], "consumer_s": consumer_s}

    def _exact_tensors(self) -> list:
        """The routers' fp32 correction biases (GLM-4.5, DeepSeek-V3) at full precision, when the buckets travel
        in 16 bits: a bf16 transfer rounds them by ~4e-3, and vLLM routes with its fp32 copy; a few KiB, so one
        last bucket gathered from their owners (collective over the actor world)."""
        if not self.dims.expert_bias or self.dtype == torch.float32:
            return []
        mine = {}
        if self.tp_rank == 0 and self.dp_rank == 0:  # replicated over TP, DP and EP: one copy per pipeline stage
            mine = {hf_names(n, self.dims)[0]: t.detach().to("cpu", torch.float32)
                    for n, t in self._local.items() if n.endswith(ROUTER_BIAS)}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        merged = {k: v for d in everyone for k, v in d.items()}
        return [(n, merged[n].to(self.device)) for n in sorted(merged)]


def _all_parameters(chunks: list) -> Iterable[tuple[str, torch.Tensor]]:
    """(global name, tensor) of every parameter of the chunks."""
    for chunk in chunks:
        yield from global_named_parameters(chunk)
