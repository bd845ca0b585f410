"""`megappo reward --config C --input rows.jsonl --out scores.jsonl [key=value ...]`: score rows with the
config's reward (its reward.rules, reward.code, reward.combine and the built-in rules), without training:
try a reward before a run.

Each input row (.jsonl, .json or .parquet, as `megappo data` reads them) is
    {"data_source": ..., "prompt": ..., "response": "...", "ground_truth": ..., "extra_info": {...}}
(prompt and extra_info optional; the judge reads prompt: text, or chat messages whose last user turn it
reads). Each output line, in the
input's order, is
    {"data_source": ..., "score": 0.75, "terms": {"code": 1.0, "rule:arithmetic": 0.0}, "metrics": {...}}
score is the rule's (a reward.combine source's weighted sum), as training has it before its non-stop and
length penalties, which need the generated tokens; terms is each term's value (a source without
reward.combine has one, rule:<source>); metrics the rule's own (the code reward's outcome, the judge's judge_errors). A row whose rule
failed has "failed": "error" | "timeout" and scores 0, as in training. A bad row is one line naming the fix.
A reward.judge.model judge is served on its own engine for the run (ppo/judge_engine.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from megappo.data.from_file import DataError, read_records

REQUIRED = ("data_source", "response", "ground_truth")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the run's config (its reward section is used)")
    parser.add_argument("--input", required=True, help="rows {data_source, prompt, response, ground_truth, "
                        "extra_info?} as .jsonl, .json or .parquet")
    parser.add_argument("--out", required=True, help="the scores, one JSON line per row (.jsonl)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")


def _scorers(cfg) -> dict:
    from megappo.rewards.rules import DEFAULT_SCORERS, as_rule, load_rewards

    return {source: as_rule(rule) for source, rule in {**DEFAULT_SCORERS, **load_rewards(cfg.reward)}.items()}


def _check(rows: list[dict], scorers: dict, path: Path) -> None:
    """Every row has its fields, a known data_source, no rm term, and test JSON where a code term reads it."""
    from megappo.rewards.code import CodeReward, parse_tests
    from megappo.rewards.combine import Combined

    for i, row in enumerate(rows, 1):
        where = f"{path} row {i}"
        missing = [k for k in REQUIRED if row.get(k) is None]
        if missing:
            raise DataError(f"{where} has no {', '.join(missing)} (its fields: {', '.join(map(str, row)) or 'none'}); "
                            f"each row is {{{', '.join(REQUIRED)}, prompt?, extra_info?}}")
        if not isinstance(row["response"], str) or not isinstance(row.get("extra_info") or {}, dict):
            bad = "response" if not isinstance(row["response"], str) else "extra_info"
            want = "text" if bad == "response" else "an object"
            raise DataError(f"{where}: {bad} is a {type(row[bad]).__name__}; give {want}")
        source = str(row["data_source"])
        rule = scorers.get(source)
        if rule is None:
            raise DataError(f"{where}: no reward for data_source {source!r} (known: {', '.join(sorted(scorers))}); "
                            f"add reward.rules.{source}=my_pkg.rewards:score or reward.combine.{source} to the config")
        fns = [t.rule.fn for t in rule.fn.terms if t.rule] if isinstance(rule.fn, Combined) else [rule.fn]
        if isinstance(rule.fn, Combined) and rule.fn.uses_rm:
            raise DataError(f"{where}: reward.combine.{source} has an rm term, and megappo reward does not run the "
                            "reward model; try the other terms (drop rm with an override), or score it in training")
        judge = next((fn for fn in fns if getattr(fn, "needs_prompt", False)), None)
        if judge is not None and row.get("prompt") is None and "{prompt}" in judge.cfg.prompt:
            raise DataError(f"{where} has no prompt, which reward.judge.prompt's {{prompt}} reads; give each row its "
                            "prompt (text, or chat messages)")
        if any(isinstance(fn, CodeReward) for fn in fns):
            try:
                parse_tests(row["ground_truth"])
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None


def score(rows: list[dict], scorers: dict) -> list[dict]:
    """Each row's output line (see the module docstring)."""
    from megappo.rewards.combine import Combined
    from megappo.rewards.rules import PROMPT, needs_prompt, prompt_text, score_group

    by_source: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_source[str(row["data_source"])].append(i)
    out: list = [None] * len(rows)
    for source, idx in by_source.items():
        rule = scorers[source]
        infos = [rows[i].get("extra_info") or {} for i in idx]
        if needs_prompt(rule):  # the judge reads the prompt (rewards/rules.PROMPT)
            infos = [{**info, PROMPT: prompt_text(rows[i].get("prompt"))} for info, i in zip(infos, idx)]
        results = score_group(rule, source, [rows[i]["response"] for i in idx], [rows[i]["ground_truth"] for i in idx],
                              infos)
        names = [t.name for t in rule.fn.terms] if isinstance(rule.fn, Combined) else None
        for i, r in zip(idx, results):
            terms = {n: r.extras.get(f"term/{n}", 0.0) for n in names} if names else {f"rule:{source}": r.score}
            metrics = {k: v for k, v in r.extras.items() if not k.startswith("term/")}
            out[i] = {"data_source": source, "score": r.score, "terms": terms, "metrics": metrics,
                      **({"failed": r.failure} if r.failure else {})}
    return out


def main(args: argparse.Namespace) -> int:
    from megappo.config import ConfigError, load_config
    from megappo.ppo.judge_engine import start_judges

    path, out = Path(args.input), Path(args.out)
    try:
        if out.is_dir():
            raise DataError(f"--out {out} is a directory; give a file (scores.jsonl)")
        try:
            cfg = load_config(args.config, list(args.overrides or []))
        except ConfigError as e:
            raise DataError(f"--config: {e}") from None
        scorers = _scorers(cfg)
        rows = read_records(path)
        _check(rows, scorers, path)
        judges = start_judges(scorers)  # reward.judge.model: its engine, for these rows
    except ValueError as e:  # DataError, and a judge engine that does not start
        print(f"megappo reward: {e}", file=sys.stderr)
        return 1
    try:
        lines = score(rows, scorers)
    finally:
        for judge in judges:
            judge.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = defaultdict(list)
    for line in lines:
        summary[line["data_source"]].append(line["score"])
    failed = sum("failed" in line for line in lines)
    means = "; ".join(f"{s}: mean score {sum(v) / len(v):.4g} over {len(v)} rows" for s, v in summary.items())
    print(f"wrote {len(lines)} scores to {out} ({means})" + (f"; {failed} rows failed (\"failed\" in their line)"
                                                              if failed else ""))
    return 0
