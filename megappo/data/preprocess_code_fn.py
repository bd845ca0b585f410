"""Write the toy code task: `python -m megappo.data.preprocess_code_fn --out DIR`.

Each prompt asks for a one-line python function, "Write a python function f(x) that returns x plus 7. Answer with
one line of python." (the operator plus, minus or times, the constant 1..99: one token each of the tiny tokenizer);
the reference answer is `def f(x): return x + 7`. Ground truth: call-based tests of the built-in `code` data source
(rewards/code.py), {"inputs": [[x], ...], "outputs": [f(x), ...], "fn_name": "f"}, --tests of them at inputs in
100..999 that the prompt never shows. At x >= 100 the values of x + c, x - c and x * c for c in 1..99 are all
distinct, so one test tells every (operator, constant) apart, and a program that returns a number fails one of two
tests.

Held out: 66 of the 297 (operator, constant) functions, 22 constants per operator and no constant twice (so each
constant is asked for in training with the two other operators), are asked for only in the val split, each once
before any repeats; the train split cycles through the other 231. Deterministic by --seed; writes code_fn_train.parquet
and code_fn_val.parquet.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

DATA_SOURCE = "code"
OPERATORS = {"plus": "+", "minus": "-", "times": "*"}
CONSTANTS = range(1, 100)
INPUTS = range(100, 1000)  # >= the largest constant + 1: see the docstring
HELD_OUT_PER_OPERATOR = 22
INSTRUCTION = "Answer with one line of python."
FN_NAME = "f"


def question(word: str, c: int) -> str:
    return f"Write a python function {FN_NAME}(x) that returns x {word} {c}. {INSTRUCTION}"


def solution(word: str, c: int) -> str:
    """The reference answer: one line that defines f."""
    return f"def {FN_NAME}(x): return x {OPERATORS[word]} {c}"


def tests(word: str, c: int, xs: list[int]) -> dict:
    """The code reward's call-based ground truth for f(x) = x <op> c at the inputs xs."""
    fn = {"plus": lambda x: x + c, "minus": lambda x: x - c, "times": lambda x: x * c}[word]
    return {"inputs": [[x] for x in xs], "outputs": [fn(x) for x in xs], "fn_name": FN_NAME}


def functions(seed: int = 0) -> dict[str, list[tuple[str, int]]]:
    """{"train": [(operator, constant), ...], "val": [...]}: the held-out split of the 27 functions (see above)."""
    words = sorted(OPERATORS)
    held = random.Random(seed).sample(list(CONSTANTS), HELD_OUT_PER_OPERATOR * len(words))
    val = [(w, c) for k, w in enumerate(words) for c in held[k::len(words)]]
    return {"train": [(w, c) for w in words for c in CONSTANTS if (w, c) not in val], "val": val}


def make_rows(n: int, seed: int, pool: list[tuple[str, int]], n_tests: int, split: str) -> list[dict]:
    """n rows asking for the functions of `pool`, cycled in a seeded order."""
    rng = random.Random(seed)
    order = rng.sample(pool, len(pool))
    rows = []
    for i in range(n):
        word, c = order[i % len(order)]
        truth = tests(word, c, rng.sample(INPUTS, n_tests))
        rows.append({"prompt": [{"role": "user", "content": question(word, c)}],
                     "data_source": DATA_SOURCE,
                     "reward_model": {"ground_truth": json.dumps(truth), "style": "rule"},
                     "extra_info": {"split": split, "index": i, "operator": word, "constant": c}})
    return rows


def main(argv: list[str] | None = None) -> int:
    from megappo.data.preprocess_arithmetic import task_parser, write_parquet

    parser = task_parser(__doc__.splitlines()[0], 512)
    parser.add_argument("--tests", type=int, default=2, help="tests per row, each one sandbox call (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="the held-out functions and the rows (val: seed + 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.tests <= len(INPUTS):
        parser.error(f"--tests {args.tests}: choose 1..{len(INPUTS)} (distinct inputs in "
                     f"{INPUTS.start}..{INPUTS.stop - 1})")
    pools = functions(args.seed)
    for split, size, seed in (("train", args.train_size, args.seed), ("val", args.val_size, args.seed + 1)):
        rows = make_rows(size, seed, pools[split], args.tests, split)
        print(f"wrote {size} rows to {write_parquet(rows, Path(args.out) / f'code_fn_{split}.parquet')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
