"""Write GSM8K parquet from a local copy:
`python -m megappo.data.preprocess_gsm8k --input train.jsonl [--test-input test.jsonl] --out DIR`.

Input rows (.jsonl or .parquet) have `question` and `answer` (the solution ending in "#### N").
The ground truth is N with commas removed; the prompt is the question plus an instruction to end
with "#### <answer>"; data_source "openai/gsm8k". Without --test-input, the last --test-size rows
of a seeded shuffle of --input become the test split. Writes gsm8k_train.parquet, gsm8k_test.parquet.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pyarrow.parquet as pq

from megappo.data.preprocess_arithmetic import write_parquet

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"preprocess_gsm8k: input {str(path)!r} not found (a GSM8K .jsonl or .parquet)")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def to_row(record: dict, index: int, split: str, source: Path) -> dict:
    for key in ("question", "answer"):
        if key not in record:
            raise ValueError(f"preprocess_gsm8k: row {index} of {str(source)!r} has no {key!r} field")
    if "####" not in record["answer"]:
        raise ValueError(f"preprocess_gsm8k: row {index} of {str(source)!r}: answer has no '#### N' final line")
    ground_truth = record["answer"].split("####")[-1].strip().replace(",", "")
    return {
        "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
        "data_source": DATA_SOURCE,
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"split": split, "index": index, "question": record["question"], "answer": record["answer"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="GSM8K train split (.jsonl or .parquet)")
    parser.add_argument("--test-input", default=None, help="GSM8K test split; default: split off --test-size rows")
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/data")
    args = parser.parse_args(argv)
    train_path = Path(args.input)
    train = read_records(train_path)
    if args.test_input:
        test_path, test = Path(args.test_input), read_records(Path(args.test_input))
    else:
        random.Random(args.seed).shuffle(train)
        size = min(args.test_size, len(train) // 2)
        train, test, test_path = train[: len(train) - size], train[len(train) - size:], train_path
    out = Path(args.out)
    for split, records, source in (("train", train, train_path), ("test", test, test_path)):
        rows = [to_row(r, i, split, source) for i, r in enumerate(records)]
        path = write_parquet(rows, out / f"gsm8k_{split}.parquet")
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
