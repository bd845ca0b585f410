"""Resource pools (Ray placement groups) and the role -> pool mapping, verl-style.

    spec = {"global_pool": [4]}                       # pool name -> workers per node
    mapping = {"actor_rollout": "global_pool", "critic": "global_pool"}   # any hashable role keys
    mgr = ResourcePoolManager(spec, mapping)          # use_gpu=False: CPU bundles
    mgr.create_resource_pool()
    pool = mgr.get_resource_pool("critic")            # -> RayResourcePool

A RayResourcePool holds one placement group per node, one bundle per worker slot:
{"CPU": k} on CPU, {"GPU": 1, "CPU": k} on GPU. Its per-node groups sit on distinct Ray nodes: the
manager pins each to a node (Ray's `ray.io/node-id` label) chosen from what the nodes have left, so
consecutive ranks share a node (megatron's TP groups, the innermost, stay inside one) and a pool of
[8, 8, 8] really spans three machines. Roles that share a pool are COLOCATED: each role's
worker group is its own set of Ray actors placed on the same bundles, each asking for
1 / max_colocate_count of a bundle (max_colocate_count = the number of groups mapped to the pool).
Roles fused in one worker class (ActorRolloutRef) share one process instead.

A pool that cannot be placed (not enough CPUs/GPUs) raises WorkerError within `ready_timeout_s`,
naming the bundles asked for and what the cluster has; it never waits forever.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Hashable, Optional

__all__ = ["WorkerError", "Bundle", "RayResourcePool", "ResourcePoolManager"]


class WorkerError(RuntimeError):
    """A worker (or its placement) failed: dead process, call timeout, or resources that never came."""


@dataclass(frozen=True)
class Bundle:
    """One worker slot: bundle `index` of placement group `pg` (on node `node_id`)."""

    pg: object
    index: int
    node_id: str
    resources: tuple  # sorted (name, amount) pairs of the bundle


def _ray():
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialised: call ray.init() before creating resource pools")
    return ray


class RayResourcePool:
    """Placement groups for `process_on_nodes[i]` workers on node i (one bundle per worker)."""

    def __init__(self, process_on_nodes: list[int], use_gpu: bool = False, cpus_per_bundle: float = 1,
                 max_colocate_count: int = 1, name: str = "pool", ready_timeout_s: float = 60.0,
                 strategy: str = "STRICT_PACK", node_ids: Optional[list[str]] = None):
        if not process_on_nodes or any(int(n) < 1 for n in process_on_nodes):
            raise ValueError(f"pool {name!r}: process_on_nodes must list positive worker counts, "
                             f"got {process_on_nodes}")
        if max_colocate_count < 1:
            raise ValueError(f"pool {name!r}: max_colocate_count must be >= 1, got {max_colocate_count}")
        self.name = name
        self.process_on_nodes = [int(n) for n in process_on_nodes]
        self.use_gpu = use_gpu
        self.cpus_per_bundle = cpus_per_bundle
        self.max_colocate_count = max_colocate_count
        self.bundle_resources = {"CPU": cpus_per_bundle, **({"GPU": 1} if use_gpu else {})}
        if node_ids is not None and len(node_ids) != len(self.process_on_nodes):
            raise ValueError(f"pool {name!r}: {len(node_ids)} node ids for {len(self.process_on_nodes)} nodes")
        self.node_ids = node_ids  # the Ray node each per-node group is pinned to (None: Ray picks)
        self._pgs: list = []
        self.bundles: list[Bundle] = []
        self._create(ready_timeout_s, strategy)

    # ------------------------------------------------------------------ placement
    def _create(self, timeout_s: float, strategy: str) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group, placement_group_table

        run = uuid.uuid4().hex[:8]  # Ray's names are cluster-wide: two runs' pools (or a warm one) never clash
        for node, n in enumerate(self.process_on_nodes):
            pin = None if self.node_ids is None else [{"ray.io/node-id": self.node_ids[node]}] * n
            pg = placement_group([dict(self.bundle_resources) for _ in range(n)], strategy=strategy,
                                 name=f"megappo_{self.name}_node{node}_{run}", bundle_label_selector=pin)
            self._pgs.append(pg)
        try:
            ray.get([pg.ready() for pg in self._pgs], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise WorkerError(
                f"resource pool {self.name!r}: placement groups {self.process_on_nodes} x {self.bundle_resources} "
                f"not placed within {timeout_s:g}s; cluster total {_fmt(ray.cluster_resources())}, "
                f"available {_fmt(ray.available_resources())}"
            ) from None
        sorted_res = tuple(sorted(self.bundle_resources.items()))
        for pg in self._pgs:
            nodes = placement_group_table(pg).get("bundles_to_node_id", {})
            for i in range(pg.bundle_count):
                self.bundles.append(Bundle(pg, i, str(nodes.get(i, "?")), sorted_res))

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def single_node(self) -> bool:
        return len({b.node_id for b in self.bundles}) <= 1

    def worker_resources(self) -> dict:
        """Ray actor options for one worker of one of the `max_colocate_count` groups sharing a bundle."""
        share = 1.0 / self.max_colocate_count
        out = {"num_cpus": self.cpus_per_bundle * share}
        if self.use_gpu:
            out["num_gpus"] = share
        return out

    def remove(self) -> None:
        """Release the placement groups (actors placed in them are killed by Ray)."""
        if not self._pgs:
            return
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._pgs, self.bundles = [], []

    def __repr__(self) -> str:
        return (f"RayResourcePool({self.name!r}, nodes={self.process_on_nodes}, bundle={self.bundle_resources}, "
                f"colocate={self.max_colocate_count})")


def _name(role) -> str:
    return getattr(role, "name", str(role))


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {res[k]:g}" for k in ("CPU", "GPU") if k in res) + "}"


@dataclass
class ResourcePoolManager:
    """verl's ResourcePoolManager: `resource_pool_spec` (pool -> workers per node) + role -> pool
    (the roles are the caller's keys, e.g. megappo.workers.roles' Role enum)."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Hashable, str]
    use_gpu: bool = False
    cpus_per_bundle: float = 1
    pools: dict[str, RayResourcePool] = field(default_factory=dict)

    def __post_init__(self):
        unknown = {r: p for r, p in self.mapping.items() if p not in self.resource_pool_spec}
        if unknown:
            raise ValueError(f"roles mapped to undefined pools: {unknown} (pools: {list(self.resource_pool_spec)})")

    def colocate_count(self, pool_name: str) -> int:
        return max(1, sum(1 for p in self.mapping.values() if p == pool_name))

    def check_resource_available(self) -> None:
        """Raise a one-line ValueError when the cluster cannot hold every pool at once."""
        ray = _ray()
        total = ray.cluster_resources()
        need_cpu = sum(sum(n) for n in self.resource_pool_spec.values()) * self.cpus_per_bundle
        need_gpu = sum(sum(n) for n in self.resource_pool_spec.values()) if self.use_gpu else 0
        if need_cpu > total.get("CPU", 0) or need_gpu > total.get("GPU", 0):
            raise ValueError(
                f"resource pools {self.resource_pool_spec} need CPU {need_cpu:g}"
                + (f", GPU {need_gpu}" if self.use_gpu else "")
                + f" but the Ray cluster has CPU {total.get('CPU', 0):g}, GPU {total.get('GPU', 0):g}"
            )

    def create_resource_pool(self, ready_timeout_s: float = 60.0) -> None:
        self.check_resource_available()
        placement = self.assign_nodes()
        for name, nodes in self.resource_pool_spec.items():
            self.pools[name] = RayResourcePool(nodes, use_gpu=self.use_gpu, cpus_per_bundle=self.cpus_per_bundle,
                                               max_colocate_count=self.colocate_count(name), name=name,
                                               ready_timeout_s=ready_timeout_s, node_ids=placement.get(name))

    def assign_nodes(self) -> dict[str, list[str]]:
        """pool -> the Ray node of each of its per-node groups. Pools are placed in spec order; each
        per-node group goes to the node with the most of the needed resource left (the driver's node
        first among equals) that holds none of the pool's other groups. A one-node cluster: {} (Ray
        places everything on it)."""
        ray = _ray()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) < 2:
            return {}
        key = "GPU" if self.use_gpu else "CPU"
        here = ray.get_runtime_context().get_node_id()
        left = {n["NodeID"]: float(n.get("Resources", {}).get(key, 0)) for n in alive}
        order = sorted(left, key=lambda nid: nid != here)  # the driver's node first among equals
        placement = {}
        for name, counts in self.resource_pool_spec.items():
            chosen = []
            for count in counts:
                need = count * (1 if self.use_gpu else self.cpus_per_bundle)
                free = [nid for nid in order if nid not in chosen and left[nid] >= need]
                if not free:
                    raise WorkerError(f"resource pool {name!r}: no Ray node left with {need:g} {key} for its "
                                      f"node {len(chosen)} (workers per node {counts}; {key} left per node: "
                                      f"{sorted(left.values(), reverse=True)}); add nodes or lower workers_per_node")
                best = max(free, key=lambda nid: left[nid])
                chosen.append(best)
                left[best] -= need
            placement[name] = chosen
        return placement

    def describe(self) -> str:
        """One line per pool: its nodes and the workers on each (for the run's log)."""
        parts = []
        for name, pool in self.pools.items():
            per_node: dict[str, int] = {}
            for b in pool.bundles:
                per_node[b.node_id[:8]] = per_node.get(b.node_id[:8], 0) + 1
            parts.append(f"pool {name}: " + ", ".join(f"node {n} x{k}" for n, k in per_node.items()))
        return "; ".join(parts)

    def get_resource_pool(self, role: Hashable) -> RayResourcePool:
        if role not in self.mapping:
            raise KeyError(f"role {_name(role)} is not mapped to a resource pool "
                           f"(mapped: {[_name(r) for r in self.mapping]})")
        name = self.mapping[role]
        if name not in self.pools:
            raise RuntimeError(f"pool {name!r} not created yet: call create_resource_pool() first")
        return self.pools[name]

    def remove(self) -> None:
        for pool in self.pools.values():
            pool.remove()
        self.pools.clear()
