"""ParallelLayout: how a world of ranks is cut into tensor (tp), pipeline (pp, with vpp virtual stages
per rank) and data (dp) parallel groups, in megatron-core's rank order; and, for a mixture-of-experts
model, how the routed experts are spread over expert-parallel ranks (ep).

Expert parallelism reuses the data-parallel ranks (megatron's "expert data parallel" = dp / ep): the ep
ranks of one expert group hold different experts, everything else is replicated over dp as usual. Experts
are split over tp like a dense MLP (expert tensor parallel = tp, megatron's default).

megatron's `initialize_model_parallel(order="tp-cp-ep-dp-pp")` (the default) numbers ranks with tp
fastest, then dp, then pp (cp = ep = 1 here):  rank = tp + TP * (dp + DP * pp).
`tests/test_layout.py` checks this against the groups parallel_state really builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LAYOUT_KEYS = ("tp", "pp", "dp", "vpp", "ep")


def same_layout(a, b, but: tuple[str, ...] = ()) -> bool:
    """Whether two roles' parallel settings (a config's `parallel` or a ParallelLayout) cut the world the
    same way, ep included (the keys in `but` aside): roles that do share worker processes, and so one
    megatron parallel_state (ppo/ray_trainer.py; planner.py counts the processes the same way)."""
    return all(getattr(a, k) == getattr(b, k) for k in LAYOUT_KEYS if k not in but)


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: Optional[int] = None  # virtual stages per pipeline rank (interleaved schedule); None = off
    ep: int = 1  # expert parallel: routed experts split over ep of the dp ranks (MoE models only)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {v!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(f"ParallelLayout.vpp must be None or a positive int, got {self.vpp!r}")
            if self.vpp > 1 and self.pp < 2:
                raise ValueError(f"vpp={self.vpp} needs pp >= 2 (interleaving needs a pipeline), got pp={self.pp}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (expert parallel ranks are data parallel ranks); "
                             f"raise dp or lower ep")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    @property
    def virtual_pp(self) -> Optional[int]:
        """The value for megatron's virtual_pipeline_model_parallel_size (None unless vpp > 1)."""
        return self.vpp if (self.vpp or 1) > 1 else None

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (dp, pp, tp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return dp, pp, tp

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """(dp, pp, tp) -> rank."""
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp):
            raise ValueError(f"coords (dp={dp}, pp={pp}, tp={tp}) outside layout {self}")
        return tp + self.tp * (dp + self.dp * pp)

    def tp_group(self, rank: int) -> list[int]:
        dp, pp, _ = self.coords(rank)
        return [self.rank(dp, pp, t) for t in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        dp, _, tp = self.coords(rank)
        return [self.rank(dp, p, tp) for p in range(self.pp)]

    def dp_group(self, rank: int) -> list[int]:
        _, pp, tp = self.coords(rank)
        return [self.rank(d, pp, tp) for d in range(self.dp)]

    def is_collect_rank(self, rank: int) -> bool:
        """tp == 0 on the last pipeline stage: where a DP replica's outputs are read."""
        _, pp, tp = self.coords(rank)
        return tp == 0 and pp == self.pp - 1

    def validate(self, num_heads: int, num_kv_heads: int, num_layers: int, world_size: Optional[int] = None,
                 num_experts: int = 0) -> None:
        """Raise a one-line ValueError when this layout cannot shard the model (or the world)."""
        if self.ep > 1 and not num_experts:
            raise ValueError(f"ep={self.ep} needs a mixture-of-experts model (this one is dense); set ep=1")
        if num_experts and num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the model's {num_experts} experts")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"layout tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = {self.world_size} != world size {world_size}")
        if num_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide num_attention_heads={num_heads}")
        if num_kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide num_key_value_heads={num_kv_heads}")
        stages = self.pp * self.num_model_chunks
        if num_layers % stages:
            raise ValueError(f"pp*vpp = {self.pp}*{self.num_model_chunks} = {stages} does not divide num_layers={num_layers}")

    def __str__(self) -> str:
        v = f"xVPP{self.vpp}" if self.virtual_pp else ""
        e = f"xEP{self.ep}" if self.ep > 1 else ""
        return f"TP{self.tp}xPP{self.pp}{v}xDP{self.dp}{e}"
