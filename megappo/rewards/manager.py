"""RewardManager: score each response with the rule for its data_source, place the score on the
response's last valid token, apply the non-stop penalty (open-instruct) and add model RM scores.

DataProto keys read:
  batch["responses"]        [B, T] response token ids, right-padded
  batch["response_mask"]    [B, T] 1 on response tokens (else the last T columns of attention_mask)
  batch["stopped"]          [B] bool, optional: the response ended with a stop token
                            (else: True when an eos / stop id is among its valid tokens)
  batch["rm_scores"]        [B] or [B, T] (summed), optional: reward-model scores, added (a reward.combine
                            source weighs them as its rm term, or leaves them out: rewards/combine.py)
  batch["prompts"]          [B, P] optional, only for printing samples
  non_tensor_batch["data_source"], non_tensor_batch["reward_model"][i]["ground_truth"],
  non_tensor_batch["extra_info"]  optional, each row's dict, the rule's third argument
  non_tensor_batch["agent_turns"]  multi-turn rows (agent/loop.py): with `environments` set, each row is
                            scored by its data_source's environment on the whole trajectory
                            (agent/environment.py) instead of the rule on the response text
  non_tensor_batch["rule_scores"]  optional, each row's rules.Scored as an earlier score_rows(..., keep=True)
                            left it (DAPO's filter scores before the reward phase): used, not recomputed,
                            so a costly rule (a judge) runs once per response
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Optional

import numpy as np
import torch

from megappo.protocol import DataProto
from megappo.rewards.combine import RM, Combined
from megappo.rewards.rules import (DEFAULT_SCORERS, PROMPT, Rule, RuleTimeout, Scored, as_rule, check_signature,
                                   needs_prompt, prompt_text, score_group)

# a rule: fn(response, ground_truth, extra_info) -> float | {"score", extras} (rewards/rules.py), or a Rule
Scorer = Callable[[str, Any, dict], Any]
RULE_SCORES = "rule_scores"  # non_tensor key: score_rows(keep=True)'s per-row rules.Scored
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowScore:
    """One response, scored: its rule score, final score (penalty / RM applied) and what made it so."""

    source: str
    rule_score: float
    final: float
    correct: bool  # the rule score is the full score
    stopped: bool
    length: int  # response tokens
    prompt: Any  # the prompt's uid (the n responses to one prompt share it)
    scorer_error: bool = False  # the rule raised or timed out: scored 0, counted in reward/num_scorer_errors
    overlong_penalty: float = 0.0  # DAPO's soft length penalty, already in `final` (<= 0)
    scorer_timeout: bool = False  # the rule timed out (also a scorer_error), counted in reward/num_scorer_timeouts
    extras: dict = field(default_factory=dict)  # the rule's extra metrics, logged as reward/<source>/<key>


class _RuleInputs(NamedTuple):
    """What the rules read of a batch's rows, one entry per row (RewardManager._rule_inputs)."""

    sources: list
    texts: list
    truths: list
    extra_infos: list
    stopped: list
    lengths: list
    turns: Optional[list]  # multi-turn rows' agent_turns (environments set), else None


def last_model_token(response_mask: torch.Tensor) -> torch.Tensor:
    """[B]: each row's last model-token column, where its outcome reward sits (-1 for a row with none). After a
    multi-turn response's tool tokens too: the mask is not contiguous there. Also ppo/segments.py's."""
    cols = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return torch.where(response_mask.bool(), cols, -1).max(-1).values.cpu()


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), verl's form: 0 up to max_length - buffer_len
    tokens, then falling linearly to -factor at max_length: min(-(length - (max_length - buffer_len)) /
    buffer_len * factor, 0). (The paper's -1 beyond max_length cannot happen: generation stops there.)"""
    if buffer_len <= 0:
        return 0.0
    exceed = length - (max_length - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


def extra_metrics(rows: list[RowScore]) -> dict[tuple[str, str], list[float]]:
    """(data_source, key) -> the values of a rule's extra metric over the rows that returned it."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        for key, value in r.extras.items():
            out[(r.source, key)].append(value)
    return out


class RewardManager:
    """`manager(data) -> (token_level_scores [B, T], metrics)`.

    A row is "verifiably correct" when its rule score is >= 1.0 (the full score; partial format
    scores do not count). The final score = rule score (+ rm_scores), replaced by
    `non_stop_penalty_value` when `non_stop_penalty` is on and the response did not stop."""

    def __init__(
        self,
        tokenizer,
        num_examine: int = 1,
        non_stop_penalty: bool = True,
        non_stop_penalty_value: float = -10.0,
        scorers: dict[str, Scorer | Rule] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        overlong_buffer_len: int = 0,
        overlong_penalty_factor: float = 1.0,
        max_response_length: int = 0,
        environments=None,
    ):
        self.tokenizer = tokenizer
        self.environments = environments  # agent/environment.Environments: multi-turn rows' scores
        self.num_examine = num_examine
        self.non_stop_penalty = non_stop_penalty
        self.non_stop_penalty_value = float(non_stop_penalty_value)
        for source, rule in (scorers or {}).items():
            check_signature(f"scorers[{source!r}]", as_rule(rule).fn, as_rule(rule).batched)
        self.scorers = {**DEFAULT_SCORERS, **(scorers or {})}
        ids = set(stop_token_ids or [])
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self.stop_token_ids = ids
        if overlong_buffer_len and not 0 < overlong_buffer_len <= max_response_length:
            raise ValueError(f"reward.overlong_buffer_len={overlong_buffer_len} must be in (0, rollout.max_new_tokens="
                             f"{max_response_length}]; or 0 to turn the length penalty off")
        self.overlong = (int(overlong_buffer_len), float(overlong_penalty_factor), int(max_response_length))

    def scorer_for(self, data_source: str) -> Scorer | Rule:
        try:
            return self.scorers[data_source]
        except KeyError:
            raise ValueError(
                f"no reward rule for data_source {data_source!r} (known: {', '.join(sorted(self.scorers))}); "
                f"add one to the config: reward.rules.{data_source}=my_pkg.rewards:score, a fn(response, ground_truth, "
                f"extra_info) -> float (or RewardManager(..., scorers={{{data_source!r}: fn}}))"
            ) from None

    def _response_mask(self, data: DataProto) -> torch.Tensor:
        responses = data.batch["responses"]
        if "response_mask" in data.batch:
            return data.batch["response_mask"]
        return data.batch["attention_mask"][:, -responses.shape[1]:]

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        return self.aggregate(self.score_rows(data), data)

    def score_rows(self, data: DataProto, keep: bool = False, examine: bool = True) -> list[RowScore]:
        """Every response scored by the rule of its data_source (a batched rule: one call per source). A rule
        that raises or times out scores its rows 0 (counted in reward/num_scorer_errors, warned once per
        source): one bad row does not end a run. `keep`: leave each row's rule result in
        non_tensor_batch[RULE_SCORES] for a later call on (a selection of) these rows; a call that finds
        them uses them and removes them. Penalties and RM scores are applied afresh either way. `examine`:
        print up to num_examine samples per source (a filter's call leaves that to the reward phase)."""
        x = self._rule_inputs(data)
        sources, texts, truths, stopped, lengths = x.sources, x.texts, x.truths, x.stopped, x.lengths
        rm_scores = data.batch.get("rm_scores")
        if rm_scores is not None and rm_scores.dim() == 2:
            rm_scores = rm_scores.sum(dim=-1)
        uids = data.non_tensor_batch.get("uid", range(len(data)))
        cached = data.non_tensor_batch.pop(RULE_SCORES, None)
        scored = list(cached) if cached is not None else self._scored(x)
        if keep:
            kept = np.empty(len(scored), dtype=object)  # one object per row (np.array would unpack nothing, but say so)
            kept[:] = scored
            data.non_tensor_batch[RULE_SCORES] = kept
        combined = self._combined(set(sources), rm_scores is not None)
        rows, shown = [], defaultdict(int)
        for i, source in enumerate(sources):
            rule_score, extras = scored[i].score, scored[i].extras
            buffer_len, factor, max_len = self.overlong
            length_penalty = overlong_penalty(int(lengths[i]), max_len, buffer_len, factor)
            rm = float(rm_scores[i]) if rm_scores is not None else 0.0
            rm_weight = 1.0
            if source in combined:  # a reward.combine source: the reward model is a term of it, or not at all
                rm_weight = combined[source].rm_weight
                extras = {**extras, f"term/{RM}": rm} if combined[source].uses_rm else extras
            final = rule_score + rm_weight * rm + length_penalty
            if self.non_stop_penalty and not stopped[i]:
                final = self.non_stop_penalty_value
            rows.append(RowScore(source, rule_score, final, rule_score >= 1.0, bool(stopped[i]), int(lengths[i]),
                                 uids[i], bool(scored[i].failure), length_penalty, scored[i].failure == "timeout",
                                 extras))
            if examine and shown[source] < self.num_examine:
                shown[source] += 1
                self._print_sample(data, i, source, texts[i], truths[i], rule_score, final, stopped[i])
        return rows

    def rule_results(self, parts: list[DataProto]) -> list[list[Scored]]:
        """Each part's rows scored by their rules (no penalty, no RM), every part in one call to each rule: the
        groups that came while the judge was busy, judged together (ppo/judge_overlap.py)."""
        inputs = [self._rule_inputs(p) for p in parts]
        if len({x.turns is None for x in inputs}) > 1:
            raise ValueError("rule_results got multi-turn and single-turn rows together; score them apart")
        joined = [None if lists[0] is None else sum(lists, []) for lists in zip(*inputs)]  # field by field
        scored = self._scored(_RuleInputs(*joined))
        out, at = [], 0
        for x in inputs:
            out.append(scored[at:at + len(x.sources)])
            at += len(x.sources)
        return out

    def _rule_inputs(self, data: DataProto) -> "_RuleInputs":
        """What the rules read of each row (the response text decoded, the judge's prompt in extra_info)."""
        responses = data.batch["responses"]
        mask = self._response_mask(data).bool()
        if "stopped" in data.batch:
            stopped = data.batch["stopped"].bool().tolist()
        else:
            stop_ids = torch.tensor(sorted(self.stop_token_ids), dtype=responses.dtype, device="cpu")
            stopped = (torch.isin(responses, stop_ids) & mask).any(dim=-1).tolist()
        sources = [str(s) for s in data.non_tensor_batch["data_source"]]
        extra_infos = [e or {} for e in data.non_tensor_batch.get("extra_info", [None] * len(data))]
        turns = data.non_tensor_batch.get("agent_turns") if self.environments is not None else None
        return _RuleInputs(sources, [self.tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True)
                                     for i in range(len(data))],
                           [info["ground_truth"] for info in data.non_tensor_batch["reward_model"]],
                           self._with_prompts(data, sources, extra_infos), stopped, mask.sum(dim=-1).tolist(),
                           None if turns is None else list(turns))

    def _scored(self, x: "_RuleInputs") -> list[Scored]:
        if x.turns is None:
            return self._rule_scores(x.sources, x.texts, x.truths, x.extra_infos)
        # multi-turn: the row's environment scores the whole trajectory
        return self._environment_scores(x.sources, x.turns, x.truths, x.stopped, x.extra_infos)

    def _with_prompts(self, data: DataProto, sources: list, extra_infos: list) -> list:
        """The rows of a source whose rule reads the prompt (the judge) get it in extra_info[PROMPT]: the raw
        prompt (a chat's last user turn), else the prompt tokens decoded."""
        wanted = {s for s in set(sources) if s in self.scorers and needs_prompt(self.scorers[s])}
        if not wanted:
            return extra_infos
        raw = data.non_tensor_batch.get("raw_prompt")
        out = list(extra_infos)
        for i, source in enumerate(sources):
            if source in wanted:
                if raw is not None:
                    text = prompt_text(raw[i])
                elif "prompts" not in data.batch:
                    text = ""
                else:
                    ids = [t for t in data.batch["prompts"][i].tolist() if t != self.tokenizer.pad_token_id]
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                out[i] = {**out[i], PROMPT: text}
        return out

    def _combined(self, sources: set, have_rm: bool) -> dict[str, Combined]:
        """{source: its Combined} for the reward.combine sources among `sources` (rewards/combine.py): the reward
        model counts there with its term's weight (0 without an rm term); elsewhere it is added as it is."""
        out = {}
        for source in sources:
            combined = as_rule(self.scorers[source]).fn if source in self.scorers else None
            if not isinstance(combined, Combined):
                continue
            out[source] = combined
            if combined.uses_rm and not have_rm:
                raise ValueError(f"reward.combine.{source} has an rm term, but the batch has no reward-model scores; "
                                 "enable reward.model (reward.model.enable=true) or drop the term")
        return out

    def _rule_scores(self, sources, texts, truths, extra_infos) -> list[Scored]:
        """Each data_source's rows scored by its rule (every source's rule looked up before any is called)."""
        by_source: dict[str, list[int]] = defaultdict(list)
        for i, source in enumerate(sources):
            by_source[source].append(i)
        rules = {source: self.scorer_for(source) for source in by_source}
        scored: list = [None] * len(sources)
        for source, idx in by_source.items():
            results = score_group(rules[source], source, [texts[i] for i in idx], [truths[i] for i in idx],
                                  [extra_infos[i] for i in idx])
            for i, result in zip(idx, results):
                scored[i] = result
        return scored

    def _environment_scores(self, sources, turns, truths, stopped, extra_infos) -> list[Scored]:
        for source in set(sources):
            self.environments.get(source)  # raises for a source without one, as scorer_for does
        scored, warned = [], set()
        for i, source in enumerate(sources):
            try:
                scored.append(Scored(self.environments.score(source, turns[i], truths[i], stopped[i],
                                                             extra_infos[i])))
            except Exception as e:  # noqa: BLE001 - a user's environment failing on one row scores it 0
                scored.append(Scored(0.0, {}, "timeout" if isinstance(e, RuleTimeout) else "error"))
                if source not in warned:
                    warned.add(source)
                    log.warning("reward rule for data_source %r raised on a row (%s: %s); scoring it 0",
                                source, type(e).__name__, e)
        return scored

    def aggregate(self, rows: list[RowScore], data: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """Row scores -> token-level scores [B, T] (the final score on each response's last model token) and
        the step's reward metrics."""
        batch_size, resp_len = data.batch["responses"].shape
        token_level_scores = torch.zeros(batch_size, resp_len, dtype=torch.float32, device="cpu")
        last = last_model_token(self._response_mask(data)).clamp(min=0).tolist()
        per_source: dict[str, list[RowScore]] = defaultdict(list)
        for i, r in enumerate(rows):
            token_level_scores[i, last[i]] = r.final
            per_source[r.source].append(r)
        n = max(batch_size, 1)
        metrics = {
            "objective/verifiable_correct_rate": sum(r.correct for r in rows) / n,
            "objective/scores": sum(r.final for r in rows) / n,
            "reward/num_non_stop_penalised": float(sum(self.non_stop_penalty and not r.stopped for r in rows)),
            "reward/stop_rate": sum(r.stopped for r in rows) / n,
            "reward/num_scorer_errors": float(sum(r.scorer_error for r in rows)),
            "reward/num_scorer_timeouts": float(sum(r.scorer_timeout for r in rows)),
        }
        if self.overlong[0]:
            metrics["reward/overlong_penalty_mean"] = sum(r.overlong_penalty for r in rows) / n
            metrics["reward/overlong_frac"] = sum(r.overlong_penalty < 0 for r in rows) / n
        judge_errors = [v for r in rows for k, v in r.extras.items() if k.rsplit("/", 1)[-1] == "judge_errors"]
        if judge_errors:  # the judge's failed rows (rewards/judge.py), which scored reward.judge.fallback
            metrics["reward/judge_errors"] = float(sum(judge_errors))
        for (source, key), values in extra_metrics(rows).items():
            metrics[f"reward/{source}/{key}"] = sum(values) / len(values)
        for source, mine in per_source.items():
            metrics[f"reward/{source}/correct_rate"] = sum(r.correct for r in mine) / len(mine)
            metrics[f"reward/{source}/score"] = sum(r.final for r in mine) / len(mine)
        return token_level_scores, metrics

    def _print_sample(self, data, i, source, response, ground_truth, rule_score, final, stopped) -> None:
        if "prompts" in data.batch:
            ids = [t for t in data.batch["prompts"][i].tolist() if t != self.tokenizer.pad_token_id]
            prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        else:
            prompt = str(data.non_tensor_batch.get("raw_prompt", [""] * len(data))[i])
        print(
            f"[reward:{source}] prompt: {prompt!r}\n  response: {response!r}\n"
            f"  ground_truth: {ground_truth!r} rule_score: {rule_score} stopped: {bool(stopped)} final: {final}",
            flush=True,
        )
