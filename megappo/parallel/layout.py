"""ParallelLayout: how a world of ranks is cut into tensor (tp), context (cp: each row's tokens split over cp
ranks, parallel/context_parallel.py), pipeline (pp, with vpp virtual stages per rank) and data (dp) parallel
groups, in megatron-core's rank order; and, for a mixture-of-experts model, how the routed experts are spread
over expert-parallel ranks (ep).

Expert parallelism reuses the data- (and context-) parallel ranks (expert data parallel = dp * cp / ep): the ep
ranks of one expert group hold different experts, everything else is replicated over dp as usual. Experts
are split over tp like a dense MLP (expert tensor parallel = tp, megatron's default).

megatron's `initialize_model_parallel(order="tp-cp-ep-dp-pp")` (the default) numbers ranks with tp
fastest, then cp, then dp, then pp:  rank = tp + TP * (cp + CP * (dp + DP * pp)). megatron's expert groups
take ep consecutive ranks of the CP x DP grid (expert data parallel = cp * dp / ep), so at cp > 1 an EP group
spans CP ranks. A config's `<role>.parallel.cp` is this cp.
`tests/test_layout.py` checks this against the groups parallel_state really builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LAYOUT_KEYS = ("tp", "pp", "dp", "vpp", "ep", "cp")


def sliced_sync(train_tp: int, rollout_tp: int) -> bool:
    """Whether the hybrid engine's weight sync is sliced: each rollout TP rank gets only its own shard of a TP-split
    weight (the trainer's, at the same TP). At any other rollout TP every rank gets whole tensors, the model's every
    byte into every rollout GPU (parallel/resharding.py; the planner's sync traffic)."""
    return rollout_tp == train_tp and train_tp > 1


def same_layout(a, b, but: tuple[str, ...] = ()) -> bool:
    """Whether two roles' parallel settings (a config's `parallel` or a ParallelLayout) cut the world the
    same way, ep included (the keys in `but` aside): roles that do share worker processes, and so one
    megatron parallel_state (ppo/workers.py; memory_model.py counts the processes the same way)."""
    return all(getattr(a, k) == getattr(b, k) for k in LAYOUT_KEYS if k not in but)


def check_layout(par, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 num_layers: Optional[int] = None, num_experts: int = 0, world_size: Optional[int] = None, *,
                 where: str = "", model: str = "this one", pool: str = "the world size") -> None:
    """The layout rules, stated once: raise a one-line ValueError naming the keys and the fix when `par` (a
    ParallelLayout, or a config's `<role>.parallel`: anything with LAYOUT_KEYS) is not a layout, cannot
    shard the model (when its shapes are given) or does not fill `world_size` ranks (when given).
    `where` qualifies the keys in the message ("actor.parallel" -> "actor.parallel.tp=3 ..."), `model`
    names the model, `pool` says where world_size comes from (config/validate.py's check_parallel)."""
    def key(k: str) -> str:
        return f"{where}.{k}" if where else k

    whole = f"{where} " if where else ""
    tp, pp, dp, vpp, ep, cp = (getattr(par, k) for k in ("tp", "pp", "dp", "vpp", "ep", "cp"))
    for k, v in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{key(k)}={v!r} must be a positive int (>= 1)")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"{key('vpp')}={vpp!r} must be null (no interleaving) or a positive int")
        if vpp > 1 and pp < 2:
            raise ValueError(f"{key('vpp')}={vpp} needs pipeline parallelism (interleaving needs a pipeline, "
                             f"{key('pp')}={pp}); set {key('pp')}>=2 or {key('vpp')}=null")
    if num_heads is not None:
        if ep > 1 and not num_experts:
            raise ValueError(f"{key('ep')}={ep} needs a mixture-of-experts model ({model} is dense); "
                             f"set {key('ep')}=1")
        if num_experts and num_experts % ep:
            raise ValueError(f"{key('ep')}={ep} does not divide the model's {num_experts} experts; use a divisor "
                             f"of {num_experts}")
    if (dp * cp) % ep:  # megatron's expert groups take ep of the CP x DP ranks
        what = f"{key('dp')}={dp}" if cp == 1 else f"{key('dp')}*{key('cp')}={dp * cp}"
        raise ValueError(f"{key('ep')}={ep} must divide {what} (expert parallel ranks are data (and context) "
                         f"parallel ranks); raise dp or lower ep")
    if world_size is not None and tp * cp * pp * dp != world_size:
        shown = ("tp*cp*pp", f"{tp}*{cp}*{pp}", "tp, cp and pp") if cp > 1 else ("tp*pp", f"{tp}*{pp}", "tp and pp")
        if world_size % (tp * cp * pp) == 0:
            raise ValueError(f"{whole}{shown[0]}*dp = {shown[1]}*{dp} = {tp * cp * pp * dp} but the pool has "
                             f"{world_size} workers ({pool}); change dp to {world_size // (tp * cp * pp)}")
        raise ValueError(f"{whole}{shown[0]} = {tp * cp * pp} does not divide the pool's {world_size} workers "
                         f"({pool}); pick {shown[2]} whose product divides {world_size}")
    if num_heads is None:
        return
    if num_heads % tp:
        raise ValueError(f"{key('tp')}={tp} does not divide the model's {num_heads} attention heads "
                         f"(num_attention_heads); use a tp that divides it")
    if num_kv_heads % tp:
        raise ValueError(f"{key('tp')}={tp} does not divide the model's {num_kv_heads} key/value heads "
                         f"(num_key_value_heads, GQA); use a tp that divides it")
    stages = pp * (vpp or 1)
    if num_layers % stages:
        raise ValueError(f"{whole}pp*vpp = {stages} does not divide the model's {num_layers} layers (num_layers); "
                         f"choose pp (and vpp) whose product divides {num_layers}")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: Optional[int] = None  # virtual stages per pipeline rank (interleaved schedule); None = off
    ep: int = 1  # expert parallel: routed experts split over ep of the dp ranks (MoE models only)
    cp: int = 1  # context parallel: each row's tokens split over cp ranks (zigzag)

    def __post_init__(self):
        check_layout(self, where="ParallelLayout")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    @property
    def virtual_pp(self) -> Optional[int]:
        """The value for megatron's virtual_pipeline_model_parallel_size (None unless vpp > 1)."""
        return self.vpp if (self.vpp or 1) > 1 else None

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (dp, pp, tp) (`cp_rank` gives the fourth)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp = rank % self.tp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return dp, pp, tp

    def cp_rank(self, rank: int) -> int:
        self.coords(rank)
        return (rank // self.tp) % self.cp

    def rank(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """(dp, pp, tp[, cp]) -> rank."""
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp and 0 <= cp < self.cp):
            raise ValueError(f"coords (dp={dp}, pp={pp}, tp={tp}, cp={cp}) outside layout {self}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def tp_group(self, rank: int) -> list[int]:
        dp, pp, _ = self.coords(rank)
        return [self.rank(dp, pp, t, self.cp_rank(rank)) for t in range(self.tp)]

    def cp_group(self, rank: int) -> list[int]:
        dp, pp, tp = self.coords(rank)
        return [self.rank(dp, pp, tp, c) for c in range(self.cp)]

    def pp_group(self, rank: int) -> list[int]:
        dp, _, tp = self.coords(rank)
        return [self.rank(dp, p, tp, self.cp_rank(rank)) for p in range(self.pp)]

    def dp_group(self, rank: int) -> list[int]:
        _, pp, tp = self.coords(rank)
        return [self.rank(d, pp, tp, self.cp_rank(rank)) for d in range(self.dp)]

    def is_collect_rank(self, rank: int) -> bool:
        """tp == cp == 0 on the last pipeline stage: where a DP replica's outputs are read."""
        _, pp, tp = self.coords(rank)
        return tp == 0 and self.cp_rank(rank) == 0 and pp == self.pp - 1

    def validate(self, num_heads: int, num_kv_heads: int, num_layers: int, world_size: Optional[int] = None,
                 num_experts: int = 0) -> None:
        """Raise a one-line ValueError when this layout cannot shard the model (or the world): check_layout."""
        check_layout(self, num_heads, num_kv_heads, num_layers, num_experts, world_size)

    def __str__(self) -> str:
        v = f"xVPP{self.vpp}" if self.virtual_pp else ""
        e = f"xEP{self.ep}" if self.ep > 1 else ""
        c = f"xCP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}{c}xPP{self.pp}{v}xDP{self.dp}{e}"
