"""HF <-> megatron-core dist checkpoint conversion, one tensor at a time.

hf_to_mcore: HF safetensors dir -> megatron torch_dist checkpoint dir (loadable at any TP/PP/VPP whose
             padded vocab matches: lcm(128, tp) padding, the same for every power-of-two TP <= 128),
             with the HF config.json, tokenizer files, generation_config.json and megappo_convert.json
             (what was converted from where, and how) next to the tensors.
mcore_to_hf: megatron torch_dist checkpoint (ours, or one saved by MegatronEngine.save_checkpoint,
             optimizer state ignored) -> complete HF dir: config.json, sharded safetensors + index,
             tokenizer files, generation_config.json.

All name and layout knowledge comes from megappo/parallel/weight_mapping.py (the resharder uses the
same functions). The GLOBAL megatron tensor of a parameter is what weight_mapping produces at TP=1
(e.g. linear_fc1 = [gate; up], linear_qkv grouped per query group): that is exactly what megatron's
sharded_state_dict declares for every TP (ColumnParallelLinear: TP shards concatenated along dim 0;
SwiGLU fc1: apply_swiglu_sharded_factory puts every rank's gate half in the first half of the global
tensor and its up half in the second), so any TP loads its own shard from it.

Memory: every tensor is read, transformed and written on its own; peak RSS stays around twice the
largest tensor (plus the interpreter), whatever the model size.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megappo.parallel.weight_mapping import (ModelDims, hf_names, hf_to_megatron_full, is_hf_moe_tensor,
                                             megatron_name, megatron_param_names, megatron_shards_to_hf,
                                             routed_expert, transformer_config_kwargs)
from tools.convert_ckpt.dcp_io import CheckpointReader, Item, save_lazy
from tools.convert_ckpt.errors import ConvertError, read_json
from tools.convert_ckpt.safetensors_io import SafetensorsDir, ShardedWriter, parse_size

ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "causal-lm"),
    "Qwen2ForCausalLM": ("qwen2", "causal-lm"),
    "MistralForCausalLM": ("mistral", "causal-lm"),
    "Qwen3ForCausalLM": ("qwen3", "causal-lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "causal-lm"),
    "MixtralForCausalLM": ("mixtral", "causal-lm"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
    "MistralForSequenceClassification": ("mistral", "reward"),
    "Qwen3ForSequenceClassification": ("qwen3", "reward"),
    "Qwen3MoeForSequenceClassification": ("qwen3_moe", "reward"),
    "MixtralForSequenceClassification": ("mixtral", "reward"),
}
CAUSAL_LM = {fam: arch for arch, (fam, k) in ARCHITECTURES.items() if k == "causal-lm"}
SEQ_CLS = {fam: arch for arch, (fam, k) in ARCHITECTURES.items() if k == "reward"}
# layers of megatron's local spec whose `_extra_state` is a (None) ShardedObject in every checkpoint
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
              "generation_config.json")
INFO_FILE = "megappo_convert.json"
FORMAT = "megappo-convert/1"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a routed expert's parameter: megatron's SequentialMLP checkpoints all experts of a layer as one key
# `...mlp.experts.experts.<fc>` with a leading global-expert axis (its sharded_state_dict)


def _log(msg: str) -> None:
    print(f"convert_ckpt: {msg}", file=sys.stderr, flush=True)


# ---- model description --------------------------------------------------------------------------


def read_hf_config(model_dir) -> tuple[dict, str, str, str]:
    """(raw config.json, architecture, family, 'causal-lm' | 'reward'), or a one-line ConvertError."""
    d = Path(model_dir)
    f = d if d.is_file() else d / "config.json"
    raw = read_json(f, f"no config.json in {d}")
    mt = raw.get("model_type")
    archs = raw.get("architectures") or ([CAUSAL_LM[mt]] if mt in CAUSAL_LM else [])
    arch = archs[0] if archs else f"(none, model_type {mt!r})"
    if arch not in ARCHITECTURES or ARCHITECTURES[arch][0] != mt:
        raise ConvertError(f"unsupported architecture {arch} (model_type {mt!r}); supported: {', '.join(ARCHITECTURES)}")
    family, kind = ARCHITECTURES[arch]
    if kind == "reward" and int(raw.get("num_labels", len(raw.get("id2label") or {0: 0}))) != 1:
        raise ConvertError(f"{arch} with {len(raw.get('id2label') or {})} labels: only num_labels=1 (a scalar reward / value) is supported")
    return raw, arch, family, kind


def load_config_object(config_file: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(config_file.parent))
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ConvertError(f"cannot read {config_file} with transformers: {e.__class__.__name__}: {e}") from None


def checked_dims(hf_config, tp: int, value_head: bool) -> ModelDims:
    """weight_mapping's ModelDims of a config megatron can build, else a one-line ConvertError."""
    try:
        transformer_config_kwargs(hf_config)  # refuses unsupported activations, sliding windows, rope types
        return ModelDims.from_hf_config(hf_config, tp=tp, value_head=value_head)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def megatron_shape(name: str, d: ModelDims) -> tuple:
    h, hd = d.hidden_size, d.head_dim
    if ".mlp.experts.local_experts." in name:  # one routed expert: a dense MLP of moe_ffn_hidden_size
        return (2 * d.moe_ffn_hidden_size, h) if name.endswith("linear_fc1.weight") else (h, d.moe_ffn_hidden_size)
    if name.endswith("mlp.router.weight"):
        return (d.num_experts, h)
    if name == "embedding.word_embeddings.weight" or (name == "output_layer.weight" and not d.value_head):
        return (d.padded_vocab_size, h)
    if name == "output_layer.weight":
        return (1, h)
    if name == "output_layer.bias":
        return (1,)
    if name.endswith("q_layernorm.weight") or name.endswith("k_layernorm.weight"):
        return (hd,)  # qwen3: per head
    if name.endswith("layer_norm_weight") or name.endswith("layernorm.weight"):
        return (h,)
    if name.endswith("linear_qkv.weight"):
        return ((d.num_heads + 2 * d.num_kv_heads) * hd, h)
    if name.endswith("linear_qkv.bias"):
        return ((d.num_heads + 2 * d.num_kv_heads) * hd,)
    if name.endswith("linear_proj.weight"):
        return (h, d.num_heads * hd)
    if name.endswith("linear_fc1.weight"):
        return (2 * d.ffn_hidden_size, h)
    if name.endswith("linear_fc2.weight"):
        return (h, d.ffn_hidden_size)
    raise KeyError(name)


def hf_shape(name: str, d: ModelDims) -> tuple:
    h, hd = d.hidden_size, d.head_dim
    if is_hf_moe_tensor(name):
        if ".experts." not in name:  # the router
            return (d.num_experts, h)
        down = megatron_name(name, d).endswith("linear_fc2.weight")
        return (h, d.moe_ffn_hidden_size) if down else (d.moe_ffn_hidden_size, h)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (d.vocab_size, h)
    if name == "score.weight":
        return (1, h)
    if name == "score.bias":
        return (1,)
    if name.endswith("self_attn.q_norm.weight") or name.endswith("self_attn.k_norm.weight"):
        return (hd,)  # qwen3: per head
    if name.endswith("norm.weight"):
        return (h,)
    for proj, rows in (("q_proj", d.num_heads * hd), ("k_proj", d.num_kv_heads * hd), ("v_proj", d.num_kv_heads * hd)):
        if name.endswith(f"self_attn.{proj}.weight"):
            return (rows, h)
        if name.endswith(f"self_attn.{proj}.bias"):
            return (rows,)
    if name.endswith("self_attn.o_proj.weight"):
        return (h, d.num_heads * hd)
    if name.endswith("mlp.gate_proj.weight") or name.endswith("mlp.up_proj.weight"):
        return (d.ffn_hidden_size, h)
    if name.endswith("mlp.down_proj.weight"):
        return (h, d.ffn_hidden_size)
    raise KeyError(name)


@dataclass(frozen=True)
class Unit:
    """One megatron parameter: global name, checkpoint key, shape, HF sources. `index` is its position
    along the key's stacked leading axis of size `stack` (the layer axis of a homogeneous model, or a MoE
    layer's expert axis); None: the key is this tensor alone."""

    mname: str
    key: str
    index: Optional[int]
    stack: int
    shape: tuple
    hf: tuple

    @property
    def is_vocab(self) -> bool:
        return self.shape[0] > 1 and self.mname in ("embedding.word_embeddings.weight", "output_layer.weight")

    @property
    def stored_shape(self) -> tuple:
        return ((self.stack,) if self.index is not None else ()) + self.shape


def _fast_kind(u: Unit) -> str:
    """How a unit's global megatron tensor relates to its HF tensors at TP=1 (see weight_mapping):
    vocab (zero-padded rows), fc1 ([gate; up]), same (identical tensor), or mapped (linear_qkv)."""
    if u.is_vocab:
        return "vocab"
    if u.mname.endswith("linear_fc1.weight"):
        return "fc1"
    if "linear_qkv.weight" in u.mname or "linear_qkv.bias" in u.mname:
        return "mapped"
    return "same"


def megatron_units(d: ModelDims) -> list[Unit]:
    """Every parameter with the key megatron's sharded_state_dict (local spec) gives it. A dense model
    stacks each layer parameter into one [num_layers, ...] key; with MoE layers megatron keys every layer
    on its own (TransformerBlock's non_homogeneous_layers, forced by an explicit moe_layer_freq) and
    stacks a layer's experts along a [num_experts, ...] axis."""
    per_layer = bool(d.moe_layers)
    units = []
    for name in megatron_param_names(d, te_fused_norms=True):  # megatron's checkpoint names for the norms
        shape, hf = megatron_shape(name, d), tuple(hf_names(name, d))
        e = routed_expert(name)
        m = _LAYER_RE.match(name)
        if e is not None:  # decoder.layers.L.mlp.experts.local_experts.{e}.x -> decoder.layers.L.mlp.experts.experts.x
            units.append(Unit(name, name.replace(f".local_experts.{e}.", ".experts."), e, d.num_experts, shape, hf))
        elif m and not per_layer:
            units.append(Unit(name, f"decoder.layers.{m.group(2)}", int(m.group(1)), d.num_layers, shape, hf))
        else:  # the local spec stores a MoE layer's separate pre-MLP norm under the fused name, as a dense one's
            key = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
            units.append(Unit(name, key, None, 0, shape, hf))
    return units


def extra_state_items(d: ModelDims) -> list[Item]:
    """The (None) `_extra_state` ShardedObjects of the local spec's linears, keyed like the parameters."""
    if not d.moe_layers:
        return [Item(f"decoder.layers.{m}._extra_state", None, None, layer, d.num_layers)
                for layer in range(d.num_layers) for m in EXTRA_STATE_MODULES]
    items = []
    for layer in range(d.num_layers):
        p = f"decoder.layers.{layer}."
        if d.is_moe_layer(layer):
            items += [Item(f"{p}{m}._extra_state", None, None, 0, 1) for m in EXTRA_STATE_MODULES[:2]]
            items += [Item(f"{p}mlp.experts.experts.{fc}._extra_state", None, None, e, d.num_experts)
                      for fc in ("linear_fc1", "linear_fc2") for e in range(d.num_experts)]
        else:
            items += [Item(f"{p}{m}._extra_state", None, None, 0, 1) for m in EXTRA_STATE_MODULES]
    return items


# ---- output dir ---------------------------------------------------------------------------------


def _check_out(out: Path, overwrite: bool, sources) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"--out {out} exists and is not a directory")
    ro = out.resolve()
    for s in sources:
        rs = Path(s).resolve()
        if ro == rs or ro in rs.parents:
            raise ConvertError(f"--out {out} would replace the source {s}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConvertError(f"output dir {out} is not empty (pass --overwrite to replace it)")


@contextmanager
def atomic_dir(out: Path, overwrite: bool, sources=()):
    """Yield a temp dir beside `out`; on success it replaces `out` by rename, on any failure it is
    removed, so `out` is never half-written."""
    _check_out(out, overwrite, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        _check_out(out, overwrite, sources)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old is not None:
                old.rename(out)  # put the previous output back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def copy_hf_files(model_dir: Path, dst: Path, tokenizer_dir: Optional[Path] = None) -> list[str]:
    """A HF dir's config.json + tokenizer / generation files into `dst` (e.g. a checkpoint's role dir,
    which mcore_to_hf then exports on its own)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(model_dir) / "config.json", dst / "config.json")
    return ["config.json"] + _copy_side_files(Path(tokenizer_dir or model_dir), dst)


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


class _Progress:
    def __init__(self, desc: str, total_bytes: int, total_tensors: int, enabled: bool):
        self.n_tensors, self.total_tensors = 0, total_tensors
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                            file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
            self.bar.set_postfix_str(f"tensors 0/{total_tensors}")

    def step(self, nbytes: int) -> None:
        self.n_tensors += 1
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"tensors {self.n_tensors}/{self.total_tensors}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- HF -> megatron -----------------------------------------------------------------------------


def hf_to_mcore(hf_dir, out_dir, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, model: str = "auto",
                seed: int = 1234, overwrite: bool = False, progress: bool = True, ep: int = 1) -> dict:
    """Convert a HF model dir into a megatron torch_dist checkpoint dir; returns the recorded info.
    model: auto (causal LM -> actor, ...ForSequenceClassification -> critic with its `score` head),
    actor, or critic (from a causal LM: a fresh value head, seeded)."""
    t0 = time.monotonic()
    src, out = Path(hf_dir), Path(out_dir)
    if not src.is_dir():
        raise ConvertError(f"HF model dir {src} does not exist")
    _check_out(out, overwrite, [src])
    raw, arch, family, src_kind = read_hf_config(src)
    kind = _target_kind(model, src_kind, arch)
    d = checked_dims(load_config_object(src / "config.json"), tp, value_head=kind == "critic")
    _check_layout(d, tp, pp, vpp, ep)
    st = SafetensorsDir(src)
    units = megatron_units(d)
    fresh_head = kind == "critic" and src_kind == "causal-lm"
    dtypes = _check_hf_tensors(st, units, d, src, kind, fresh_head)
    items = [Item(u.key, u.shape, dtypes[u.mname], u.index, u.stack, payload=u) for u in units]
    items += extra_state_items(d)
    info = _hf_to_mcore_info(src, arch, src_kind, kind, family, st, d, fresh_head, seed, (tp, pp, vpp, ep), items)
    bar = _Progress(f"hf-to-mcore {src.name}", sum(it.nbytes for it in items),
                    sum(1 for it in items if it.shape is not None), progress)
    try:
        with atomic_dir(out, overwrite, [src]) as tmp:
            save_lazy(tmp, items, _megatron_tensor_producer(st, d, fresh_head, seed),
                      on_done=lambda it: bar.step(it.nbytes) if it.shape is not None else None)
            shutil.copy2(src / "config.json", tmp / "config.json")
            info["side_files"] = _copy_side_files(src, tmp)
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
            got, want = st.info(n).shape, hf_shape(n, d)
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
    extra = [n for n in unused if is_hf_moe_tensor(n)]
    if extra:  # never drop experts: a config / checkpoint mismatch, not unused heads
        raise ConvertError(f"{src} holds {extra[0]} (and {len(extra) - 1} more expert tensors) beyond its config's "
                           f"{d.num_experts} experts / MoE layers {[i for i, m in enumerate(d.moe_layers) if m]}: "
                           "fix num_experts / mlp_only_layers in config.json")
    if unused:
        _log(f"ignoring {len(unused)} HF tensor(s) not used by the {kind}: {', '.join(unused[:4])}{' ...' if len(unused) > 4 else ''}")
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
        kind = _fast_kind(u)
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


# ---- megatron -> HF -----------------------------------------------------------------------------

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def mcore_to_hf(ckpt_dir, out_dir, config: Optional[str] = None, dtype: Optional[str] = None,
                max_shard_size: str = "5GB", overwrite: bool = False, progress: bool = True) -> dict:
    """Export a megatron torch_dist checkpoint (actor or critic) as a complete HF model dir."""
    t0 = time.monotonic()
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    if not ckpt.is_dir():
        raise ConvertError(f"checkpoint dir {ckpt} does not exist")
    _check_out(out, overwrite, [ckpt])
    cast = _cast_dtype(dtype)
    reader = CheckpointReader(ckpt)
    cfg_file = _config_file(ckpt, config)
    raw, arch, family, src_kind = read_hf_config(cfg_file)
    tensors = reader.tensors()
    if "embedding.word_embeddings.weight" not in tensors:
        raise ConvertError(f"{ckpt} holds no embedding.word_embeddings.weight: not a megatron GPT checkpoint")
    kind = "critic" if "output_layer.bias" in tensors else "actor"
    if kind == "actor" and src_kind == "reward":
        raise ConvertError(f"{ckpt} has an LM head but its config is {arch}")
    d = _checkpoint_dims(load_config_object(cfg_file), tensors, kind)
    units = _check_mcore_tensors(megatron_units(d), tensors, d, ckpt)
    if kind == "actor" and d.tied_embeddings and "output_layer.weight" in tensors:
        _log("config ties the embeddings: the checkpoint's separate output_layer.weight is not exported")
    keep_bias = kind == "critic" and _value_bias_nonzero(reader)
    specs = [(n, hf_shape(n, d), cast or tensors[u.key].properties.dtype)
             for u in units for n in u.hf if n != "score.bias" or keep_bias]
    out_cfg = _hf_output_config(raw, kind, src_kind, family, cast)
    side_src = ckpt if any((ckpt / f).exists() for f in SIDE_FILES) else cfg_file.parent
    bar = None
    try:
        with atomic_dir(out, overwrite, [ckpt]) as tmp:
            writer = ShardedWriter(tmp, specs, parse_size(max_shard_size))
            bar = _Progress(f"mcore-to-hf {ckpt.name}", writer.total_bytes, len(specs), progress)
            for name, tensor in _hf_tensors(reader, units, d):
                if name != "score.bias" or keep_bias:
                    bar.step(writer.write(name, tensor if cast is None else tensor.to(cast)))
            writer.finish()
            if out_cfg == raw:
                shutil.copy2(cfg_file, tmp / "config.json")
            else:
                (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
            copied = _copy_side_files(side_src, tmp)
    finally:
        if bar is not None:
            bar.close()
    return {"direction": "mcore-to-hf", "model": kind, "architecture": out_cfg["architectures"][0],
            "tensors": len(specs), "bytes": writer.total_bytes, "shards": len(set(writer.index["weight_map"].values())),
            "side_files": copied, "seconds": round(time.monotonic() - t0, 3)}


def _cast_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    if dtype in (None, "auto"):
        return None
    if dtype not in _DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _config_file(ckpt: Path, config: Optional[str]) -> Path:
    cfg_dir = Path(config) if config else ckpt
    cfg_file = cfg_dir if cfg_dir.is_file() else cfg_dir / "config.json"
    if not cfg_file.exists():
        raise ConvertError(f"no config.json in {cfg_dir}: pass --config with the model's HF config dir")
    return cfg_file


def _checkpoint_dims(hf_config, tensors: dict, kind: str) -> ModelDims:
    """The config's dims with the checkpoint's own padded vocab (the rows it was saved with)."""
    d = checked_dims(hf_config, 1, value_head=kind == "critic")
    rows = tensors["embedding.word_embeddings.weight"].size[0]
    if rows < d.vocab_size:
        raise ConvertError(f"shape mismatch for embedding.word_embeddings.weight: checkpoint has {rows} rows, "
                           f"config vocab_size is {d.vocab_size}")
    return dataclasses.replace(d, padded_vocab_size=rows)


def _check_mcore_tensors(units: list["Unit"], tensors: dict, d: ModelDims, ckpt: Path) -> list["Unit"]:
    """Every unit's key is in the checkpoint with the shape the config implies; returns the units with
    the key found (a MoE layer's pre-MLP norm is `pre_mlp_layernorm.weight` when the TE spec wrote it)."""
    found = []
    for u in units:
        if u.key not in tensors and u.mname.endswith(".pre_mlp_layernorm.weight") and u.mname in tensors:
            u = dataclasses.replace(u, key=u.mname)
        if u.key not in tensors:
            raise ConvertError(f"missing tensor {u.key} in {ckpt} (needed for {u.mname})")
        got = tuple(tensors[u.key].size)
        if got != u.stored_shape:
            expert_axis = ".experts.experts." in u.key or u.key.endswith(".mlp.router.weight")
            if expert_axis and got[1:] == u.stored_shape[1:] and got[0] != d.num_experts:
                raise ConvertError(f"{u.key} in {ckpt} holds {got[0]} experts, the config's num_experts is "
                                   f"{d.num_experts}: pass --config with the model's own config.json")
            raise ConvertError(f"shape mismatch for {u.key}: checkpoint has {list(got)}, config implies {list(u.stored_shape)}")
        found.append(u)
    return found


def _value_bias_nonzero(reader) -> bool:
    bias = reader.read("output_layer.bias")
    nonzero = bool(bias.abs().max() > 0)
    if nonzero:
        _log(f"value head bias is {bias.item():.6g}: HF ...ForSequenceClassification has no score bias; "
             "it is kept as score.bias (megappo loads it; transformers ignores it)")
    return nonzero


def _hf_output_config(raw: dict, kind: str, src_kind: str, family: str, cast: Optional[torch.dtype]) -> dict:
    """config.json of the export: a critic saved from a causal-LM config becomes *ForSequenceClassification."""
    out_cfg = dict(raw)
    if kind == "critic" and src_kind == "causal-lm":
        out_cfg["architectures"] = [SEQ_CLS[family]]
        out_cfg["id2label"] = {"0": "LABEL_0"}
        out_cfg["label2id"] = {"LABEL_0": 0}
        out_cfg.pop("num_labels", None)
    if cast is not None:
        name = str(cast).removeprefix("torch.")
        for k in ("dtype", "torch_dtype"):
            if k in out_cfg or k == "dtype":
                out_cfg[k] = name
    return out_cfg


def _hf_tensors(reader, units: list["Unit"], d: ModelDims):
    """(HF name, tensor) of every unit, read one megatron tensor (of one layer) at a time."""
    for u in units:
        if u.index is None:
            t = reader.read(u.key)
        else:  # one layer (or one expert) of a stacked key
            t = reader.read(u.key, (u.index,) + (0,) * len(u.shape), (1,) + u.shape)[0]
        fk = _fast_kind(u)  # views instead of copies for weight_mapping's TP=1 identities
        if fk == "vocab":
            hf = {u.hf[0]: t[: d.vocab_size]}
        elif fk == "fc1":
            hf = dict(zip(u.hf, t.chunk(2, dim=0)))
        elif fk == "same":
            hf = {u.hf[0]: t}
        else:
            hf = megatron_shards_to_hf(u.mname, [t], d)
        del t
        yield from hf.items()
        del hf
