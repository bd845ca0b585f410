"""`megappo export --ckpt <output_dir>/checkpoints/step_N --out DIR [--role actor|critic] [--dtype ...]`:
a trained policy (or critic) as a plain HF model dir.

DIR gets safetensors + config.json + generation_config.json + the tokenizer files, so
`AutoModelForCausalLM.from_pretrained(DIR)` and `vllm.LLM(DIR)` load it with no megappo import. The
tensors go through the converter's streaming megatron -> HF path (megappo/conversion, the one
HF <-> Megatron mapping); the critic exports in the converter's reward-model layout
(*ForSequenceClassification, `score` = the value head).

The HF config and tokenizer come from the checkpoint itself (the trainer copies them next to each
role's tensors) or, for checkpoints written before it did, from the run's `model.path` (read from
`<output_dir>/config.json`). `trainer.export_hf: true` runs this on the final checkpoint into
`<output_dir>/hf_final/`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROLES = ("actor", "critic")


class ExportError(ValueError):
    """A bad export input; str() is one line naming the fix."""


def _hf_source(ckpt: Path, role: str) -> Path:
    """The dir holding the role's HF config.json (+ tokenizer files)."""
    if (ckpt / role / "config.json").is_file():
        return ckpt / role
    run_cfg = ckpt.parent.parent / "config.json"  # <output_dir>/checkpoints/step_N -> <output_dir>/config.json
    if run_cfg.is_file():
        model = json.loads(run_cfg.read_text()).get("model", {})
        path = (model.get("critic_path") or model.get("path")) if role == "critic" else model.get("path")
        if path and (Path(path) / "config.json").is_file():
            return Path(path)
    raise ExportError(f"{ckpt / role} has no config.json and the run's model.path is not found via {run_cfg}; "
                      "pass --config with the HF model dir the run started from")


def export_checkpoint(ckpt, out, role: str = "actor", dtype: Optional[str] = None, config: Optional[str] = None,
                      overwrite: bool = False, progress: bool = True) -> dict:
    """Export `role` of the megappo checkpoint `ckpt` (a step_N dir) as a HF model dir `out`."""
    from megappo.utils.checkpoint import MANIFEST, is_complete
    from megappo.conversion.to_hf import mcore_to_hf
    from megappo.conversion.errors import ConvertError

    ckpt = Path(ckpt)
    if role not in ROLES:
        raise ExportError(f"--role {role!r}: choose one of {', '.join(ROLES)}")
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint {ckpt} does not exist; pass <output_dir>/checkpoints/step_N")
    if not (ckpt / MANIFEST).exists() and (ckpt / "checkpoints").is_dir():
        newest = sorted((ckpt / "checkpoints").glob("step_*"))
        raise ExportError(f"{ckpt} is a run's output dir; pass one of its checkpoints, e.g. "
                          f"{newest[-1] if newest else ckpt / 'checkpoints' / 'step_N'}")
    if not is_complete(ckpt):
        raise ExportError(f"{ckpt} is a torn checkpoint (no valid {MANIFEST}: the save was cut short); "
                          "export an earlier step")
    if not (ckpt / role).is_dir():
        raise ExportError(f"{ckpt} holds no {role}/ (the run had no {role}); choose --role "
                          f"{' or '.join(r for r in ROLES if (ckpt / r).is_dir())}")
    from megappo.utils.checkpoint import LORA_META

    if (ckpt / role / LORA_META).is_file():  # actor.lora: adapters only, the base is the run's model.path
        base = _lora_base(ckpt, config)
        return export_lora(ckpt / role, out, base, dtype=dtype, overwrite=overwrite)
    try:
        return mcore_to_hf(ckpt / role, out, config=str(config or _hf_source(ckpt, role)), dtype=dtype,
                           overwrite=overwrite, progress=progress)
    except ConvertError as e:
        raise ExportError(str(e)) from None


def _lora_base(ckpt: Path, config: Optional[str]) -> Path:
    """The HF base an adapter checkpoint was trained on: --config, else the run's model.path."""
    if config and any(Path(config).glob("*.safetensors")):
        return Path(config)
    run_cfg = ckpt.parent.parent / "config.json"
    path = json.loads(run_cfg.read_text()).get("model", {}).get("path") if run_cfg.is_file() else None
    if path and any(Path(path).glob("*.safetensors")):
        return Path(path)
    raise ExportError(f"{ckpt} holds LoRA adapters only and the base weights (the run's model.path) are not found "
                      f"via {run_cfg}; pass --config with the HF base model dir")


def read_lora_adapter(role_dir, dims) -> dict:
    """An adapter checkpoint's (engine.save_checkpoint with actor.lora) adapters in peft's layout
    {HF module: (A, B)}, read from megatron's torch_dist files (layers stacked or one key per layer). The
    files hold the full tensors in the TP1 layout whatever TP saved them (fc1's B as [gate; up]): `dims` at tp=1."""
    import re

    from megappo.models.lora_peft import megatron_lora_to_hf
    from megappo.conversion.dcp_io import CheckpointReader

    reader = CheckpointReader(Path(role_dir))
    keys = [k for k in reader.tensors() if k.endswith(".lora_A") and ".optimizer." not in f".{k}"]  # chained_0.optimizer: MoE
    out = {}
    for ka in keys:
        mod = ka.removesuffix(".lora_A")
        a, b = reader.read(ka), reader.read(mod + ".lora_B")
        if re.search(r"\.layers\.\d+\.", mod):  # one key per layer
            per_layer = [(mod, a, b)]
        else:  # layers stacked along dim 0 (megatron's sharded_offsets)
            per_layer = [(mod.replace(".layers.", f".layers.{i}.", 1), a[i], b[i]) for i in range(a.shape[0])]
        if ".mlp.experts.experts." in mod:  # routed experts (SequentialMLP): stacked along the next dim, global index
            per_layer = [(name.replace(".mlp.experts.experts.", f".mlp.experts.local_experts.{e}."), ai[e], bi[e])
                         for name, ai, bi in per_layer for e in range(ai.shape[0])]
        for name, ai, bi in per_layer:
            out.update(megatron_lora_to_hf(name, [ai], [bi], dims))
    return out


def export_lora(role_dir, out, base, dtype: Optional[str] = None, overwrite: bool = False) -> dict:
    """A LoRA actor's checkpoint as (1) a merged HF model dir `out` (the base's safetensors with each adapted
    weight W + alpha/r * B @ A, in float32 unless `dtype` says otherwise, the base's config and tokenizer files) and (2) a peft adapter dir
    `out`/adapter (adapter_config.json + adapter_model.safetensors) for PeftModel.from_pretrained(base, ...)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from megappo.models.gpt import load_hf_config
    from megappo.models.lora import LoraConfig
    from megappo.models.lora_peft import PeftLayoutError, save_peft_adapter
    from megappo.utils.checkpoint import LORA_FORMAT, LORA_META, is_base_of
    from megappo.parallel.weight_mapping import ModelDims, kept_in_fp32

    role_dir, out, base = Path(role_dir), Path(out), Path(base)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty; pass --overwrite or another --out")
    # float32 unless told: W + alpha/r * B @ A rounded back to a bf16 base's dtype loses much of a small delta
    # (SmolLM2's GRPO recipe after 40 steps: 60% held-out where the trained policy scored 70%)
    from megappo.conversion.errors import ConvertError
    from megappo.conversion.to_hf import _cast_dtype, _hf_output_config

    try:
        cast = _cast_dtype(dtype) or torch.float32  # the converter's dtype names; auto: float32 here
    except ConvertError as e:
        raise ExportError(str(e)) from None
    meta = json.loads((role_dir / LORA_META).read_text())
    if meta.get("format") != LORA_FORMAT:
        raise ExportError(f"{role_dir}: adapter checkpoint format {meta.get('format', 1)}, this megappo reads "
                          f"format {LORA_FORMAT}; export it with the megappo version that saved it")
    if not is_base_of(meta.get("base"), base):
        raise ExportError(f"{role_dir}: the adapters were trained on another base than {base} (its config or weight "
                          "files differ); pass --config with the HF dir of the run's model.path")
    cfg = LoraConfig(rank=int(meta["rank"]), alpha=float(meta["alpha"]), target_modules=meta["target_modules"])
    adapter = read_lora_adapter(role_dir, ModelDims.from_hf_config(load_hf_config(base), tp=1))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    merged = 0
    for f in sorted(base.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in list(tensors):
            mod = name.removesuffix(".weight")
            if name.endswith(".weight") and mod in adapter:
                a, b = adapter[mod]
                w = tensors[name]
                tensors[name] = (w.double() + cfg.scaling * (b.double() @ a.double())).to(cast)
                merged += 1
            if tensors[name].is_floating_point() and not kept_in_fp32(name):
                tensors[name] = tensors[name].to(cast)
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    if merged != len(adapter):
        raise ExportError(f"{role_dir}: {len(adapter) - merged} adapted modules have no weight in {base}: another base?")
    for f in base.iterdir():  # config, generation config, tokenizer, the shard index
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    raw = json.loads((base / "config.json").read_text())  # its dtype is the export's
    (out / "config.json").write_text(json.dumps(_hf_output_config(raw, "actor", "causal-lm", "", cast), indent=2))
    try:
        save_peft_adapter(adapter, cfg, base, out / "adapter")
    except PeftLayoutError as e:  # not expressible in peft (a MoE model's dense MLP adapters): the merged model stands
        return {"direction": "lora-to-hf", "merged_modules": merged, "adapter": None, "adapter_skipped": str(e),
                "base": str(base)}
    return {"direction": "lora-to-hf", "merged_modules": merged, "adapter": str(out / "adapter"), "base": str(base)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="a checkpoint dir: <output_dir>/checkpoints/step_N")
    parser.add_argument("--out", required=True, help="the HF model dir to write (must not exist, or be empty)")
    parser.add_argument("--role", default="actor", choices=ROLES, help="the policy (default) or the value model")
    parser.add_argument("--dtype", default=None, help="auto (as saved; a LoRA checkpoint's merged weights: float32) | "
                        "bfloat16 | float16 | float32")
    parser.add_argument("--config", default=None, help="HF model dir for config.json + tokenizer (default: from "
                        "the checkpoint, else the run's model.path)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def main(args: argparse.Namespace) -> int:
    try:
        info = export_checkpoint(args.ckpt, args.out, role=args.role, dtype=args.dtype, config=args.config,
                                 overwrite=args.overwrite)
    except ExportError as e:
        print(f"megappo export: {e}", file=sys.stderr)
        return 1
    if info.get("direction") == "lora-to-hf":
        adapter = f"the peft adapter in {info['adapter']}" if info["adapter"] else \
            f"no peft adapter ({info['adapter_skipped']})"
        print(f"exported {args.role} of {args.ckpt} -> {args.out}: {info['merged_modules']} adapted weights merged "
              f"into {info['base']}; {adapter}")
    else:
        print(f"exported {args.role} of {args.ckpt} -> {args.out}: {info['tensors']} tensors, "
              f"{info['bytes'] / 2**20:.1f} MiB, {info['architecture']}")
    return 0
