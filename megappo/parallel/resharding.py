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
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megappo.parallel.layout import ParallelLayout
from megappo.parallel.weight_mapping import ModelDims, global_named_parameters, hf_names, megatron_shard_hf_slices, \
    megatron_shards_to_hf, routed_expert, tp_split_dim, whole_in_rollout, ROUTER_BIAS


@dataclass
class _Param:
    name: str  # global megatron name
    shape: tuple  # this TP rank's shard shape
    gather: bool  # TP all-gather it (else: sliced, own shard only)
    tp_dim: Optional[int]  # the split dim (None: replicated)
    hf: list  # HF names it maps to
    hf_shapes: list  # full HF shapes
    stage: int = 0  # the pipeline stage that holds it
    ep_owner: Optional[int] = None  # routed expert: the expert-parallel rank that holds it (None: every rank)


@dataclass
class _Bucket:
    stage: int  # owning pipeline stage; -1: units of several stages (shm transport)
    params: list = field(default_factory=list)


@dataclass
class Bucket:
    index: int
    stage: int  # -1: several stages
    tensors: list  # [(hf_name, tensor)]
    nbytes: int


def _module_key(name: str) -> str:
    return name.rsplit(".", 1)[0]


class Resharder:
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
        self.sliced = self.rollout_tp == layout.tp and layout.tp > 1
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.dp_rank = mpu.get_data_parallel_rank()
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

    # ---- plan ------------------------------------------------------------------------------------

    def _stage_meta(self, meta: list) -> tuple[list, dict]:
        """Per pipeline stage, every (name, shard shape) it holds in model order, and the owning EP
        rank of each routed expert's param. At EP > 1 the ranks of one stage hold different experts, so
        the stage's list is the union over its EP ranks (their dense params are the same)."""
        if self.ep == 1:
            per_stage = [None] * self.layout.pp
            if self.layout.pp > 1:
                dist.all_gather_object(per_stage, meta, group=self.pp_group)
            else:
                per_stage = [meta]
            return per_stage, {}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, (self.pp_rank, self.tp_rank, self.ep_rank, meta))
        per_stage, owners = [], {}
        for stage in range(self.layout.pp):
            lists = {ep: m for pp, tp, ep, m in everyone if pp == stage and tp == 0}
            merged, seen = [], set()
            for i in range(max(len(m) for m in lists.values())):  # dense params sit at the same positions
                for ep in sorted(lists):
                    if i < len(lists[ep]) and lists[ep][i][0] not in seen:
                        seen.add(lists[ep][i][0])
                        merged.append(lists[ep][i])
                        if routed_expert(lists[ep][i][0]) is not None:
                            owners[lists[ep][i][0]] = ep
            per_stage.append(merged)
        return per_stage, owners

    def _param(self, name: str, shape: tuple, stage: int) -> _Param:
        d = self.dims
        dim = tp_split_dim(name, d)
        vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight") and not d.value_head
        gather = self.layout.tp > 1 and dim is not None and (not self.sliced or vocab or whole_in_rollout(name, d))
        hfn = hf_names(name, d)
        # full HF shapes, from the shard shape and weight_mapping's own conversion
        zeros = [torch.empty(shape, dtype=torch.float32, device="meta")] * (self.layout.tp if dim is not None else 1)
        hf = megatron_shards_to_hf(name, zeros, d) if dim is not None else {hfn[0]: zeros[0]}
        return _Param(name, shape, gather, dim, hfn, [tuple(hf[n].shape) for n in hfn], stage)

    def _stage_units(self, per_stage, owners: dict) -> list[list[list[_Param]]]:
        """Per pipeline stage, its units (one megatron module's params) in model order."""
        out = []
        for stage, meta in enumerate(per_stage):
            units: dict[str, list[_Param]] = {}
            for name, shape in meta:
                p = self._param(name, shape, stage)
                p.ep_owner = owners.get(name)
                units.setdefault(_module_key(name), []).append(p)
            out.append(list(units.values()))
        return out

    def _make_plan(self, per_stage_units, interleave: bool) -> list[_Bucket]:
        """Units in model order packed into buckets of at most bucket_bytes. interleave=False: stage
        by stage (a bucket has one owner); True: the stages' unit lists taken in turn."""
        elem = self.elem
        if interleave:
            longest = max(len(u) for u in per_stage_units)
            order = [[u[i] for u in per_stage_units if i < len(u)] for i in range(longest)]
            streams = [[unit for turn in order for unit in turn]]
        else:
            streams = per_stage_units
        buckets: list[_Bucket] = []
        for units in streams:
            cur, cur_bytes = None, 0
            for unit in units:
                ub = sum(sum(_numel(s) for s in p.hf_shapes) for p in unit) * elem
                if cur is None or (cur_bytes + ub > self.bucket_bytes and cur.params):
                    cur, cur_bytes = _Bucket(unit[0].stage), 0
                    buckets.append(cur)
                cur.params.extend(unit)
                cur_bytes += ub
                if cur.stage != unit[0].stage:
                    cur.stage = -1
        return buckets

    @property
    def num_buckets(self) -> int:
        return len(self._plan)

    def hf_name_list(self) -> list[str]:
        return [n for b in self._plan for p in b.params for n in p.hf]

    # ---- shared-memory transport (every rank on one host, CPU) ----------------------------------
    # A bucket's slot holds its FULL HF tensors, in plan order (units of every stage). The DP-rank-0
    # ranks of a param's stage each write their own shard straight into its place there
    # (`megatron_shard_hf_slices`: q/k/v rows of its query groups, its gate/up rows, its row-parallel
    # columns, its vocab rows; a replicated param by TP rank 0), one barrier, then every rank hands views of the slot to vLLM:
    # the conversion happens once per node, split over the TP ranks, and no rank gathers anything.
    # Two slots alternate, so writing bucket k+1 (after the barrier of bucket k, which every rank
    # enters only once done with bucket k-1) never overwrites a slot someone still reads.

    def _slot_layout(self, b: _Bucket) -> tuple[list, int]:
        """[(param, [(hf_name, byte offset, shape)])], total bytes of the bucket's slot."""
        elem = self.elem
        out, off = [], 0
        for p in b.params:
            entries = []
            for n, shape in zip(p.hf, p.hf_shapes):
                entries.append((n, off, shape))
                off += _numel(shape) * elem
            out.append((p, entries))
        return out, off

    def _shm_bucket(self, bi: int) -> tuple[list, int]:
        """Write this rank's shards of bucket `bi` into the next slot, barrier, and return the bucket's
        HF tensors as views of the slot [(param, {hf_name: tensor})], plus the bytes others wrote."""
        layout, total = self._slot_layouts[bi]
        slot = self._shm.slot(self._shm_seq % 2, total)
        self._shm_seq += 1
        elem = self.elem
        written = 0
        out = []
        for p, entries in layout:
            hf = {n: slot[off: off + _numel(shape) * elem].view(self.dtype).view(shape) for n, off, shape in entries}
            split = p.tp_dim is not None and self.layout.tp > 1
            if self._writer(p) and (split or self.tp_rank == 0):
                shard = self._local[p.name].detach()
                for n, idx, values in megatron_shard_hf_slices(p.name, shard, self.dims, self.tp_rank,
                                                               self.layout.tp if split else 1):
                    dst = hf[n][idx]
                    (dst if dst.shape == values.shape else dst.view(values.shape)).copy_(values)
                    written += values.numel() * elem
            out.append((p, hf))
        dist.barrier()
        return out, total - written

    def _writer(self, p: _Param) -> bool:
        """This rank writes its shard of `p`: it holds it (its stage; a routed expert: its EP rank) and
        is the first of the replicas holding the same (data parallel rank 0; an expert: expert-DP 0)."""
        if p.stage != self.pp_rank:
            return False
        if p.ep_owner is None:
            return self.dp_rank == 0
        return p.ep_owner == self.ep_rank and self.edp_rank == 0

    def _shard(self, name: str) -> torch.Tensor:
        """This rank's shard of a param: its own, or (collective, EP > 1) the bucket's experts as broadcast over
        the EP group (its own experts too: read once, for the broadcast)."""
        t = self._borrowed.get(name)
        return t if t is not None else self._local[name].detach()

    def _borrow_experts(self, b: _Bucket) -> None:
        """Collective transport at EP > 1: each EP rank broadcasts the bucket's experts it holds over the
        expert-parallel group (one flat buffer per EP rank), so every rank of the owning stage then has
        every expert shard of the bucket (and only of this bucket) for the TP gather and the PP broadcast."""
        self._borrowed = {}  # called on the bucket's (one) owning stage only
        if self.ep == 1:
            return
        for k in range(self.ep):
            todo = [p for p in b.params if p.ep_owner == k]
            if not todo:
                continue
            sizes = [_numel(p.shape) for p in todo]
            if k == self.ep_rank:
                flat = torch.cat([self._local[p.name].detach().reshape(-1).to(self.dtype) for p in todo])
            else:
                flat = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
            dist.broadcast(flat, src=dist.get_global_rank(self.ep_group, k), group=self.ep_group)
            if k != self.ep_rank:
                self._run["ep_received"] += flat.numel() * self.elem
            # every EP rank's experts, this rank's own too, as views of the broadcast buffer: a shard is read
            # once per sync (a LoRA expert's MergedShard merges when read) and no second copy of it is held
            off = 0
            for p, n in zip(todo, sizes):
                self._borrowed[p.name] = flat[off:off + n].view(p.shape)
                off += n

    # ---- streaming -------------------------------------------------------------------------------

    def _ships_full(self, p: _Param) -> bool:
        return p.gather or p.tp_dim is None or self.layout.tp == 1

    def _shipped_numel(self, p: _Param) -> int:
        """What the owning stage broadcasts for this param: full HF tensors, or (sliced) the shard."""
        return sum(_numel(s) for s in p.hf_shapes) if self._ships_full(p) else _numel(p.shape)

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

    def _shm_tensors(self, bi: int, add_fingerprints) -> tuple[list, int]:
        """Bucket `bi` through the shared-memory slots: its full HF tensors (views of the slot)."""
        t_c = time.perf_counter()
        views, got = self._shm_bucket(bi)
        self._run["comm_s"] += time.perf_counter() - t_c
        self._run["shm_read"] += got
        tensors = []
        for p, hf in views:
            if add_fingerprints is not None and p.stage == self.pp_rank and self.dp_rank == 0 and self.tp_rank == 0:
                add_fingerprints(p, hf)
            tensors.extend((n, hf[n]) for n in p.hf)
        return tensors, 0

    def _collective_tensors(self, b: _Bucket, add_fingerprints) -> tuple[list, int]:
        """Bucket `b` through a TP all-gather on the owning stage and (pp > 1) one broadcast of the
        packed bucket over the pipeline group. Returns the HF tensors and the transfer buffer's bytes."""
        elem = self.elem
        owner = b.stage == self.pp_rank
        total = sum(self._shipped_numel(p) for p in b.params)
        # pp > 1: the owning stage packs the bucket into one flat buffer and broadcasts it over the
        # pipeline group. pp == 1: nothing to ship; the HF tensors are handed over as they are
        # (views of the shards where the layout allows: no copy before vLLM's own).
        flat = torch.empty(total, dtype=self.dtype, device=self.device) if self.layout.pp > 1 else None
        tensors = []
        if owner:
            t_g = time.perf_counter()
            self._borrow_experts(b)
            gathered = self._gather(b)
            self._run["comm_s"] += time.perf_counter() - t_g
            off = 0
            for p in b.params:
                if p.name in gathered:
                    hf, full = megatron_shards_to_hf(p.name, gathered[p.name], self.dims, copy=False), True
                else:
                    shard = self._shard(p.name)
                    hf = self._hf_view(p, shard)  # full tensors (tp 1 / replicated) or zero-padded
                    full = self._ships_full(p)
                if add_fingerprints is not None and self.dp_rank == 0 and (self.tp_rank == 0 or not full):
                    add_fingerprints(p, hf)
                if flat is None:
                    tensors.extend((n, hf[n].to(self.dtype)) for n in p.hf)  # no-op unless mixed (bf16 + fp32 norms)
                elif full:
                    for n in p.hf:
                        t = hf[n]
                        flat[off:off + t.numel()].view(t.shape).copy_(t)
                        off += t.numel()
                else:  # sliced: ship only this rank's shard
                    flat[off:off + shard.numel()].view(shard.shape).copy_(shard)
                    off += shard.numel()
                del hf
            del gathered
            self._borrowed = {}
        if flat is None:
            return tensors, 0
        t_comm = time.perf_counter()
        dist.broadcast(flat, src=self.pp_ranks[b.stage], group=self.pp_group)
        if not owner:
            self._run["broadcast_received"] += total * elem
        self._run["comm_s"] += time.perf_counter() - t_comm
        # unpack into HF tensors (views into `flat`, or zero-padded full tensors when sliced)
        off = 0
        for p in b.params:
            k = self._shipped_numel(p)
            seg = flat[off:off + k]
            off += k
            if self._ships_full(p):
                o2 = 0
                for n, s in zip(p.hf, p.hf_shapes):
                    tensors.append((n, seg[o2:o2 + _numel(s)].view(s)))
                    o2 += _numel(s)
            else:
                tensors.extend(self._hf_view(p, seg.view(p.shape)).items())
        return tensors, total * elem

    def _gather(self, b: _Bucket) -> dict[str, list[torch.Tensor]]:
        """One all-gather over the TP group for the bucket's gathered params -> {name: [shards]}."""
        todo = [p for p in b.params if p.gather]
        if not todo:
            return {}
        if self.layout.tp == 1:
            return {p.name: [self._shard(p.name)] for p in todo}
        sizes = [_numel(p.shape) for p in todo]
        send = torch.cat([self._shard(p.name).reshape(-1).to(self.dtype) for p in todo])
        recv = torch.empty(self.layout.tp * send.numel(), dtype=self.dtype, device=self.device)
        dist.all_gather_into_tensor(recv, send, group=self.tp_group)
        self._run["tp_gathered"] += (self.layout.tp - 1) * send.numel() * send.element_size()
        out, per = {}, send.numel()
        for r in range(self.layout.tp):
            off = r * per
            for p, k in zip(todo, sizes):
                out.setdefault(p.name, []).append(recv[off:off + k].view(p.shape))
                off += k
        return out

    def _hf_view(self, p: _Param, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF tensors that hold this rank's shard in place and zeros elsewhere (a replicated param is
        simply itself). Built with weight_mapping's conversion: the other ranks' shards are zeros."""
        if p.tp_dim is None or self.layout.tp == 1:
            return megatron_shards_to_hf(p.name, [shard], self.dims, copy=False)
        shards = [shard if r == self.tp_rank else torch.zeros_like(shard) for r in range(self.layout.tp)]
        return megatron_shards_to_hf(p.name, shards, self.dims, copy=False)


SHM_DIR = "/dev/shm"


def choose_transport(requested: str, ranks: list[tuple[str, int]], on_cpu: bool, slot_bytes: int) -> str:
    """"shm" or "collective" for `requested` in auto | shm | collective, from every rank's (host, free
    bytes in /dev/shm). shm needs one host, CPU weights and room for both slots plus 64 MiB: a tmpfs
    smaller than the slots (docker's default /dev/shm is 64 MB) would SIGBUS on write."""
    if requested == "collective":
        return "collective"
    free = min(f for _, f in ranks)
    need = 2 * slot_bytes + (64 << 20)
    ok = len({h for h, _ in ranks}) == 1 and on_cpu and free >= need
    if requested == "shm" and not ok:
        raise ValueError(f"transport=shm needs every rank on one host, CPU weights and {need >> 20} MiB free in "
                         f"{SHM_DIR} ({free >> 20} MiB free); lower rollout.weight_sync_bucket_mb or use "
                         f"transport=collective")
    if not ok and len({h for h, _ in ranks}) == 1 and on_cpu:
        logging.getLogger(__name__).warning(
            "weight sync: %s has %d MiB free, the shm transport needs %d MiB; using slower gloo collectives "
            "(give the container more shared memory, e.g. docker --shm-size=2g, or lower "
            "rollout.weight_sync_bucket_mb)", SHM_DIR, free >> 20, need >> 20)
    return "shm" if ok else "collective"


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _all_parameters(chunks: list) -> Iterable[tuple[str, torch.Tensor]]:
    """(global name, tensor) of every parameter of the chunks."""
    for chunk in chunks:
        yield from global_named_parameters(chunk)


class _ShmSlots:
    """Two slots of `slot_bytes` in one /dev/shm file mapped by every rank of the default group
    (collective to create; the file is unlinked once all have mapped it, so nothing is left behind)."""

    def __init__(self, slot_bytes: int):
        self.slot_bytes = max(int(slot_bytes), 1)
        name = [f"{SHM_DIR}/megappo-reshard-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(name, src=0)
        path = name[0]
        size = 2 * self.slot_bytes
        err = [None]
        if dist.get_rank() == 0:
            try:
                with open(path, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS later
            except OSError as e:
                err = [f"cannot reserve {size >> 20} MiB in {SHM_DIR} for the weight-sync slots ({e}); lower "
                       f"rollout.weight_sync_bucket_mb or free {SHM_DIR}"]
                if os.path.exists(path):
                    os.unlink(path)
        dist.broadcast_object_list(err, src=0)  # every rank raises the same error instead of hanging
        if err[0]:
            raise RuntimeError(err[0])
        self.buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        dist.barrier()
        if dist.get_rank() == 0:
            os.unlink(path)

    def slot(self, i: int, nbytes: int) -> torch.Tensor:
        return self.buf[i * self.slot_bytes: i * self.slot_bytes + nbytes]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
