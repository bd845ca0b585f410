"""reward.combine.<data_source>: a row's score as a weighted sum of terms, each term a reward of its own:

    reward:
      combine:
        my_code_task: [{term: code, weight: 0.75}, {term: 'rule:my_format', weight: 0.25}]

  code          the code reward (rewards/code.py, with reward.code's settings)
  rm            the reward model's score (reward.model; added by RewardManager, which has the batch's scores)
  rule:<name>   a built-in rule (gsm8k, math, arithmetic, code, ...) or one from reward.rules
  judge         the generative judge (rewards/judge.py, with reward.judge's settings)

The combination replaces the source's own rule (a reward.rules entry of the same name stays reachable as
rule:<name>). Each term's value is logged per source as reward/<source>/term/<term> and the term's own metrics
as reward/<source>/<term>/<metric>; the weights times the logged terms sum to the source's score
(reward/<source>/score, before the non-stop and length penalties). A term that fails on a row counts 0
there, and the row is counted in reward/num_scorer_errors. Weights may be any real number (a negative one
is a penalty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megappo.rewards.rules import Rule, Scored, as_rule, score_group

EXAMPLE = "[{term: code, weight: 0.75}, {term: 'rule:arithmetic', weight: 0.25}]"
RM = "rm"


@dataclass(frozen=True)
class Term:
    name: str  # as the config writes it: code, rm, rule:<name>
    weight: float
    rule: Optional[Rule]  # None: the reward model's score, which RewardManager adds


class Combined:
    """A batched rule: each row's weighted sum of its rule terms (the rm term is RewardManager's: rm_weight)."""

    def __init__(self, source: str, terms: list[Term]):
        self.source, self.terms = source, terms
        self.rm_weight = sum(t.weight for t in terms if t.rule is None)  # 0: the reward model does not count here
        self.needs_prompt = any(getattr(t.rule.fn, "needs_prompt", False) for t in terms if t.rule is not None)

    @property
    def uses_rm(self) -> bool:
        return any(t.rule is None for t in self.terms)

    def __call__(self, responses: list, ground_truths: list, extra_infos: list) -> list[Scored]:
        results = {t.name: score_group(t.rule, f"{self.source} (term {t.name})", responses, ground_truths,
                                       extra_infos) for t in self.terms if t.rule is not None}
        out = []
        for i in range(len(responses)):
            score, extras, failure = 0.0, {}, ""
            for t in self.terms:
                if t.rule is None:
                    continue
                r = results[t.name][i]
                score += t.weight * r.score
                extras[f"term/{t.name}"] = r.score
                extras.update({f"{t.name}/{k}": v for k, v in r.extras.items()})
                failure = failure or r.failure
            out.append(Scored(score, extras, failure))
        return out


def load_combine(combine, code: Rule, rules: dict, rm_enabled: bool, judge: Optional[Rule] = None) -> dict[str, Rule]:
    """reward.combine -> {data_source: Rule(Combined)}. `code`: the code reward; `rules`: what rule:<name>
    may name (the built-in rules and reward.rules); `judge`: reward.judge's rule (None: not configured).
    ValueError in one line naming the fix."""
    return {str(source): Rule(Combined(str(source), _terms(str(source), spec, code, rules, rm_enabled, judge)),
                              batched=True)
            for source, spec in dict(combine or {}).items()}


def _terms(source: str, spec, code: Rule, rules: dict, rm_enabled: bool, judge: Optional[Rule]) -> list[Term]:
    where = f"reward.combine.{source}"
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__len__") or not len(spec) or hasattr(spec, "keys"):
        raise ValueError(f"{where} must be a list of {{term, weight}}, e.g. {EXAMPLE}")
    terms = []
    for i, item in enumerate(spec):
        at = f"{where}[{i}]"
        if not hasattr(item, "keys") or set(item.keys()) != {"term", "weight"}:
            keys = sorted(item.keys()) if hasattr(item, "keys") else type(item).__name__
            raise ValueError(f"{at} is {keys}, not {{term: ..., weight: ...}}; write e.g. {{term: code, weight: 0.75}}")
        name, weight = item["term"], item["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{at}.weight={weight!r} must be a finite number (the term's share of the score)")
        if any(t.name == name for t in terms):
            raise ValueError(f"{at}: the term {name!r} is listed twice; give it one entry with its weight")
        terms.append(Term(str(name), float(weight), _rule(at, name, code, rules, rm_enabled, judge)))
    return terms


def _rule(at: str, name, code: Rule, rules: dict, rm_enabled: bool, judge: Optional[Rule]) -> Optional[Rule]:
    """A term's rule (None for rm)."""
    if name == "code":
        return code
    if name == RM:
        if not rm_enabled:
            raise ValueError(f"{at}.term=rm is the reward model's score, but reward.model.enable=false; enable it "
                             "(reward.model.path) or drop the term")
        return None
    if name == "judge":
        if judge is None:
            raise ValueError(f"{at}.term=judge needs the judge's server: set reward.judge.endpoint (and its tokenizer, "
                             "prompt and fallback) or reward.judge.model (a HF dir megappo serves), or drop the term")
        return judge
    if isinstance(name, str) and name.startswith("rule:"):
        rule = rules.get(name[len("rule:"):])
        if rule is None:
            raise ValueError(f"{at}.term={name!r}: no rule {name[5:]!r} (rules: {', '.join(sorted(rules))}); add "
                             f"reward.rules.{name[5:]}=my_pkg.rewards:score or name one of those")
        return as_rule(rule)
    raise ValueError(f"{at}.term={name!r} names nothing; a term is code, rm, judge or rule:<name> (a built-in rule "
                     "or one from reward.rules)")
