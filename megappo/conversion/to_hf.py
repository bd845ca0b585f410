"""megatron torch_dist checkpoint (ours, or one MegatronEngine.save_checkpoint wrote; optimizer state
ignored) -> complete HF dir, one tensor at a time (see core.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from megappo.parallel.weight_mapping import ModelDims, kept_in_fp32, megatron_shards_to_hf
from megappo.conversion.core import (SEQ_CLS, SIDE_FILES, Progress, Unit, atomic_dir, check_out, checked_dims,
                                     copy_side_files, fast_kind, load_config_object, log, source_shape,
                                     megatron_units, read_hf_config)
from megappo.conversion.dcp_io import CheckpointReader
from megappo.conversion.errors import ConvertError
from megappo.conversion.safetensors_io import ShardedWriter, parse_size
from megappo.conversion.vllm_config import vllm_config_fixes


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


def mcore_to_hf(ckpt_dir, out_dir, config: Optional[str] = None, dtype: Optional[str] = None,
                max_shard_size: str = "5GB", overwrite: bool = False, progress: bool = True) -> dict:
    """Export a megatron torch_dist checkpoint (actor or critic) as a complete HF model dir."""
    t0 = time.monotonic()
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    if not ckpt.is_dir():
        raise ConvertError(f"checkpoint dir {ckpt} does not exist")
    check_out(out, overwrite, [ckpt])
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
    hf_config = load_config_object(cfg_file)
    d = _checkpoint_dims(hf_config, tensors, kind)
    units = _check_mcore_tensors(megatron_units(d, hf_config), tensors, d, ckpt)
    if kind == "actor" and d.tied_embeddings and "output_layer.weight" in tensors:
        log("config ties the embeddings: the checkpoint's separate output_layer.weight is not exported")
    keep_bias = kind == "critic" and _value_bias_nonzero(reader)
    def cast_of(name: str):  # a router's correction bias stays fp32, as transformers keeps it (_keep_in_fp32)
        return None if kept_in_fp32(name) else cast

    specs = [(n, source_shape(u, n, d), cast_of(n) or tensors[u.key].properties.dtype)
             for u in units for n in u.hf if n != "score.bias" or keep_bias]
    out_cfg = _hf_output_config(raw, kind, src_kind, family, cast)
    if d.mtp_layers:  # megatron holds the decoder's layers only: vLLM's MTP drafting would find no weights
        out_cfg["num_nextn_predict_layers"] = 0
        log(f"the {d.mtp_layers} multi-token-prediction layer(s) are not exported: num_nextn_predict_layers 0")
    side_src = ckpt if any((ckpt / f).exists() for f in SIDE_FILES) else cfg_file.parent
    bar = None
    try:
        with atomic_dir(out, overwrite, [ckpt]) as tmp:
            writer = ShardedWriter(tmp, specs, parse_size(max_shard_size))
            bar = Progress(f"mcore-to-hf {ckpt.name}", writer.total_bytes, len(specs), progress)
            for name, tensor in _hf_tensors(reader, units, d):
                if name != "score.bias" or keep_bias:
                    bar.step(writer.write(name, tensor if cast_of(name) is None else tensor.to(cast)))
            writer.finish()
            if out_cfg == raw:
                shutil.copy2(cfg_file, tmp / "config.json")
            else:
                (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
            copied = copy_side_files(side_src, tmp)
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
        log(f"value head bias is {bias.item():.6g}: HF ...ForSequenceClassification has no score bias; "
             "it is kept as score.bias (megappo loads it; transformers ignores it)")
    return nonzero


def _hf_output_config(raw: dict, kind: str, src_kind: str, family: str, cast: Optional[torch.dtype]) -> dict:
    """config.json of the export: a critic saved from a causal-LM config becomes *ForSequenceClassification; the
    keys vLLM reads otherwise than transformers are written as transformers reads them (conversion/vllm_config.py)."""
    fixes, note = vllm_config_fixes(raw)
    if fixes:
        log(note)
    out_cfg = dict(raw, **fixes)
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
        fk = fast_kind(u)  # views instead of copies for weight_mapping's TP=1 identities
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
