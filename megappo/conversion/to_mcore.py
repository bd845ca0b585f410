"""HF safetensors dir -> megatron torch_dist checkpoint dir, one tensor at a time (see core.py)."""

from __future__ import annotations

import datetime
import json
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from megappo.parallel.weight_mapping import ModelDims, hf_to_megatron_full, is_hf_moe_tensor
from megappo.conversion.core import (FORMAT, INFO_FILE, Progress, Unit, atomic_dir, check_out, checked_dims,
                                     copy_side_files, extra_state_items, fast_kind, load_config_object, source_shape,
                                     log, megatron_units, read_hf_config)
from megappo.conversion.dcp_io import Item, save_lazy
from megappo.conversion.errors import ConvertError
from megappo.conversion.safetensors_io import SafetensorsDir


def hf_to_mcore(hf_dir, out_dir, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, model: str = "auto",
                seed: int = 1234, overwrite: bool = False, progress: bool = True, ep: int = 1) -> dict:
    """Convert a HF model dir into a megatron torch_dist checkpoint dir; returns the recorded info.
    model: auto (causal LM -> actor, ...ForSequenceClassification -> critic with its `score` head),
    actor, or critic (from a causal LM: a fresh value head, seeded)."""
    t0 = time.monotonic()
    src, out = Path(hf_dir), Path(out_dir)
    if not src.is_dir():
        raise ConvertError(f"HF model dir {src} does not exist")
    check_out(out, overwrite, [src])
    raw, arch, family, src_kind = read_hf_config(src)
    kind = _target_kind(model, src_kind, arch)
    hf_config = load_config_object(src / "config.json")
    d = checked_dims(hf_config, tp, value_head=kind == "critic")
    _check_layout(d, tp, pp, vpp, ep)
    st = SafetensorsDir(src)
    units = megatron_units(d, hf_config)
    fresh_head = kind == "critic" and src_kind == "causal-lm"
    dtypes = _check_hf_tensors(st, units, d, src, kind, fresh_head)
    items = [Item(u.key, u.shape, dtypes[u.mname], u.index, u.stack, payload=u) for u in units]
    items += extra_state_items(d)
    info = _hf_to_mcore_info(src, arch, src_kind, kind, family, st, d, fresh_head, seed, (tp, pp, vpp, ep), items)
    bar = Progress(f"hf-to-mcore {src.name}", sum(it.nbytes for it in items),
                    sum(1 for it in items if it.shape is not None), progress)
    try:
        with atomic_dir(out, overwrite, [src]) as tmp:
            save_lazy(tmp, items, _megatron_tensor_producer(st, d, fresh_head, seed),
                      on_done=lambda it: bar.step(it.nbytes) if it.shape is not None else None)
            shutil.copy2(src / "config.json", tmp / "config.json")
            info["side_files"] = copy_side_files(src, tmp)
            info["seconds"] = round(time.monotonic() - t0, 3)
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    finally:
        bar.close()
    return info


def _target_kind(model: str, src_kind: str, arch: str) -> str:
    if model not in ("auto", "actor", "critic"):
        raise ConvertError(f"--model {model!r}: choose auto, actor or critic")
    kind = ("actor" if src_kind == "causal-lm" else "critic") if model == "auto" else model
    if kind == "actor" and src_kind == "reward":
        raise ConvertError(f"{arch} has no LM head: convert it with --model critic (its score head becomes the value head)")
    return kind


def _check_layout(d: ModelDims, tp: int, pp: int, vpp: Optional[int], ep: int = 1) -> None:
    from megappo.parallel.layout import ParallelLayout

    try:  # expert-parallel ranks are data-parallel ranks: validate with the smallest dp that holds them
        ParallelLayout(tp=tp, pp=pp, vpp=vpp, dp=ep, ep=ep).validate(d.num_heads, d.num_kv_heads, d.num_layers,
                                                                    num_experts=d.num_experts)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def _check_hf_tensors(st, units: list["Unit"], d: ModelDims, src: Path, kind: str, fresh_head: bool) -> dict:
    """Every HF tensor a unit needs exists with the shape the config implies, one dtype per unit.
    Returns {megatron name: dtype}; logs the HF tensors nothing uses."""
    used, dtypes = set(), {}
    for u in units:
        if fresh_head and u.mname.startswith("output_layer."):
            continue
        srcs = [n for n in u.hf if not (n == "score.bias" and n not in st)]  # HF score has no bias: zeros
        for n in srcs:
            if n not in st:
                raise ConvertError(f"missing tensor {n} in {src} (needed for {u.mname})")
            got, want = st.info(n).shape, source_shape(u, n, d)
            if is_hf_moe_tensor(n) and ".experts." not in n and tuple(got[1:]) == tuple(want[1:]) and got[0] != want[0]:
                raise ConvertError(f"{n} in {src} routes to {got[0]} experts, its config.json says num_experts "
                                   f"{d.num_experts}: fix the config")
            if tuple(got) != tuple(want):
                raise ConvertError(f"shape mismatch for {n}: checkpoint has {list(got)}, config implies {list(want)}")
            used.add(n)
        kinds = {st.info(n).dtype for n in srcs}
        if len(kinds) > 1:
            raise ConvertError(f"{u.mname}: its HF tensors {list(srcs)} have different dtypes {sorted(map(str, kinds))}")
        dtypes[u.mname] = kinds.pop() if kinds else None
    base_dtype = st.info("model.embed_tokens.weight").dtype
    for u in units:
        dtypes[u.mname] = dtypes.get(u.mname) or base_dtype
    unused = sorted(set(st.keys()) - used)
    mtp = [n for n in unused if d.is_mtp_tensor(n)]
    if mtp:  # DeepSeek-V3 / GLM-4.5 ship their multi-token-prediction module as one more layer
        log(f"skipping the multi-token-prediction layer(s) {sorted({'.'.join(n.split('.')[:3]) for n in mtp})} "
            f"({len(mtp)} tensors): not part of the policy RL trains, and not exported")
        unused = sorted(set(unused) - set(mtp))
    extra = [n for n in unused if is_hf_moe_tensor(n)]
    if extra:  # never drop experts: a config / checkpoint mismatch, not unused heads
        raise ConvertError(f"{src} holds {extra[0]} (and {len(extra) - 1} more expert tensors) beyond its config's "
                           f"{d.num_experts} experts / MoE layers {[i for i, m in enumerate(d.moe_layers) if m]}: "
                           "fix num_experts / mlp_only_layers in config.json")
    if unused:
        log(f"ignoring {len(unused)} HF tensor(s) not used by the {kind}: {', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}")
    return dtypes


def _megatron_tensor_producer(st, d: ModelDims, fresh_head: bool, seed: int):
    """Item -> its global megatron tensor, read from the HF files when save_lazy asks for it."""

    def produce(it: Item) -> torch.Tensor:
        u: Unit = it.payload
        if fresh_head and u.mname == "output_layer.weight":
            from megappo.models.gpt import ValueHead

            return ValueHead(d.hidden_size, dtype=torch.float32, seed=seed).weight.detach().to(it.dtype)
        if u.mname == "output_layer.bias" and (fresh_head or "score.bias" not in st):
            return torch.zeros(1, dtype=it.dtype)
        # Fast paths read HF bytes straight into the global tensor (one copy, no temporaries); they are
        # weight_mapping's TP=1 layouts: vocab rows zero-padded, fc1 = [gate; up], row-parallel and
        # replicated tensors unchanged. linear_qkv (grouped per query group) goes through weight_mapping.
        kind = fast_kind(u)
        if kind == "vocab":
            full = torch.zeros(u.shape, dtype=it.dtype)
            st.get(u.hf[0], out=full[: d.vocab_size])
            return full
        if kind == "fc1":
            full = torch.empty(u.shape, dtype=it.dtype)
            gate, up = full.chunk(2, dim=0)
            st.get(u.hf[0], out=gate)
            st.get(u.hf[1], out=up)
            return full
        if kind == "same":
            return st.get(u.hf[0])
        return hf_to_megatron_full(u.mname, {n: st.get(n) for n in u.hf}, d, tp_size=1)

    return produce


def _hf_to_mcore_info(src: Path, arch, src_kind, kind, family, st, d: ModelDims, fresh_head: bool, seed: int,
                      layout: tuple, items: list) -> dict:
    """What megappo_convert.json records: what was converted from where, and how."""
    tp, pp, vpp, ep = layout
    value_head = None
    if kind == "critic":
        value_head = f"fresh (ValueHead init, seed {seed})" if fresh_head else \
            "score.weight" + (" + score.bias" if "score.bias" in st else " (bias 0)")
    return {
        "format": FORMAT,
        "direction": "hf-to-mcore",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {"path": str(src.resolve()), "architecture": arch, "kind": src_kind,
                   "files": {p.name: p.stat().st_size for p in sorted(src.glob("*.safetensors"))}},
        "model": kind,
        "family": family,
        "value_head": value_head,
        "layout_hint": {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep},
        "vocab_size": d.vocab_size,
        "padded_vocab_size": d.padded_vocab_size,
        "tied_embeddings": d.tied_embeddings,
        "tensors": {it.key: {"shape": list(it.payload.stored_shape), "dtype": str(it.dtype).removeprefix("torch.")}
                    for it in items if it.shape is not None},
        "versions": _versions(),
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for pkg in ("megatron-core", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out
