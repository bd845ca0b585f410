"""`megappo` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `main(args) -> int`; this file only lists them, in the order `--help`
shows them. Modules are imported lazily so `megappo --help` stays fast (no torch/megatron import)."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Later issues add lines here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "config": ("megappo.config.cli", "show or check a resolved config (YAML defaults chain + overrides)"),
    "plan": ("megappo.planner", "per-GPU memory of every role and phase for a layout; refuses one that does not fit"),
    "logprobs": ("megappo.logprobs", "score token rows (log-probs or values) with a TP/PP/DP-sharded megatron model"),
    "convert": ("megappo.convert", "convert checkpoints HF <-> megatron-core dist checkpoint (streaming, any TP/PP)"),
    "assets": ("megappo.assets", "build the tiny tokenizer and tiny llama/qwen2 models used by tests and the demo"),
    "train": ("megappo.train", "run PPO (sync hybrid engine or async one-step off-policy) from a config"),
    "data": ("megappo.data.from_file", "your own task's rows (.jsonl/.json/.parquet: a prompt and an answer field) "
             "as megappo's train/test parquet"),
    "reward": ("megappo.reward", "score rows (data_source, response, ground_truth) with a config's reward, "
               "without training"),
    "eval": ("megappo.evaluate", "accuracy of a HF model or a checkpoint on a parquet (greedy or pass@k, vLLM)"),
    "export": ("megappo.export", "a checkpoint's policy (or critic) as a plain HF model dir"),
    "serve": ("megappo.serve", "an OpenAI-compatible API (chat, completions, tool calls) over a HF dir "
              "or a checkpoint"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megappo", description="PPO post-training on megatron-core + vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == load:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        parser = build_parser()
        if command is not None:
            parser.error(f"unknown command {command!r}; choose one of: {', '.join(SUBCOMMANDS)}")
        parser.print_help()
        return 0 if ("-h" in argv or "--help" in argv) else 2
    parser = build_parser(load=command)
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may sit anywhere on the line (argparse alone binds them only before options)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides or []) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(importlib.import_module(SUBCOMMANDS[command][0]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
