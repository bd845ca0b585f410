"""`megappo convert`: HF <-> megatron-core dist checkpoint conversion (megappo/conversion).

    megappo convert hf-to-mcore --hf DIR --out DIR --tp T --pp P [--vpp V] [--model auto|actor|critic]
    megappo convert mcore-to-hf --ckpt DIR --out DIR [--config HF_DIR] [--dtype auto|bfloat16|...]
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megappo.conversion.cli import add_arguments as add

    add(parser)


def main(args: argparse.Namespace) -> int:
    from megappo.conversion.cli import run

    return run(args)
