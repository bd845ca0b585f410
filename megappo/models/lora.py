"""LoRA adapters on megatron-core's own tensor-parallel linears, applied from outside to a built model
(torchtitan style: no layer spec change, the base parameters keep their names).

    cfg = LoraConfig(rank=8, alpha=16, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    names = apply_lora(chunks, cfg)        # after the HF base weights are loaded; freezes every base param
    with lora_disabled(chunks): ...        # the base model (the PPO reference) on the same weights

Each matching ColumnParallelLinear / RowParallelLinear (and TE's TEColumnParallelLinear /
TERowParallelLinear, by the same rule) gets its class swapped for a subclass that adds
`scaling * B(A(dropout(x)))` to the base output, peft's LoraLayer: A [r, in], B [out, r],
scaling = alpha / r, B zero-initialised. Sharding follows the base:

- column-parallel base (linear_qkv, linear_fc1; W split along the output): A replicated, B split along
  the output exactly as W. The input is the full (sequence-gathered) x on every rank, so A(x) is the
  same everywhere; its gradient is a partial sum over the output shards, all-reduced (r wide) by a
  copy_to_tensor_model_parallel_region right after A.
- row-parallel base (linear_proj, linear_fc2; W split along the input): A split along the input as W,
  B replicated. x_shard @ A_shard^T is a partial sum: it is all-reduced over TP (reduce-scattered
  along the sequence under sequence parallelism, as the base output is) BEFORE B. B then sees the
  same input on every rank; under sequence parallelism it sees this rank's tokens only, so B is marked
  `sequence_parallel` and its gradient is summed over TP with the norms' (finalize_model_grads).

Fused projections: megatron's linear_qkv is peft's q_proj/k_proj/v_proj and linear_fc1 is
gate_proj/up_proj. One adapter over the fused output (what this module trains) is peft's three (two)
adapters with one shared lora_A and the Bs laid out as weight_mapping lays out the base weight
(per query group interleaved q/k/v; per TP rank [gate; up]). models/lora_peft.py's `hf_lora_to_megatron`
and `megatron_lora_to_hf` convert both ways; an HF adapter with different A's over a fused group is
refused (it is a rank-3r adapter on the fused linear, not this one).

Routed experts (`experts=True`, off by default): each expert's linear_fc1 / linear_fc2 of megatron's
SequentialMLP gets its own adapter, the same rule as a dense MLP's; its parameters are marked as the
expert weights are (`allreduce=False`: gradients averaged over the expert-data-parallel group only), and
its A is seeded by the GLOBAL expert index, so every EP size starts from the same adapters. The expert
receives its tokens from the dispatcher, which owns the communication: at expert TP > 1 every rank of the
expert-TP group gets the same (gathered) tokens, and the dispatcher sums the group's outputs (and, backward,
the group's input gradients). So an expert's adapter is the dense rule with those sums left to the
dispatcher: column (fc1): A's gradient is all-reduced over the group (A is replicated) but the input
gradient stays this rank's part; row (fc2): A's partial sums are all-reduced before B, and B's output is
divided by the group size forward only (the dispatcher's sum restores it; B's gradient is then the whole
one on every rank). TE's grouped GEMM (TEGroupedMLP) is refused in one line. peft adapts
transformers' stacked expert parameters (`mlp.experts.gate_up_proj` / `down_proj`) with
target_parameters: lora_peft.`peft_expert_tensors` writes that layout (save_peft_adapter).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from megappo.parallel.weight_mapping import LORA_INITS as INITS, LORA_MLA_TARGETS as MLA_TARGETS, \
    LORA_TARGETS as TARGETS  # the one list (also config's)
from megappo.parallel.weight_mapping import global_named_parameters, global_namer, local_named_weights

_HF_HINT = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
            "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


@dataclass
class LoraConfig:
    """actor.lora. rank r, alpha (scaling = alpha / r), dropout on A's input (training only), target
    modules in megatron's names, init of A ('kaiming': peft's default uniform(+-1/sqrt(in)); 'gaussian':
    normal(0, 1/r)); B starts at zero either way. `seed`: A's init, the same full A at every TP size."""
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Sequence[str] = field(default_factory=lambda: list(TARGETS))
    init: str = "kaiming"
    seed: int = 0
    experts: bool = False  # also the routed experts' linear_fc1 / linear_fc2 (target_modules permitting)

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha!r}")
        if not (0.0 <= float(self.dropout) < 1.0):
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        if not self.target_modules:
            raise ValueError(f"lora.target_modules is empty: name some of {list(TARGETS)}")
        for t in self.target_modules:
            if t not in TARGETS + MLA_TARGETS:
                hint = f" (HF's {t} is megatron's {_HF_HINT[t]})" if t in _HF_HINT else ""
                raise ValueError(f"lora.target_modules: {t!r} is not one of megatron's {list(TARGETS)} "
                                 f"(multi-latent attention's: {list(MLA_TARGETS)}){hint}")
        if self.init not in INITS:
            raise ValueError(f"lora.init must be one of {list(INITS)}, got {self.init!r}")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.rank


# ---- the adapted linears ----------------------------------------------------------------------------


def _tp_group_of(mod):
    g = getattr(mod, "tp_group", None)
    if g is not None:
        return g
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group() if mpu.model_parallel_is_initialized() else None


def _group_size(g) -> int:
    return 1 if g is None else g.size()


def _group_rank(g) -> int:
    return 0 if g is None else g.rank()


class _LoraMixin:
    """Mixed in front of a column- or row-parallel linear class (see _lora_class). forward returns the
    base's (output, bias) with the adapter's delta added to output."""

    lora_column: bool = True

    def _lora_setup(self, cfg: LoraConfig, global_name: str) -> None:
        w = self.weight
        group = _tp_group_of(self)
        tp, rank = _group_size(group), _group_rank(group)
        r = cfg.rank
        out_local, in_local = w.shape
        in_full = in_local if self.lora_column else in_local * tp
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(global_name.encode())) % 2**63)
        if cfg.init == "kaiming":  # kaiming_uniform_(a=sqrt(5)) on [r, in]: bound 1/sqrt(in), as peft
            a_full = (torch.rand(r, in_full, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(in_full)
        else:
            a_full = torch.randn(r, in_full, generator=gen, dtype=torch.float64) / r
        a = a_full if self.lora_column else a_full.chunk(tp, dim=1)[rank]
        out_b = out_local  # column: this rank's output rows; row: the full output (W is [out, in/tp])
        self.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_b, r, device=w.device, dtype=w.dtype))
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self._lora_expert_comm = bool(getattr(self, "explicit_expert_comm", False)) and tp > 1
        if self.lora_column:
            set_tensor_model_parallel_attributes(self.lora_B, is_parallel=True, dim=0, stride=1)
        else:
            set_tensor_model_parallel_attributes(self.lora_A, is_parallel=True, dim=1, stride=1)
            if getattr(self, "sequence_parallel", False) and not self._lora_expert_comm:
                self.lora_B.sequence_parallel = True  # sees this rank's tokens: grads summed over TP
        self.lora_scaling = cfg.scaling
        self.lora_dropout_p = float(cfg.dropout)
        self.lora_enabled = True
        self.lora_name = global_name
        self._lora_group, self._lora_tp = group, tp
        for p in (self.lora_A, self.lora_B):  # a routed expert's: reduced over expert-DP, as its weight
            p.allreduce = getattr(w, "allreduce", True)

    def lora_delta(self, x: torch.Tensor, gather_output: bool = False) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as mp

        g, tp = self._lora_group, self._lora_tp
        if self._lora_expert_comm:
            return self._expert_lora_delta(x)
        seq_par = bool(getattr(self, "sequence_parallel", False)) and tp > 1
        if self.lora_column:
            if seq_par:  # x is this rank's tokens; A needs them all (backward: keep our slice of the full grad)
                x = mp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=g)
            x = _lora_dropout(x, self.lora_dropout_p, self.training, tp, whole=True)
            a = F.linear(x, self.lora_A)
            if tp > 1:  # forward identity; backward all-reduce of the r-wide partial gradients
                a = mp.copy_to_tensor_model_parallel_region(a, group=g)
            d = F.linear(a, self.lora_B) * self.lora_scaling
            if gather_output and tp > 1:
                d = mp.gather_from_tensor_model_parallel_region(d, group=g)
            return d
        if not getattr(self, "input_is_parallel", True):
            x = mp.scatter_to_tensor_model_parallel_region(x, group=g)
        x = _lora_dropout(x, self.lora_dropout_p, self.training, tp, whole=False, in_block_fork=seq_par)
        a = F.linear(x, self.lora_A)  # partial sum over the input shards
        if tp > 1:
            a = mp.reduce_scatter_to_sequence_parallel_region(a, group=g) if seq_par \
                else mp.reduce_from_tensor_model_parallel_region(a, group=g)
        return F.linear(a, self.lora_B) * self.lora_scaling

    def _expert_lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """A routed expert's delta at expert TP > 1, where the dispatcher sums the group's outputs and input
        gradients (module docstring)."""
        from megatron.core.tensor_parallel import mappings as mp

        if self.lora_column:
            x = _lora_dropout(x, self.lora_dropout_p, self.training, self._lora_tp, whole=True)
            a = _ReplicatedA.apply(x, self.lora_A, self._lora_group)
            return F.linear(a, self.lora_B) * self.lora_scaling
        x = _lora_dropout(x, self.lora_dropout_p, self.training, self._lora_tp, whole=False, expert=True)
        a = mp.reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_A), group=self._lora_group)
        d = F.linear(a, self.lora_B) * self.lora_scaling
        return d.detach() / self._lora_tp + (d - d.detach())  # d / tp forward (exact), d's gradient backward

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        if not self.lora_enabled:
            return out, bias
        gather = False
        if self.lora_column:
            gather = kwargs.get("runtime_gather_output")
            if gather is None and len(args) >= 2:
                gather = args[1]
            if gather is None:
                gather = bool(getattr(self, "gather_output", False))
        return out + self.lora_delta(input_, gather_output=gather).to(out.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's checkpoint entries of the base (weight, bias) and of the adapter, each sharded along
        its own TP dim (column: B along the output like W; row: A along the input like W)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0, "lora_B": 0} if self.lora_column else {"weight": 1, "lora_A": 1}
        metadata = metadata or {}
        dp_group = metadata.get("dp_cp_group")
        out = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                  sharded_offsets, tp_group=self._lora_group, dp_cp_group=dp_group)
        if self.lora_column and self.lora_name.endswith("linear_fc1") and self.config.gated_linear_unit:
            # B's rows are [gate; up] per TP rank, as W's: saved as megatron's MLP saves W (gate and up each
            # sharded along TP), so the files are the same at every TP and a resume may change it
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                out[f"{prefix}lora_B"], sharded_offsets, metadata.get("singleton_local_shards", False),
                tp_group=self._lora_group, dp_group=dp_group)
        return out

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + scaling * B @ A (no communication: the shards line up with W's)."""
        delta = (self.lora_B.double() @ self.lora_A.double()) * self.lora_scaling
        return (self.weight.double() + delta).to(self.weight.dtype)


class _ReplicatedA(torch.autograd.Function):
    """x @ A^T for a column-parallel expert at expert TP > 1: A (replicated) gets the group's all-reduced
    gradient, x only this rank's part (the dispatcher sums the input gradients over the group)."""

    @staticmethod
    def forward(ctx, x, a, group):
        ctx.save_for_backward(x, a)
        ctx.group = group
        return F.linear(x, a)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        x, a = ctx.saved_tensors
        grad_x = grad @ a
        whole = grad.contiguous().clone()
        dist.all_reduce(whole, group=ctx.group)
        grad_a = whole.reshape(-1, whole.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_a, None


_CLASS_CACHE: dict = {}


def _column_row_classes():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    column, row, refused = [ColumnParallelLinear], [RowParallelLinear], []
    try:  # TE's equivalents, where TE imports (never on CPU-only installs)
        from megatron.core.extensions import transformer_engine as te

        if getattr(te, "HAVE_TE", False):  # without TE megatron leaves MagicMock placeholders here
            column += [c for c in (getattr(te, "TEColumnParallelLinear", None),) if isinstance(c, type)]
            row += [c for c in (getattr(te, "TERowParallelLinear", None),) if isinstance(c, type)]
            refused += [c for c in (getattr(te, "TELayerNormColumnParallelLinear", None),) if isinstance(c, type)]
    except Exception:  # noqa: BLE001 - TE absent or broken: the local classes only
        pass
    return tuple(column), tuple(row), tuple(refused)


def _lora_class(cls, column: bool):
    key = (cls, column)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"Lora{cls.__name__}", (_LoraMixin, cls), {"lora_column": column})
    return _CLASS_CACHE[key]


def _as_chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _module_namer(chunk):
    """A module name local to the chunk -> its global name (layer and routed-expert indices made global)."""
    name_of = global_namer(getattr(chunk, "module", chunk))
    return lambda local: name_of(local.removeprefix("module.") + ".weight").removesuffix(".weight")


def iter_lora_modules(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(global megatron module name, module) of every adapted linear in the chunk(s)."""
    for chunk in _as_chunks(model):
        name_of = _module_namer(chunk)
        for name, mod in chunk.named_modules():
            if isinstance(mod, _LoraMixin):
                yield name_of(name), mod


def is_lora_param(name: str) -> bool:
    return name.endswith(".lora_A") or name.endswith(".lora_B")


def apply_lora(model, cfg: LoraConfig, pp_group=None) -> list[str]:
    """Wrap every matching column/row-parallel linear of the model chunk(s) in place and freeze every
    other parameter (requires_grad False). Returns the wrapped modules' global names. A target module
    that matches nothing in these chunks (in any stage of `pp_group`, when given: collective) is a
    ValueError (one line); TE's fused-norm linear is refused."""
    chunks = _as_chunks(model)
    column, row, refused = _column_row_classes()
    wrapped, seen = [], set()
    for chunk in chunks:
        name_of = _module_namer(chunk)
        for name, mod in list(chunk.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in cfg.target_modules or isinstance(mod, _LoraMixin):
                continue
            routed = ".experts." in f".{name}." and ".shared_experts." not in f".{name}."
            if routed and not cfg.experts:
                continue
            if refused and isinstance(mod, refused):
                raise NotImplementedError(f"LoRA on {name}: TE's fused-norm {type(mod).__name__} is not supported "
                                          "yet; build the model with model.transformer_engine=false")
            if isinstance(mod, column):
                is_col = True
            elif isinstance(mod, row):
                is_col = False
            elif routed:  # TE's grouped linears: one module for every local expert
                raise NotImplementedError(f"LoRA on {name}: routed experts as {type(mod).__name__} (TE's grouped "
                                          "GEMM) are not supported yet; build with model.transformer_engine=false")
            else:
                continue
            if getattr(mod, "weight", None) is None:
                raise ValueError(f"LoRA on {name}: {type(mod).__name__} has no weight of its own")
            gname = name_of(name)
            mod.__class__ = _lora_class(type(mod), is_col)
            mod._lora_setup(cfg, gname)
            wrapped.append(gname)
            seen.add(leaf)
    if pp_group is not None:  # a pipeline stage may hold none of a target (e.g. only routed layers): all stages
        import torch.distributed as dist

        stages = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, sorted(seen), group=pp_group)
        seen = set().union(*map(set, stages))
    missing = [t for t in cfg.target_modules if t not in seen]
    if missing:
        hint = "" if cfg.experts else " (routed experts' linears need lora.experts=true)"
        raise ValueError(f"lora.target_modules {missing} match no column/row-parallel linear of this model{hint}")
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.requires_grad_(is_lora_param(name))
    return wrapped


def lora_parameters(model) -> list[torch.nn.Parameter]:
    return [p for chunk in _as_chunks(model) for n, p in chunk.named_parameters() if is_lora_param(n)]


@contextlib.contextmanager
def lora_disabled(model):
    """The base model (adapters off), e.g. for the PPO reference log-probs; restored on exit."""
    mods = [m for _, m in iter_lora_modules(model)]
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.lora_enabled = b


def _lora_dropout(x: torch.Tensor, p: float, training: bool, tp: int, whole: bool, expert: bool = False,
                  in_block_fork: bool = False) -> torch.Tensor:
    """Dropout on A's input, drawn from megatron's RNG tracker as megatron's own dropout is. An input that is whole on
    every TP rank (column-parallel: A replicated) draws from the data-parallel generator, the same on every rank of
    a TP group and drawn from identically there (megatron's choice for duplicated work; reseed_dropout sets it at
    each update), so every copy of A gets the same gradient whatever else a rank drew. A rank's slice (row-parallel)
    draws from its own model-parallel generator (a routed expert's: the expert-parallel one), so the slices do not
    all get one pattern; under sequence parallelism (`in_block_fork`) megatron's TransformerBlock already runs
    inside that generator, and the draw stays in it, as megatron's attention dropout does."""
    if not (training and p > 0 and tp > 1):
        return F.dropout(x, p, training)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name, \
        get_expert_parallel_rng_tracker_name

    tracker = get_cuda_rng_tracker()
    if whole:
        context = tracker.fork(get_data_parallel_rng_tracker_name())
    elif expert:
        context = tracker.fork(get_expert_parallel_rng_tracker_name())
    else:
        context = contextlib.nullcontext() if in_block_fork else tracker.fork()
    with context:
        return F.dropout(x, p, training)


def reseed_dropout(seed: int, device: torch.device) -> None:
    """Reseed the generator a column-parallel input's dropout draws from (megatron's data-parallel one; the caller's
    state is left as it was). The engine does it at every update from (trainer.seed, step, stage): the ranks of a TP
    group agree even when they resumed from different data-parallel replicas' states (a resume at another TP), and
    the stages draw different masks."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tensor_parallel.random import get_data_parallel_rng_tracker_name

    with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)


class MergedShard:
    """An adapted linear's merged shard, computed when read (`detach()`), with the base weight's shape,
    dtype and device. The weight sync's resharder lists every tensor when it is built and reads each one
    once per bucket: with these it holds no merged copy of the model between (or during) syncs, and an
    offloaded engine's freed weights are not read when the resharder is built."""

    def __init__(self, mod: "_LoraMixin"):
        self._mod = mod

    shape = property(lambda self: self._mod.weight.shape)
    dtype = property(lambda self: self._mod.weight.dtype)
    device = property(lambda self: self._mod.weight.device)

    def numel(self) -> int:
        return self._mod.weight.numel()

    def detach(self) -> torch.Tensor:
        return self._mod.merged_weight()


def merged_named_parameters(model, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron name, tensor) of every base parameter of this rank, each adapted linear's weight
    replaced by its merged shard W + scaling * B @ A: what a merged weight sync sends (the adapters'
    own parameters are not listed). The shards keep the base's layout (weight_mapping applies).
    `lazy`: a MergedShard for each adapted weight, merged when read (the weight sync's resharder)."""
    for chunk in _as_chunks(model):
        inner = getattr(chunk, "module", chunk)
        merged = {}
        for name, mod in inner.named_modules():
            if isinstance(mod, _LoraMixin):
                merged[name + ".weight"] = mod
        local = [n for n, _ in local_named_weights(inner)]
        for (gname, p), lname in zip(global_named_parameters(inner), local, strict=True):
            if is_lora_param(lname):
                continue
            mod = merged.get(lname)
            if mod is None:
                yield gname, p.detach()
            else:
                yield gname, (MergedShard(mod) if lazy else mod.merged_weight())


def lazily_merged_named_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """merged_named_parameters(model, lazy=True): what a merged weight sync's resharder reads."""
    return merged_named_parameters(model, lazy=True)


def base_named_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron name, tensor) of every base parameter of this rank as it is (adapters not merged,
    not listed): the frozen base, e.g. to fingerprint what vLLM holds under rollout.lora_sync=adapter."""
    for chunk in _as_chunks(model):
        inner = getattr(chunk, "module", chunk)
        for (gname, p), (lname, _) in zip(global_named_parameters(inner), local_named_weights(inner), strict=True):
            if not is_lora_param(lname):
                yield gname, p.detach()
