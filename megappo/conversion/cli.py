"""Command line of the checkpoint converter (`megappo convert ...`, and `python -m tools.convert_ckpt ...` from a checkout)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION")
    sub.required = True
    a = sub.add_parser("hf-to-mcore", help="HF safetensors dir -> megatron-core dist checkpoint (torch_dist)",
                       description="HF safetensors dir -> megatron-core dist checkpoint (torch_dist), loadable at any "
                                   "TP/PP/VPP/EP. The layout flags validate the model against the layout you will load it "
                                   "at; --tp also sets the vocab padding (lcm(128, tp), the same for any power-of-two TP).")
    a.add_argument("--hf", required=True, help="HF model dir (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="checkpoint dir to create")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size to validate for (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size to validate for (default 1)")
    a.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank to validate for")
    a.add_argument("--ep", type=int, default=1, help="expert parallel size to validate for (MoE models; the "
                   "checkpoint itself loads at any EP that divides the expert count)")
    a.add_argument("--model", default="auto", choices=["auto", "actor", "critic"],
                   help="auto: causal LM -> actor, ...ForSequenceClassification -> critic (score -> value head); "
                        "critic from a causal LM: fresh value head")
    a.add_argument("--seed", type=int, default=1234, help="init seed of a fresh value head")
    _common(a)
    b = sub.add_parser("mcore-to-hf", help="megatron-core dist checkpoint -> complete HF model dir",
                       description="megatron-core dist checkpoint (from hf-to-mcore or a training checkpoint) -> HF "
                                   "dir: config.json, sharded safetensors + index, tokenizer, generation_config.")
    b.add_argument("--ckpt", required=True, help="megatron dist checkpoint dir (metadata.json, .metadata, *.distcp)")
    b.add_argument("--out", required=True, help="HF dir to create")
    b.add_argument("--config", default=None, help="HF config dir/file when the checkpoint has no config.json")
    b.add_argument("--dtype", default="auto", help="auto (as stored) | bfloat16 | float16 | float32")
    b.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (e.g. 5GB, 500MB)")
    _common(b)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (atomically, at the end)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megappo.conversion.errors import ConvertError

    try:
        from megappo.conversion import hf_to_mcore, mcore_to_hf

        if args.direction == "hf-to-mcore":
            info = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, model=args.model,
                               seed=args.seed, overwrite=args.overwrite, progress=not args.quiet)
            nbytes = sum(_nbytes(v) for v in info["tensors"].values())
            summary = {"out": args.out, "model": info["model"], "tensors": len(info["tensors"]), "bytes": nbytes,
                       "seconds": info["seconds"]}
        else:
            summary = mcore_to_hf(args.ckpt, args.out, config=args.config, dtype=args.dtype,
                                  max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                  progress=not args.quiet)
            summary = {"out": args.out, **summary}
    except ConvertError as e:
        print(f"convert_ckpt: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


def _nbytes(t: dict) -> int:
    import torch

    n = 1
    for s in t["shape"]:
        n *= s
    return n * torch.empty((), dtype=getattr(torch, t["dtype"])).element_size()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.convert_ckpt",
                                     description="HF <-> megatron-core dist checkpoint converter (streaming).")
    add_arguments(parser)
    return run(parser.parse_args(argv))
