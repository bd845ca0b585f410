"""HF <-> megatron-core dist checkpoint conversion, one tensor at a time: what both directions share
(architectures, shapes, the unit of conversion, output dirs written atomically, progress). The two
directions are to_mcore.py (hf_to_mcore) and to_hf.py (mcore_to_hf).

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

import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megappo.parallel.weight_mapping import (HF_ROUTER_BIAS, VISION_PREFIX, ModelDims, hf_names, is_hf_moe_tensor,
                                             megatron_name, megatron_param_names, mla_attention_names, mla_shapes,
                                             routed_expert, transformer_config_kwargs)
from megappo.conversion.dcp_io import Item
from megappo.conversion.errors import ConvertError, read_json

ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "causal-lm"),
    "Qwen2ForCausalLM": ("qwen2", "causal-lm"),
    "MistralForCausalLM": ("mistral", "causal-lm"),
    "Qwen3ForCausalLM": ("qwen3", "causal-lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "causal-lm"),
    "MixtralForCausalLM": ("mixtral", "causal-lm"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "causal-lm"),
    "Glm4MoeForCausalLM": ("glm4_moe", "causal-lm"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "causal-lm"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "causal-lm"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
    "MistralForSequenceClassification": ("mistral", "reward"),
    "Qwen3ForSequenceClassification": ("qwen3", "reward"),
    "Qwen3MoeForSequenceClassification": ("qwen3_moe", "reward"),
    "MixtralForSequenceClassification": ("mixtral", "reward"),
    "Qwen2MoeForSequenceClassification": ("qwen2_moe", "reward"),
}
CAUSAL_LM = {fam: arch for arch, (fam, k) in ARCHITECTURES.items() if k == "causal-lm"}
SEQ_CLS = {fam: arch for arch, (fam, k) in ARCHITECTURES.items() if k == "reward"}
# layers of megatron's local spec whose `_extra_state` is a (None) ShardedObject in every checkpoint
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
              "generation_config.json",
              # a vision-language model's processor (its image processor's settings: vLLM and transformers read them)
              "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
INFO_FILE = "megappo_convert.json"
FORMAT = "megappo-convert/1"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def log(msg: str) -> None:
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
    if d.mla and ".self_attention." in name:
        return mla_shapes(d)[name.rsplit(".self_attention.", 1)[1]]
    if ".mlp.experts.local_experts." in name:  # one routed expert: a dense MLP of moe_ffn_hidden_size
        return (2 * d.moe_ffn_hidden_size, h) if name.endswith("linear_fc1.weight") else (h, d.moe_ffn_hidden_size)
    if ".mlp.shared_experts." in name:  # the shared expert: a dense MLP of its own size (and its gate)
        f = d.shared_expert_ffn
        return {"linear_fc1.weight": (2 * f, h), "linear_fc2.weight": (h, f), "gate_weight": (1, h)}[
            name.rsplit("shared_experts.", 1)[1]]
    if name.endswith("mlp.router.weight"):
        return (d.num_experts, h)
    if name.endswith("mlp.router.expert_bias"):
        return (d.num_experts,)
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


def source_shape(u: "Unit", name: str, d: ModelDims) -> tuple:
    """The shape of HF tensor `name`, one of unit `u`'s sources: the vision tower's are the unit's own."""
    return u.shape if name.startswith(VISION_PREFIX) else hf_shape(name, d)


def hf_shape(name: str, d: ModelDims) -> tuple:
    h, hd = d.hidden_size, d.head_dim
    if d.mla and ".self_attn." in name:
        return megatron_shape(megatron_name(name, d), d)
    mname = megatron_name(name, d) if d.shared_expert_ffn and ".layers." in name else ""
    if ".mlp.shared_experts." in mname:  # HF's shape of the shared expert's tensors: megatron's, split back
        shape = megatron_shape(mname, d)
        return (shape[0] // 2, h) if mname.endswith("linear_fc1.weight") else shape
    if is_hf_moe_tensor(name):
        if name.endswith(HF_ROUTER_BIAS):  # the router's correction bias
            return (d.num_experts,)
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


def fast_kind(u: Unit) -> str:
    """How a unit's global megatron tensor relates to its HF tensors at TP=1 (see weight_mapping):
    vocab (zero-padded rows), fc1 ([gate; up]), same (identical tensor), or mapped (linear_qkv)."""
    if u.is_vocab:
        return "vocab"
    if u.mname.endswith("linear_fc1.weight"):
        return "fc1"
    if "linear_qkv.weight" in u.mname or "linear_qkv.bias" in u.mname:
        return "mapped"
    return "same"


def megatron_units(d: ModelDims, hf_config=None) -> list[Unit]:
    """Every parameter with the key megatron's sharded_state_dict (local spec) gives it. A dense model
    stacks each layer parameter into one [num_layers, ...] key; with MoE layers megatron keys every layer
    on its own (TransformerBlock's non_homogeneous_layers, forced by an explicit moe_layer_freq) and
    stacks a layer's experts along a [num_experts, ...] axis. A vision-language model's vision tower (read
    from `hf_config`) is keyed by its HF names, whole (megatron's default for a module of plain torch)."""
    per_layer = bool(d.moe_layers)
    units = []
    if d.vision:
        from megappo.models.vision import vision_tensors

        units += [Unit(name, name, None, 0, shape, (name,)) for name, shape in vision_tensors(hf_config).items()]
    for name in megatron_param_names(d, te_fused_norms=True):  # megatron's checkpoint names for the norms
        shape, hf = megatron_shape(name, d), tuple(hf_names(name, d))
        e = routed_expert(name)
        m = _LAYER_RE.match(name)
        if e is not None:  # decoder.layers.L.mlp.experts.local_experts.{e}.x -> decoder.layers.L.mlp.experts.experts.x
            units.append(Unit(name, name.replace(f".local_experts.{e}.", ".experts."), e, d.num_experts, shape, hf))
        elif m and not per_layer:
            units.append(Unit(name, f"decoder.layers.{m.group(2)}", int(m.group(1)), d.num_layers, shape, hf))
        elif d.mla:  # megatron's MLA layer spec keeps its norms under their own names
            units.append(Unit(name, name, None, 0, shape, hf))
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
    attention = EXTRA_STATE_MODULES[:2]
    if d.mla:
        attention = tuple(f"self_attention.{n.split('.')[1]}" for n in mla_attention_names(d)
                          if ".linear_" in n)
    for layer in range(d.num_layers):
        p = f"decoder.layers.{layer}."
        if d.is_moe_layer(layer):
            items += [Item(f"{p}{m}._extra_state", None, None, 0, 1) for m in attention]
            if d.shared_expert_ffn:
                items += [Item(f"{p}mlp.shared_experts.{fc}._extra_state", None, None, 0, 1)
                          for fc in ("linear_fc1", "linear_fc2")]
            items += [Item(f"{p}mlp.experts.experts.{fc}._extra_state", None, None, e, d.num_experts)
                      for fc in ("linear_fc1", "linear_fc2") for e in range(d.num_experts)]
        else:
            items += [Item(f"{p}{m}._extra_state", None, None, 0, 1) for m in attention + EXTRA_STATE_MODULES[2:]]
    return items


# ---- output dir ---------------------------------------------------------------------------------


def check_out(out: Path, overwrite: bool, sources) -> None:
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
    check_out(out, overwrite, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        check_out(out, overwrite, sources)
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
    return ["config.json"] + copy_side_files(Path(tokenizer_dir or model_dir), dst)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


class Progress:
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
