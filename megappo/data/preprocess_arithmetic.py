"""Write the synthetic arithmetic task: `python -m megappo.data.preprocess_arithmetic --out DIR`.

Addition ("What is 3 + 4? ..."), ground truth "7", data_source "arithmetic", scored by
megappo.rewards.arithmetic (1.0 correct, 0.1 for a well-formed but wrong "#### <int>").
Deterministic by --seed. Writes arith_train.parquet and arith_val.parquet.

- Default (the demo): single-digit sums, so a tiny random-init model picks it up on CPU in a few
  dozen PPO steps (the tiny tokenizer was trained on text of exactly this shape); val is drawn from
  the same sums with another seed: a smoke task, not a held-out test.
- `--held-out`: every operand pair (a, b) in [--min-operand, --max-operand]^2 goes to exactly one
  split: val holds --val-size pairs that never appear in train (nor does their mirror b + a), so
  validation accuracy measures generalisation to unseen problems (the SmolLM2 recipe).
- `--tool-shots K`: each prompt starts with K worked exchanges in which the assistant calls the
  calculator (a Hermes <tool_call>), gets the `tool` message and answers (configs/tools_smollm2_135m.yaml:
  with K=1 SmolLM2-135M calls it in some of its samples (8% of the recipe's first 64), with K=0 never). The examples'
  operands are below 100, outside the 3-digit task's range.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic"
INSTRUCTION = "Answer with #### and the number."
TOOL_SHOTS = ((12, 34), (7, 58), (41, 6))


def tool_shots(k: int, instruction: str) -> list[dict]:
    """K example exchanges: question, calculator call, its result, the answer."""
    from megappo.agent.format import CALL_END, CALL_START

    if not 0 <= k <= len(TOOL_SHOTS):
        raise ValueError(f"--tool-shots {k}: choose 0..{len(TOOL_SHOTS)}")
    messages = []
    for a, b in TOOL_SHOTS[:k]:
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + {b}"}})
        messages += [{"role": "user", "content": f"What is {a} + {b}? {instruction}".strip()},
                     {"role": "assistant", "content": f"{CALL_START}{call}{CALL_END}"},
                     {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]
    return messages


def make_rows(n: int, seed: int, max_operand: int, split: str, pairs: list | None = None,
              min_operand: int = 0, instruction: str = INSTRUCTION, shots: int = 0) -> list[dict]:
    """n problems: operand pairs drawn from `pairs` (cycled in a seeded order) or at random."""
    rng = random.Random(seed)
    order = list(pairs) if pairs is not None else None
    if order is not None:
        rng.shuffle(order)
    rows, examples = [], tool_shots(shots, instruction)
    for i in range(n):
        a, b = order[i % len(order)] if order is not None else \
            (rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand))
        rows.append({
            "prompt": examples + [{"role": "user", "content": f"What is {a} + {b}? {instruction}".strip()}],
            "data_source": DATA_SOURCE,
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        })
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def task_parser(description: str, train_size: int) -> argparse.ArgumentParser:
    """The arguments every generated toy task takes (this one's, the code task's, the vision task's): where to write,
    and the two splits' sizes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="outputs/data", help="output directory (default: outputs/data)")
    parser.add_argument("--train-size", type=int, default=train_size)
    parser.add_argument("--val-size", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = task_parser(__doc__.splitlines()[0], 1024)
    parser.add_argument("--min-operand", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--held-out", action="store_true", help="val pairs (and their mirrors) never in train")
    parser.add_argument("--instruction", default=INSTRUCTION, help=f"after the question (default: {INSTRUCTION!r})")
    parser.add_argument("--tool-shots", type=int, default=0, help="worked calculator exchanges before each "
                        f"question (0..{len(TOOL_SHOTS)}; for rollout.multi_turn runs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 <= args.tool_shots <= len(TOOL_SHOTS):
        parser.error(f"--tool-shots {args.tool_shots}: choose 0..{len(TOOL_SHOTS)}")
    out = Path(args.out)
    pairs = {"train": None, "val": None}
    if args.held_out:
        pairs = held_out_pairs(args.min_operand, args.max_operand, args.val_size, args.seed)
    for split, size, seed in (("train", args.train_size, args.seed), ("val", args.val_size, args.seed + 1)):
        rows = make_rows(size, seed, args.max_operand, split, pairs[split], args.min_operand, args.instruction,
                         args.tool_shots)
        path = write_parquet(rows, out / f"arith_{split}.parquet")
        print(f"wrote {size} rows to {path}")
    return 0


def held_out_pairs(lo: int, hi: int, n_val: int, seed: int) -> dict[str, list]:
    """Unordered operand pairs split in two: n_val of them (as (a, b)) for val, every other for train."""
    unordered = sorted({(min(a, b), max(a, b)) for a in range(lo, hi + 1) for b in range(lo, hi + 1)})
    if n_val >= len(unordered):
        raise SystemExit(f"--val-size {n_val} leaves no training pairs of the {len(unordered)} in [{lo}, {hi}]")
    random.Random(seed).shuffle(unordered)
    val = unordered[:n_val]
    train = [p for a, b in unordered[n_val:] for p in {(a, b), (b, a)}]
    return {"train": train, "val": val}


if __name__ == "__main__":
    sys.exit(main())
