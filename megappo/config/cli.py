"""`megappo config show|check --config FILE [key=value ...]`."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["show", "check"], help="show: print the resolved YAML; check: validate")
    parser.add_argument("--config", required=True, help="YAML file, e.g. configs/ppo_tiny.yaml")
    parser.add_argument("--paths", action="store_true",
                        help="also check that model/data paths exist and the output dir is writable")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")


def main(args: argparse.Namespace) -> int:
    from megappo.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.config, args.overrides, check_paths=args.paths)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    if args.action == "show":
        print(to_yaml(cfg), end="")
    else:
        print(f"config OK: {args.config}")
    return 0
