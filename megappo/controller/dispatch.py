"""How a worker group spreads one driver call over its workers and gathers the answer.

A worker method declares its mode with `@register(Dispatch.X)`; the decorator only attaches a
`DispatchSpec` to the function. The group turns every registered method into a thin method that
reads, at the call site, as

    wg.compute_log_prob(data)   ==   split (DISPATCH_TABLE[mode].split) -> call every worker -> collect

Modes (the whole table is `DISPATCH_TABLE` at the bottom of this file):

- ONE_TO_ALL        every worker gets the same arguments; returns [result of rank 0, rank 1, ...].
- ALL_TO_ALL        every argument is a list of world_size items, rank i gets item i; returns the
                    per-rank results as a list.
- MEGATRON_COMPUTE  DataProto arguments are padded to a multiple of the DP size (`pad_to_divisor`)
                    and cut into DP chunks; every tp/cp/pp rank of DP group d gets chunk d (context
                    parallel ranks split each row's tokens among themselves); only the ranks with
                    tp == cp == 0 on the last pipeline stage are read, in DP order; DataProto
                    results are concatenated and the padding is dropped, so the output has the rows
                    of the input, in input order.
- MEGATRON_PP_AS_DP the same, but each (dp, pp) pair is its own replica (generation: pipeline stages
                    act as extra data-parallel replicas; replica = dp * pp_size + pp); the
                    tp == cp == 0 rank of every replica is read.

Arguments that are not DataProtos go unchanged to every worker. Results that are not DataProtos
(metrics dicts, ...) come back as a list in replica order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:  # DataProto pulls in torch: imported where used, so a worker class loads without it
    from megappo.protocol import DataProto

__all__ = ["Dispatch", "DispatchSpec", "register", "registered_methods", "MegatronTopology", "CallPlan",
           "DISPATCH_TABLE", "plan_call", "collect_results"]

_ATTR = "_megappo_dispatch"


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    MEGATRON_COMPUTE = "megatron_compute"
    MEGATRON_PP_AS_DP = "megatron_pp_as_dp"


@dataclass(frozen=True)
class DispatchSpec:
    mode: Dispatch
    pad: bool = True  # pad DataProto args to the number of replicas (False: they must divide exactly)


def register(mode: Dispatch = Dispatch.ONE_TO_ALL, *, pad: bool = True) -> Callable:
    """Mark a worker method as callable on the group with dispatch `mode` (attaches an attribute)."""
    if not isinstance(mode, Dispatch):
        raise TypeError(f"register() needs a Dispatch mode, got {mode!r}")

    def deco(fn):
        setattr(fn, _ATTR, DispatchSpec(Dispatch(mode), pad))
        return fn

    return deco


def registered_methods(cls: type) -> dict[str, DispatchSpec]:
    """name -> DispatchSpec for every @register-ed method of `cls` (including inherited ones)."""
    out: dict[str, DispatchSpec] = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), _ATTR, None)
        if isinstance(spec, DispatchSpec):
            out[name] = spec
    return out


@dataclass(frozen=True)
class MegatronTopology:
    """Each worker's megatron (dp, pp, tp, cp) coordinates, indexed by the worker's rank in its group ((dp, pp,
    tp) is read as cp = 0: no context parallelism)."""

    coords: tuple[tuple[int, int, int, int], ...]

    def __post_init__(self):
        if not self.coords:
            raise ValueError("MegatronTopology needs at least one worker")
        object.__setattr__(self, "coords", tuple(tuple(c) + (0,) * (4 - len(c)) for c in self.coords))
        sizes = self.dp_size * self.pp_size * self.tp_size * self.cp_size
        if sizes != len(self.coords) or len(set(self.coords)) != len(self.coords):
            raise ValueError(f"worker coordinates {list(self.coords)} are not a full dp x pp x tp x cp grid")

    @property
    def dp_size(self) -> int:
        return 1 + max(c[0] for c in self.coords)

    @property
    def pp_size(self) -> int:
        return 1 + max(c[1] for c in self.coords)

    @property
    def tp_size(self) -> int:
        return 1 + max(c[2] for c in self.coords)

    @property
    def cp_size(self) -> int:
        return 1 + max(c[3] for c in self.coords)

    @property
    def world_size(self) -> int:
        return len(self.coords)


@dataclass
class CallPlan:
    """What each rank receives, and how to read the answer back."""

    args: list[tuple]  # per rank
    kwargs: list[dict]  # per rank
    collect_ranks: Optional[list[int]] = None  # None: every rank, in rank order
    pad_size: int = 0


# ---------------------------------------------------------------------------- splitting helpers
def _split_protos(args: tuple, kwargs: dict, n: int, pad: bool, method: str) -> tuple[list[tuple], list[dict], int]:
    """Pad + chunk every DataProto argument into n pieces; other arguments are repeated."""
    from megappo.protocol import DataProto

    protos = [a for a in args if isinstance(a, DataProto)] + [v for v in kwargs.values() if isinstance(v, DataProto)]
    if not protos:
        raise TypeError(f"{method}: a MEGATRON dispatch needs at least one DataProto argument")
    sizes = {len(p) for p in protos}
    if len(sizes) != 1:
        raise ValueError(f"{method}: DataProto arguments have different lengths {sorted(sizes)}")
    (size,) = sizes
    pad_size = (-size) % n
    if pad_size and not pad:
        raise ValueError(f"{method}: a batch of {size} rows does not divide into {n} data-parallel replicas "
                         "(this method does not pad; make the batch a multiple of the DP size)")

    def cut(v):
        if not isinstance(v, DataProto):
            return [v] * n
        padded, _ = v.pad_to_divisor(n)
        return padded.chunk(n)

    arg_chunks = [cut(a) for a in args]
    kw_chunks = {k: cut(v) for k, v in kwargs.items()}
    per_args = [tuple(c[i] for c in arg_chunks) for i in range(n)]
    per_kwargs = [{k: c[i] for k, c in kw_chunks.items()} for i in range(n)]
    return per_args, per_kwargs, pad_size


def _require_topology(topology: Optional[MegatronTopology], method: str) -> MegatronTopology:
    if topology is None:
        raise RuntimeError(f"{method}: megatron dispatch needs the workers' (dp, pp, tp) coordinates; "
                           "use NVMegatronRayWorkerGroup and call init_model() first")
    return topology


# ---------------------------------------------------------------------------- the modes
def _plan_one_to_all(world: int, topology, args, kwargs, pad, method) -> CallPlan:
    return CallPlan([args] * world, [kwargs] * world)


def _plan_all_to_all(world: int, topology, args, kwargs, pad, method) -> CallPlan:
    for i, v in enumerate(list(args) + list(kwargs.values())):
        if not isinstance(v, (list, tuple)) or len(v) != world:
            raise ValueError(f"{method}: ALL_TO_ALL needs every argument to be a list of {world} items (one per rank)")
    return CallPlan([tuple(a[r] for a in args) for r in range(world)],
                    [{k: v[r] for k, v in kwargs.items()} for r in range(world)])


def _plan_replicas(replica_of: Callable[[tuple], int], is_reader: Callable[[tuple], bool],
                   n_replicas: int, topology: MegatronTopology, args, kwargs, pad, method) -> CallPlan:
    per_args, per_kwargs, pad_size = _split_protos(args, kwargs, n_replicas, pad, method)
    replicas = [replica_of(c) for c in topology.coords]
    readers: dict[int, int] = {}
    for rank, c in enumerate(topology.coords):
        if is_reader(c):
            readers[replicas[rank]] = rank
    return CallPlan([per_args[r] for r in replicas], [per_kwargs[r] for r in replicas],
                    collect_ranks=[readers[i] for i in range(n_replicas)], pad_size=pad_size)


def _plan_megatron_compute(world: int, topology, args, kwargs, pad, method) -> CallPlan:
    t = _require_topology(topology, method)
    return _plan_replicas(lambda c: c[0], lambda c: c[2] == c[3] == 0 and c[1] == t.pp_size - 1, t.dp_size,
                          t, args, kwargs, pad, method)


def _plan_megatron_pp_as_dp(world: int, topology, args, kwargs, pad, method) -> CallPlan:
    t = _require_topology(topology, method)
    return _plan_replicas(lambda c: c[0] * t.pp_size + c[1], lambda c: c[2] == c[3] == 0, t.dp_size * t.pp_size,
                          t, args, kwargs, pad, method)


def _collect_list(plan: CallPlan, results: list) -> list:
    return results if plan.collect_ranks is None else [results[r] for r in plan.collect_ranks]


def _collect_protos(plan: CallPlan, results: list) -> Any:
    from megappo.protocol import DataProto

    picked = _collect_list(plan, results)
    if picked and all(isinstance(r, DataProto) for r in picked):
        return DataProto.concat(picked).unpad(plan.pad_size)
    return picked


@dataclass(frozen=True)
class DispatchRule:
    plan: Callable[..., CallPlan]  # (world, topology, args, kwargs, pad, method) -> CallPlan
    collect: Callable[[CallPlan, list], Any]  # (plan, per-rank results) -> what the driver gets


DISPATCH_TABLE: dict[Dispatch, DispatchRule] = {
    Dispatch.ONE_TO_ALL: DispatchRule(_plan_one_to_all, _collect_list),
    Dispatch.ALL_TO_ALL: DispatchRule(_plan_all_to_all, _collect_list),
    Dispatch.MEGATRON_COMPUTE: DispatchRule(_plan_megatron_compute, _collect_protos),
    Dispatch.MEGATRON_PP_AS_DP: DispatchRule(_plan_megatron_pp_as_dp, _collect_protos),
}


def plan_call(spec: DispatchSpec, world: int, topology: Optional[MegatronTopology], args: Sequence,
              kwargs: dict, method: str = "call") -> CallPlan:
    return DISPATCH_TABLE[spec.mode].plan(world, topology, tuple(args), dict(kwargs), spec.pad, method)


def collect_results(spec: DispatchSpec, plan: CallPlan, results: list) -> Any:
    return DISPATCH_TABLE[spec.mode].collect(plan, results)
