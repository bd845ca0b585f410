"""`megappo export --ckpt <output_dir>/checkpoints/step_N --out DIR [--role actor|critic] [--dtype ...]`:
a trained policy (or critic) as a plain HF model dir.

DIR gets safetensors + config.json + generation_config.json + the tokenizer files, so
`AutoModelForCausalLM.from_pretrained(DIR)` and `vllm.LLM(DIR)` load it with no megappo import. The
tensors go through the converter's streaming megatron -> HF path (tools/convert_ckpt, the one
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
    from tools.convert_ckpt.to_hf import mcore_to_hf
    from tools.convert_ckpt.errors import ConvertError

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
    try:
        return mcore_to_hf(ckpt / role, out, config=str(config or _hf_source(ckpt, role)), dtype=dtype,
                           overwrite=overwrite, progress=progress)
    except ConvertError as e:
        raise ExportError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="a checkpoint dir: <output_dir>/checkpoints/step_N")
    parser.add_argument("--out", required=True, help="the HF model dir to write (must not exist, or be empty)")
    parser.add_argument("--role", default="actor", choices=ROLES, help="the policy (default) or the value model")
    parser.add_argument("--dtype", default=None, help="auto (as saved) | bfloat16 | float16 | float32")
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
    print(f"exported {args.role} of {args.ckpt} -> {args.out}: {info['tensors']} tensors, "
          f"{info['bytes'] / 2**20:.1f} MiB, {info['architecture']}")
    return 0
