"""How a bucket's tensors reach every rank of the actor world (parallel/resharding.py's docstring has the
whole design), mixed into Resharder:
- shared memory (`ShmTransport`, every rank on one host, CPU weights): the owning stage's ranks write their
  shards straight into their places in a node-wide /dev/shm slot (two alternate) and every rank hands views
  of it to vLLM; `choose_transport` decides, from every rank's host and free /dev/shm;
- collectives (`CollectiveTransport`): at EP > 1 the bucket's experts broadcast over the EP group, one TP
  all-gather of the gathered params, and at PP > 1 one broadcast of the packed bucket over the pipeline group.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import torch
import torch.distributed as dist

from megappo.parallel.reshard_plan import _Bucket, _numel, _Param
from megappo.parallel.weight_mapping import megatron_shard_hf_slices, megatron_shards_to_hf

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


class ShmTransport:
    """The shared-memory transport (every rank on one host, CPU).

    A bucket's slot holds its FULL HF tensors, in plan order (units of every stage). The DP-rank-0
    ranks of a param's stage each write their own shard straight into its place there
    (`megatron_shard_hf_slices`: q/k/v rows of its query groups, its gate/up rows, its row-parallel
    columns, its vocab rows; a replicated param by TP rank 0), one barrier, then every rank hands views
    of the slot to vLLM: the conversion happens once per node, split over the TP ranks, and no rank
    gathers anything. Two slots alternate, so writing bucket k+1 (after the barrier of bucket k, which
    every rank enters only once done with bucket k-1) never overwrites a slot someone still reads."""


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


class CollectiveTransport:
    """The collective transport (GPU weights, or ranks on several hosts): on the bucket's owning stage the EP
    broadcast of its experts and one TP all-gather, then (pp > 1) one broadcast of the packed bucket over the
    pipeline group."""

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

    def _ships_full(self, p: _Param) -> bool:
        return p.gather or p.tp_dim is None or self.layout.tp == 1

    def _shipped_numel(self, p: _Param) -> int:
        """What the owning stage broadcasts for this param: full HF tensors, or (sliced) the shard."""
        return sum(_numel(s) for s in p.hf_shapes) if self._ships_full(p) else _numel(p.shape)

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
