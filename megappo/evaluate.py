"""`megappo eval --model DIR --data FILE.parquet [--n-samples K --temperature T] [--out report.json]`:
accuracy of a model on a parquet of the usual schema (prompt, data_source, reward_model.ground_truth),
the baseline a user runs before and after training.

DIR is a HF model dir, a megappo checkpoint (`<output_dir>/checkpoints/step_N`: its actor is exported
to a temporary HF dir first, megappo export) or a role's dist checkpoint with its config.json.
Responses come from vLLM (one engine, in this process), greedy by default; `--n-samples K` samples K
per prompt at `--temperature` (default 1.0) and adds pass@K (a prompt counts when any sample is
correct). Scoring is the trainer's: the same RewardManager (rule by data_source, non-stop penalty)
and, with `--config <output_dir>/config.json` (or the run's YAML), the same prompt settings
(chat template, max_prompt_length, prompt_key), max_new_tokens, stop ids and validation files, so a
greedy eval of an export repeats the run's last `eval/*`.

Several --data files (their prompts may differ in length) are generated and scored one file at a
time and reported per file and overall. Without --config the prompt and response lengths default
to what the model's positions hold (512 + 256, shortened to fit; a length given explicitly that does
not fit is refused in one line).

Prints one line per data_source (accuracy, mean length in tokens, % ended with a stop token), one per
file when there are several, and an `all` line; `--out` writes the same as JSON (+ the eval/* keys
the trainer logs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Optional

DEFAULTS = {"max_new_tokens": 256, "max_prompt_length": 512, "prompt_key": "prompt", "apply_chat_template": True,
            "stop_token_ids": [], "non_stop_penalty": True, "non_stop_penalty_value": -10.0, "batch_size": 64,
            "reward": None}


class EvalError(ValueError):
    """A bad eval input; str() is one line naming the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model dir, or a megappo checkpoint (checkpoints/step_N)")
    parser.add_argument("--data", nargs="+", help="parquet file(s) (default: the --config's data.val_files)")
    parser.add_argument("--config", help="a run's config (<output_dir>/config.json or its YAML): prompt, length, "
                        "stop and reward settings as in training")
    parser.add_argument("--n-samples", type=int, default=1, help="responses per prompt (K > 1: sampled, pass@K)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy for "
                        "one sample, 1.0 for K > 1)")
    parser.add_argument("--max-new-tokens", type=int, help=f"default: the config's, else {DEFAULTS['max_new_tokens']}")
    parser.add_argument("--max-prompt-length", type=int, help="longer prompts are dropped (counted); default: the "
                        f"config's, else {DEFAULTS['max_prompt_length']}")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="prompts per generate call")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="CPU: vLLM's KV cache size")
    parser.add_argument("--out", help="write the report as JSON here")
    parser.add_argument("--baseline", help="an earlier report (--out of the base model): print both side by side")
    parser.add_argument("--no-tools", action="store_true", help="with a --config whose rollout.multi_turn is on: "
                        "evaluate without the tools (single-turn prompts, no tool section)")


def _settings(args) -> dict:
    """Prompt / generation / reward settings: defaults < the run's config < command-line flags."""
    s = dict(DEFAULTS, data=None, explicit=set(), multi_turn=None)  # explicit: lengths the user chose
    if args.config:
        from megappo.config import ConfigError, load_config

        try:
            cfg = load_config(args.config, validate=False)
        except ConfigError as e:
            raise EvalError(f"--config: {e}") from None
        s.update(max_new_tokens=cfg.rollout.max_new_tokens, max_prompt_length=cfg.data.max_prompt_length,
                 prompt_key=cfg.data.prompt_key, apply_chat_template=cfg.data.apply_chat_template,
                 stop_token_ids=list(cfg.rollout.stop_token_ids), non_stop_penalty=cfg.reward.non_stop_penalty,
                 non_stop_penalty_value=cfg.reward.non_stop_penalty_value, data=list(cfg.data.val_files),
                 batch_size=cfg.data.val_batch_size, reward=cfg.reward)
        s["explicit"] = {"max_new_tokens", "max_prompt_length"}
        if cfg.rollout.multi_turn.enable and not args.no_tools:  # the model decides whether to call a tool
            from omegaconf import OmegaConf

            from megappo.config.schema import MultiTurnConfig

            s["multi_turn"] = MultiTurnConfig(**{**OmegaConf.to_container(cfg.rollout.multi_turn), "tool_choice": "auto"})
    for key in ("max_new_tokens", "max_prompt_length"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
            s["explicit"].add(key)
    if args.data:
        s["data"] = list(args.data)
    if not s["data"]:
        raise EvalError("no data: pass --data FILE.parquet (or --config of a run with data.val_files)")
    if args.n_samples < 1:
        raise EvalError(f"--n-samples {args.n_samples}: must be >= 1")
    return s


def resolve_model(path: Path, tmp: Path) -> Path:
    """A HF dir to load: `path` itself, or `path`'s policy exported into `tmp`."""
    from megappo.model_dirs import ModelDirError, kind_of

    try:
        kind = kind_of(path)
    except ModelDirError as e:
        raise EvalError(str(e)) from None
    if kind == "hf":
        return path
    if kind == "checkpoint":  # a megappo checkpoint (step_N)
        from megappo.export import ExportError, export_checkpoint

        try:
            export_checkpoint(path, tmp / "hf", progress=False)
        except ExportError as e:
            raise EvalError(str(e)) from None
        return tmp / "hf"
    from megappo.conversion.to_hf import mcore_to_hf  # a role's dist checkpoint
    from megappo.conversion.errors import ConvertError

    try:
        mcore_to_hf(path, tmp / "hf", progress=False)
    except ConvertError as e:
        raise EvalError(str(e)) from None
    return tmp / "hf"


def fit_lengths(settings: dict, positions: int, model) -> tuple[int, int]:
    """(max_prompt_length, max_new_tokens) within the model's `positions`: a default is shortened to fit
    (the prompt first); lengths the user chose that do not fit are refused in one line."""
    prompt, new = settings["max_prompt_length"], settings["max_new_tokens"]
    over = prompt + new - positions
    if over <= 0:
        return prompt, new
    explicit = settings.get("explicit", set())
    if "max_prompt_length" not in explicit and prompt - over >= 16:
        return prompt - over, new
    if "max_new_tokens" not in explicit and new - over >= 1:
        return prompt, new - over
    raise EvalError(f"max prompt length {prompt} + max new tokens {new} = {prompt + new} exceeds the {positions} "
                    f"positions of {model}; lower --max-prompt-length or --max-new-tokens")


def _tokenizer(model_dir: Path):
    from megappo.model_dirs import ModelDirError, tokenizer_of

    try:
        return tokenizer_of(model_dir)
    except ModelDirError as e:
        raise EvalError(str(e)) from None


def _summary(rows: list, n_samples: int) -> dict:
    """{data_source: accuracy, pass@K, mean length, stop %, counts, the rule's extra metrics} over RewardManager
    row scores."""
    from megappo.rewards.manager import extra_metrics

    by_source = defaultdict(list)
    for r in rows:
        by_source[r.source].append(r)
    by_source["all"] = rows
    out = {}
    for source, rs in by_source.items():
        groups = defaultdict(list)
        for r in rs:
            groups[r.prompt].append(r.correct)
        out[source] = {"accuracy": sum(r.correct for r in rs) / len(rs),
                       "mean_length": sum(r.length for r in rs) / len(rs),
                       "stop_rate": sum(r.stopped for r in rs) / len(rs),
                       "num_prompts": len(groups), "num_responses": len(rs),
                       "num_scorer_errors": sum(r.scorer_error for r in rs)}
        extras = {key: sum(v) / len(v) for (_, key), v in extra_metrics(rs).items()} if source != "all" else {}
        if extras:  # the rule's own metrics (a reward.rules function returning a dict), as training logs them
            out[source]["rule_metrics"] = extras
        if n_samples > 1:
            out[source][f"pass@{n_samples}"] = sum(any(c) for c in groups.values()) / len(groups)
    return out


def evaluate(model, data: list[str], settings: dict, n_samples: int = 1, temperature: Optional[float] = None,
             dtype: str = "float32", seed: int = 0, kv_cache_mb: int = 256) -> dict:
    """Generate with vLLM, score with RewardManager; the report (see the module docstring)."""
    from megappo.agent.loop import STAT_KEYS, agent_metrics
    from megappo.agent.environment import Environments
    from megappo.agent.factory import agent_loop_builder
    from megappo.config.schema import RolloutConfig
    from megappo.data.dataset import RLHFDataset
    from megappo.data.images import processor_for
    from megappo.ppo.metrics import eval_metrics
    from megappo.protocol import DataProto
    from megappo.rewards.manager import DEFAULT_SCORERS, RewardManager
    from megappo.rewards.rules import load_rewards
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    from megappo.model_dirs import positions_of

    with tempfile.TemporaryDirectory(prefix="megappo-eval-") as tmp:
        model_dir = resolve_model(Path(model), Path(tmp))
        tok = _tokenizer(model_dir)
        prompt_len, new_tokens = fit_lengths(settings, positions_of(model_dir), model)
        datasets, mt = [], settings.get("multi_turn")
        try:  # the config's rewards (reward.rules, reward.code, reward.combine); each row's environment by data_source
            rules = load_rewards(settings["reward"]) if settings.get("reward") is not None else {}
            envs = Environments(mt, {**DEFAULT_SCORERS, **rules}) if mt else None
        except ValueError as e:
            raise EvalError(str(e)) from None
        tools = dict(envs.prompt_args() if envs else {}, processor=processor_for(model_dir))  # a VL model's images
        for file in data:  # one file at a time: files differ in prompt length, batches never mix them
            try:
                datasets.append(RLHFDataset([file], tok, settings["prompt_key"], prompt_len,
                                            settings["apply_chat_template"], **tools))
            except (FileNotFoundError, ValueError) as e:
                raise EvalError(str(e)) from None
        temperature = (1.0 if n_samples > 1 else 0.0) if temperature is None else temperature
        sample = n_samples > 1 or temperature > 0
        cfg = RolloutConfig(n=n_samples, temperature=temperature if sample else 1.0,
                            max_new_tokens=new_tokens, stop_token_ids=settings["stop_token_ids"],
                            kv_cache_memory_mb=kv_cache_mb, **({"multi_turn": mt} if mt else {}))
        rollout = VLLMRollout(model_dir, cfg, seed=seed, dtype=None if dtype == "auto" else dtype,
                              max_model_len=prompt_len + new_tokens, agent=agent_loop_builder(mt))
        spec = SamplingSpec.from_config(cfg)
        spec = spec.with_seed(seed) if sample else spec.greedy()
        manager = RewardManager(tok, 0, settings["non_stop_penalty"], settings["non_stop_penalty_value"], scorers=rules,
                                stop_token_ids=settings["stop_token_ids"], environments=envs)
        rows, responses, by_file, first = [], [], {}, 0
        for file, dataset in zip(data, datasets):
            file_rows = []
            for i in range(0, len(dataset), settings["batch_size"]):
                prompts = dataset.get_batch(range(i, min(i + settings["batch_size"], len(dataset))))
                # a sampled eval's seed per prompt, counted over every file (the same as one file holding all)
                prompts.meta_info["sampling"] = spec.with_seed(spec.seed + (first + i) * n_samples) if sample else spec
                part = rollout.generate_sequences(prompts)
                try:
                    file_rows += manager.score_rows(part)
                except (KeyError, ValueError) as e:
                    raise EvalError(str(e)) from None
                # prompts differ in width from batch to batch; the responses all have max_new_tokens columns
                responses.append(part.select(batch_keys=[k for k in ("responses", "response_mask", "stopped",
                                                                     *STAT_KEYS) if k in part.batch],
                                             meta_info_keys=[]))
            by_file[str(file)] = _summary(file_rows, n_samples)["all"]
            rows += file_rows
            first += len(dataset)
        out = DataProto.concat(responses)
        _, reward_metrics = manager.aggregate(rows, out)
        report = {"model": str(model), "data": [str(d) for d in data], "n_samples": n_samples,
                  "temperature": temperature if sample else 0.0, "max_new_tokens": new_tokens,
                  "max_prompt_length": prompt_len, "num_filtered_prompts": sum(d.num_filtered for d in datasets),
                  "by_source": _summary(rows, n_samples), "by_file": by_file}
        if not sample:
            report.update(eval_metrics(out, reward_metrics))
        if mt:
            report["tools"] = {k.removeprefix("rollout/"): v for k, v in agent_metrics(out.batch).items()}
        return report


def _load_baseline(path: Optional[str]) -> Optional[dict]:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())["by_source"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EvalError(f"--baseline {path} is not a `megappo eval --out` report ({type(e).__name__}); "
                        "run megappo eval on the base model with --out first") from None


def compare_lines(baseline: dict, report: dict) -> list[str]:
    """Base vs this model, one line per data_source both reports hold: accuracy and its change in points."""
    lines = [f"{'':>16}  {'base':>7}  {'this':>7}  {'change':>8}"]
    for source, m in report["by_source"].items():
        if source in baseline:
            b, t = baseline[source]["accuracy"], m["accuracy"]
            lines.append(f"{source:>16}  {b:7.3f}  {t:7.3f}  {100 * (t - b):+7.1f}pt")
    return lines


def main(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        baseline = _load_baseline(args.baseline)
        report = evaluate(args.model, settings["data"], settings, n_samples=args.n_samples,
                          temperature=args.temperature, dtype=args.dtype, seed=args.seed, kv_cache_mb=args.kv_cache_mb)
    except EvalError as e:
        print(f"megappo eval: {e}", file=sys.stderr)
        return 1
    k = report["n_samples"]
    per_file = report["by_file"] if len(report["by_file"]) > 1 else {}
    for source, m in [*report["by_source"].items(), *per_file.items()]:
        extra = f"  pass@{k} {m[f'pass@{k}']:.3f}" if k > 1 else ""
        extra += "".join(f"  {key} {value:.3f}" for key, value in m.get("rule_metrics", {}).items())
        extra += f"  scorer errors {m['num_scorer_errors']}" if m.get("num_scorer_errors") else ""
        print(f"{source:>16}: accuracy {m['accuracy']:.3f}{extra}  mean length {m['mean_length']:.1f}  "
              f"stopped {100 * m['stop_rate']:.1f}%  ({m['num_prompts']} prompts)")
    if "tools" in report:
        t = report["tools"]
        print(f"{'tools':>16}: called in {100 * t['tool_call_rate']:.1f}% of samples, {t['tool_calls_mean']:.2f} calls "
              f"and {t['turns_mean']:.2f} turns per sample, valid calls {100 * t['tool_call_valid_rate']:.1f}%")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.out}")
    if baseline is not None:
        print("\n".join(compare_lines(baseline, report)))
    return 0
