"""Write the synthetic arithmetic task: `python -m megappo.data.preprocess_arithmetic --out DIR`.

Single-digit addition ("What is 3 + 4? ..."), ground truth "7", data_source "arithmetic", scored by
megappo.rewards.arithmetic (1.0 correct, 0.1 for a well-formed but wrong "#### <int>"). Kept very
easy so a tiny random-init model can pick it up on CPU in a few dozen PPO steps; the tiny tokenizer
was trained on text of exactly this shape. Deterministic by --seed. Writes arith_train.parquet and
arith_val.parquet (val is drawn from the same 100 sums with another seed: a smoke task, not a
held-out generalisation test).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic"
INSTRUCTION = "Answer with #### and the number."


def make_rows(n: int, seed: int, max_operand: int, split: str) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({
            "prompt": [{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}],
            "data_source": DATA_SOURCE,
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        })
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/data", help="output directory (default: outputs/data)")
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    for split, size, seed in (("train", args.train_size, args.seed), ("val", args.val_size, args.seed + 1)):
        path = write_parquet(make_rows(size, seed, args.max_operand, split), out / f"arith_{split}.parquet")
        print(f"wrote {size} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
