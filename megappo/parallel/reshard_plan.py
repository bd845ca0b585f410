"""The resharder's plan (parallel/resharding.py's docstring has the whole design): each megatron param of the
model (its TP shard shape, gathered or sliced, its HF names and full shapes, its pipeline stage and EP owner),
grouped in units (one megatron module, so fused groups never split) and packed in model order into buckets
of at most `bucket_bytes`. Computed once from metadata all-gathered over the pipeline group (and, at EP > 1,
the world); mixed into Resharder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megappo.parallel.weight_mapping import hf_names, megatron_shards_to_hf, routed_expert, tp_split_dim, \
    whole_in_rollout


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


def _module_key(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class ReshardPlan:
    """The plan, made once in Resharder.__init__ from every stage's (name, shard shape): units in model order
    packed into buckets (`_make_plan`), either stage by stage (collective) or the stages interleaved (shm)."""

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
