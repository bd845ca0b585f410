"""`megappo data --input FILE --prompt-key question --answer-key answer --data-source my_source --out DIR
[--test-fraction 0.1] [--seed 0]`: your own task's rows as megappo's parquet, DIR/train.parquet and
DIR/test.parquet (a seeded shuffle, then the last --test-fraction of the rows; 0: train.parquet only).

FILE is .jsonl (one JSON object a line), .json (a list of objects) or .parquet. Each row becomes what
RLHFDataset reads (megappo/data/dataset.py):
  prompt        [{"role": "user", "content": <prompt field>}] (a field that already holds chat messages is kept)
  data_source   --data-source: picks the reward rule (a built-in one, or the config's reward.rules.<source>)
  reward_model  {"ground_truth": <answer field> as text (a list or dict as JSON), "style": "rule"}; for
                --data-source code the answer field holds the row's tests, the code-set shape: {"inputs",
                "outputs", "fn_name"?} (or its JSON text, or a list of {"input", "output"}), written as
                rewards/code.py's JSON, each row's checked
  extra_info    {"split", "index" (its row in FILE, from 0), then the row's other fields (a field of either
                name wins)}: the reward rule's third argument
Every row is checked before anything is written; a bad input is one line naming the fix.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A bad `megappo data` input; str() is one line naming the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="rows as .jsonl, .json (a list of objects) or .parquet")
    parser.add_argument("--prompt-key", required=True, help="the field holding the question (or chat messages)")
    parser.add_argument("--answer-key", required=True, help="the field holding the answer the reward rule checks")
    parser.add_argument("--data-source", required=True, help="every row's data_source: picks its reward rule")
    parser.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="share of rows in test.parquet "
                        "(default 0.1; 0: train.parquet only)")
    parser.add_argument("--seed", type=int, default=0, help="the shuffle before the split")


def _not_utf8(path: Path, e: UnicodeDecodeError) -> DataError:
    return DataError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); re-save it as UTF-8 "
                     "(e.g. iconv -f latin1 -t utf-8)")


def _read_jsonl(path: Path) -> list:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number} is not valid JSON ({e.msg}, column {e.colno}); fix or remove "
                            "that line") from None
        if not isinstance(rows[-1], dict):
            raise DataError(f"{path} line {number} is a JSON {type(rows[-1]).__name__}, not an object; write "
                            "one {\"field\": value, ...} object a line")
    return rows


def _read_json(path: Path) -> list:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix it, or "
                        "write one object a line as .jsonl") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{path} must hold a JSON list of objects ([{{\"question\": ..., \"answer\": ...}}, ...]); "
                        "wrap the rows in [ ] or write them as .jsonl")
    return rows


def read_records(path: Path) -> list[dict]:
    """The input rows, as dicts."""
    if path.suffix not in SUFFIXES:
        raise DataError(f"--input {path}: unknown file type {path.suffix or '(none)'}; give a "
                        f"{', '.join(SUFFIXES)} file")
    if not path.is_file():
        raise DataError(f"--input {path} does not exist; fix the path")
    if path.suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif path.suffix == ".json":
        rows = _read_json(path)
    else:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types
            raise DataError(f"--input {path} is not a readable parquet file ({type(e).__name__}); re-export it") from None
    if not rows:
        raise DataError(f"--input {path} has no rows; give a file with at least one row")
    return rows


def _prompt(value) -> list | str:
    """A question as one user message; chat messages ([{"role", "content"}, ...]) as they are."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return value
    return [{"role": "user", "content": value if isinstance(value, str) else json.dumps(value)}]


def _ground_truth(value) -> str:
    return value if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _tests(value, where: str) -> dict:
    """A code row's tests as the code reward's JSON ({"inputs", "outputs", "fn_name"?}); DataError naming the row."""
    from dataclasses import asdict

    from megappo.rewards.code import parse_tests

    try:
        tests = asdict(parse_tests(value))
    except ValueError as e:
        raise DataError(f"{where}: {e} (in --answer-key's field)") from None
    return {k: v for k, v in tests.items() if v is not None}


def to_rows(records: list[dict], prompt_key: str, answer_key: str, data_source: str, path: Path) -> list[dict]:
    """Input rows -> megappo's rows (split and index are set by split_rows)."""
    out = []
    for i, record in enumerate(records):
        for flag, key in (("--prompt-key", prompt_key), ("--answer-key", answer_key)):
            if record.get(key) is None:
                fields = ", ".join(map(str, record)) or "none"
                missing = "is empty in" if key in record else "has no field"
                raise DataError(f"{path} row {i + 1} {missing} {key!r} (its fields: {fields}); pass {flag} with the "
                                "right field, or fill that row")
        extra = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
        truth = _tests(record[answer_key], f"{path} row {i + 1}") if data_source == "code" else record[answer_key]
        out.append({"prompt": _prompt(record[prompt_key]), "data_source": data_source,
                    "reward_model": {"ground_truth": _ground_truth(truth), "style": "rule"},
                    "extra_info": extra})
    return out


def split_rows(rows: list[dict], test_fraction: float, seed: int) -> dict[str, list[dict]]:
    """{"train": ..., "test": ...}: a seeded shuffle, the last round(n * fraction) rows (at least 1) as test."""
    if not 0 <= test_fraction < 1:
        raise DataError(f"--test-fraction {test_fraction} must be in [0, 1) (0: no test split)")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_test = max(1, round(len(rows) * test_fraction)) if test_fraction > 0 else 0
    if n_test >= len(rows):
        raise DataError(f"{len(rows)} row(s) leave none for train after a {test_fraction} test split; give more "
                        "rows or --test-fraction 0")
    splits = {"train": order[: len(rows) - n_test], "test": order[len(rows) - n_test:]}
    return {split: [{**rows[i], "extra_info": {"split": split, "index": i, **rows[i]["extra_info"]}} for i in idx]
            for split, idx in splits.items() if idx}


def _table(rows: list[dict]):
    """The parquet table; a field whose values pyarrow cannot put in one column is named."""
    import pyarrow as pa

    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        keys = sorted({k for r in rows for k in r["extra_info"]})
        bad = next((k for k in keys if not _one_type([r["extra_info"].get(k) for r in rows])), None)
        what = f"field {bad!r} holds values of different types across rows" if bad else str(e).splitlines()[0]
        raise DataError(f"cannot write the rows as parquet: {what}; make that field one type in every row, or "
                        "drop it from the input") from None


def _one_type(values: list) -> bool:
    import pyarrow as pa

    try:
        pa.array(values)
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False


def convert(path: Path, prompt_key: str, answer_key: str, data_source: str, out: Path, test_fraction: float = 0.1,
            seed: int = 0) -> dict[str, Path]:
    """FILE -> out/train.parquet (+ out/test.parquet); every row is checked before a file is written."""
    import pyarrow.parquet as pq

    blocking = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise DataError(f"--out {out}: {blocking} is a file; choose a directory")
    rows = to_rows(read_records(path), prompt_key, answer_key, data_source, path)
    tables = {split: _table(part) for split, part in split_rows(rows, test_fraction, seed).items()}
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, table in tables.items():
        written[split] = out / f"{split}.parquet"
        pq.write_table(table, written[split])
    return written


def main(args: argparse.Namespace) -> int:
    try:
        written = convert(Path(args.input), args.prompt_key, args.answer_key, args.data_source, Path(args.out),
                          args.test_fraction, args.seed)
    except DataError as e:
        print(f"megappo data: {e}", file=sys.stderr)
        return 1
    import pyarrow.parquet as pq

    for path in written.values():
        print(f"wrote {pq.read_metadata(path).num_rows} rows to {path}")
    from megappo.rewards.rules import DEFAULT_SCORERS

    rule = "" if args.data_source in DEFAULT_SCORERS else f" reward.rules.{args.data_source}=my_pkg.rewards:score"
    files = f"data.train_files=[{written['train']}]" + (f" data.val_files=[{written['test']}]" if "test" in written else "")
    print(f"train with: {files}{rule}")
    return 0
