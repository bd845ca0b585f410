"""Resource pools (Ray placement groups) and the Role -> pool mapping, verl-style.

    spec = {"global_pool": [4]}                       # pool name -> workers per node
    mapping = {Role.ActorRollout: "global_pool", Role.Critic: "global_pool"}
    mgr = ResourcePoolManager(spec, mapping)          # use_gpu=False: CPU bundles
    mgr.create_resource_pool()
    pool = mgr.get_resource_pool(Role.Critic)         # -> RayResourcePool

A RayResourcePool holds one placement group per node, one bundle per worker slot:
{"CPU": k} on CPU, {"GPU": 1, "CPU": k} on GPU. Roles that share a pool are COLOCATED: each role's
worker group is its own set of Ray actors placed on the same bundles, each asking for
1 / max_colocate_count of a bundle (max_colocate_count = the number of groups mapped to the pool).
Roles fused in one worker class (ActorRolloutRef) share one process instead.

A pool that cannot be placed (not enough CPUs/GPUs) raises WorkerError within `ready_timeout_s`,
naming the bundles asked for and what the cluster has; it never waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["WorkerError", "Role", "Bundle", "RayResourcePool", "ResourcePoolManager"]


class WorkerError(RuntimeError):
    """A worker (or its placement) failed: dead process, call timeout, or resources that never came."""


class Role(Enum):
    """What a worker group does (one group per role; roles fused in one class share processes)."""

    Actor = 0
    Rollout = 1
    ActorRollout = 2  # hybrid engine: actor + rollout in one process
    Critic = 3
    RefPolicy = 4
    RewardModel = 5
    ActorRolloutRef = 6  # actor + rollout + ref in one process


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
                 strategy: str = "STRICT_PACK"):
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
        self._pgs: list = []
        self.bundles: list[Bundle] = []
        self._create(ready_timeout_s, strategy)

    # ------------------------------------------------------------------ placement
    def _create(self, timeout_s: float, strategy: str) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group, placement_group_table

        for node, n in enumerate(self.process_on_nodes):
            pg = placement_group([dict(self.bundle_resources) for _ in range(n)], strategy=strategy,
                                 name=f"megappo_{self.name}_node{node}")
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


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {res[k]:g}" for k in ("CPU", "GPU") if k in res) + "}"


@dataclass
class ResourcePoolManager:
    """verl's ResourcePoolManager: `resource_pool_spec` (pool -> workers per node) + Role -> pool."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Role, str]
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
        for name, nodes in self.resource_pool_spec.items():
            self.pools[name] = RayResourcePool(nodes, use_gpu=self.use_gpu, cpus_per_bundle=self.cpus_per_bundle,
                                               max_colocate_count=self.colocate_count(name), name=name,
                                               ready_timeout_s=ready_timeout_s)

    def get_resource_pool(self, role: Role) -> RayResourcePool:
        if role not in self.mapping:
            raise KeyError(f"role {role.name} is not mapped to a resource pool "
                           f"(mapped: {[r.name for r in self.mapping]})")
        name = self.mapping[role]
        if name not in self.pools:
            raise RuntimeError(f"pool {name!r} not created yet: call create_resource_pool() first")
        return self.pools[name]

    def remove(self) -> None:
        for pool in self.pools.values():
            pool.remove()
        self.pools.clear()
