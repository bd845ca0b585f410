"""A discrete-event simulator of the three training modes (issue #39), driven by measured costs:

  sync        the hybrid engine: generate a batch, train on it, sync the weights, on the same devices
  async       megappo's one-step off-policy mode (own rollout pool): the next batch is generated while
              the trainer trains on this one; every batch still waits for its slowest sample
  fully_async a rollout pool that never drains: samples start whenever a slot is free and the staleness
              bound allows (AReaL's admission control: a sample started at policy version v must be
              trainable by v + max_staleness), the trainer takes a batch as soon as enough complete groups
              are buffered, a weight sync pauses the engine and in-flight samples continue (partial rollouts)

The engine is continuous batching: one decode step advances every active sample by one token and costs
`decode_s(active)` (interpolated in the measured table); a sample that joins pays its prefill in that step.
The trainer costs `update_s_fixed + update_s_per_token * tokens` per batch (pi_old, ref, values and both
updates together); a weight sync costs `weight_sync_s` and stops the engine (and, in sync mode, is part
of the step). Nothing else is modelled: no driver overhead, no memory limits (give reward time, if it matters,
as part of the trainer's cost). `engines` rollout engines work at once: sync and async split each batch over
them by whole prompts (megappo's DP dispatch) and wait for the slowest part; fully_async pools them (a sample
goes wherever a slot is free, its prefill shared out: a lower bound on a real pool's time).

    python bench/async_sim.py --inputs costs.json [--steps 20]      # prints one JSON object: per mode
    python bench/async_sim.py --demo                                # made-up costs, to see the shape

costs.json: {"decode_s": {"1": 0.020, "32": 0.031, "256": 0.090}, "prefill_s_per_token": 2e-5,
"update_s_per_token": 1e-4, "update_s_fixed": 1.0, "weight_sync_s": 2.0, "prompt_len": 64,
"lengths": [...] or {"lognormal": {"median": 203, "sigma": 0.9, "min": 7, "max": 512}},
"groups_per_step": 8, "n": 8, "max_num_seqs": 256, "max_staleness": 1, "seed": 0, "engines": 1,
"per_mode": {"async": {"engines": 1, "update_s_per_token": 2e-4}}}   # per_mode: a mode's own layout

Per mode: seconds for --steps updates, trained tokens per second, engine and trainer busy fractions, and
(fully_async) the staleness of trained samples (versions behind, mean/max per sample and per token) and
the fraction of tokens sampled across an update. The simulator has to predict this machine's measured
runs (bench/async_modes.py) within 15% before its predictions for a GPU cluster mean anything.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from dataclasses import dataclass, field
from typing import Optional

MODES = ("sync", "async", "fully_async")


@dataclass
class Costs:
    decode_s: dict[int, float]  # active samples -> seconds per decode step (measured; interpolated linearly)
    update_s_per_token: float
    update_s_fixed: float = 0.0
    weight_sync_s: float = 0.0
    prefill_s_per_token: float = 0.0
    prompt_len: int = 64

    def __post_init__(self):
        self.decode_s = {int(k): float(v) for k, v in self.decode_s.items()}
        if not self.decode_s or min(self.decode_s) < 1:
            raise ValueError("decode_s: give {active samples: seconds per step} for at least one batch size >= 1")
        self._sizes = sorted(self.decode_s)

    def step_s(self, active: int) -> float:
        """One decode step with `active` samples: linear between the measured sizes, extrapolated past them."""
        xs = self._sizes
        if len(xs) == 1:
            return self.decode_s[xs[0]] * max(active, 1) / xs[0] if active > xs[0] else self.decode_s[xs[0]]
        i = min(max(bisect.bisect_left(xs, active), 1), len(xs) - 1)
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self.decode_s[x0], self.decode_s[x1]
        return max(y0 + (y1 - y0) * (active - x0) / (x1 - x0), 0.0) if active > x0 or i > 1 else y0

    def train_s(self, tokens: int) -> float:
        return self.update_s_fixed + self.update_s_per_token * tokens


@dataclass
class Sample:
    group: int
    length: int  # response tokens it will sample
    done: int = 0  # sampled so far
    start_version: int = 0
    versions: list = field(default_factory=list)  # the policy version of each sampled token


@dataclass
class Result:
    mode: str
    seconds: float
    trained_tokens: int
    engine_busy_s: float
    trainer_busy_s: float
    staleness: list = field(default_factory=list)  # per trained sample: versions behind (the oldest token's)
    token_staleness: list = field(default_factory=list)  # per trained token
    cross_update: int = 0  # trained samples whose tokens span more than one version
    over_bound: int = 0

    def summary(self) -> dict:
        out = {"seconds": round(self.seconds, 3), "trained_tokens_per_s": round(self.trained_tokens / self.seconds, 3),
               "engine_busy_frac": round(self.engine_busy_s / self.seconds, 4),
               "trainer_busy_frac": round(self.trainer_busy_s / self.seconds, 4)}
        if self.mode == "fully_async":
            st, tok = self.staleness or [0], self.token_staleness or [0]
            out.update({"staleness_sample_mean": round(sum(st) / len(st), 4), "staleness_sample_max": max(st),
                        "staleness_token_mean": round(sum(tok) / len(tok), 4), "staleness_token_max": max(tok),
                        "cross_update_sample_frac": round(self.cross_update / max(len(self.staleness), 1), 4),
                        "over_bound": self.over_bound})
        return out


class Engine:
    """Continuous batching: `advance()` runs one decode step over every active sample (at most max_num_seqs)."""

    def __init__(self, costs: Costs, max_num_seqs: int, engines: int = 1):
        self.costs, self.max_num_seqs, self.engines = costs, max_num_seqs * engines, engines
        self.active: list[Sample] = []
        self.joining = 0  # samples that joined since the last step (their prefill is paid in the next one)

    def free(self) -> int:
        return self.max_num_seqs - len(self.active)

    def add(self, sample: Sample) -> None:
        self.active.append(sample)
        self.joining += 1

    def advance(self, version: int) -> tuple[float, list[Sample]]:
        """(seconds, the samples that finished in this step)."""
        share = -(-len(self.active) // self.engines)  # pooled engines: an even share each, prefills spread too
        dt = self.costs.step_s(share) + self.joining * self.costs.prefill_s_per_token * self.costs.prompt_len / self.engines
        self.joining = 0
        finished = []
        for s in self.active:
            s.done += 1
            s.versions.append(version)
            if s.done >= s.length:
                finished.append(s)
        if finished:
            self.active = [s for s in self.active if s.done < s.length]
        return dt, finished


def _generate_all(engine: Engine, samples: list[Sample], version: int) -> tuple[float, list[Sample]]:
    """Generate `samples` to the end (the engine admits them as slots free up); (seconds, finished)."""
    queue, done, t = list(samples), [], 0.0
    while queue or engine.active:
        while queue and engine.free() > 0:
            engine.add(queue.pop(0))
        dt, fin = engine.advance(version)
        t += dt
        done += fin
    return t, done


def _generate_split(costs: Costs, max_num_seqs: int, engines: int, batch: list[Sample], version: int,
                    n: int) -> float:
    """`batch` (groups of n) in `engines` contiguous parts of whole groups, each on its own engine at once: the
    slowest part's seconds."""
    part = max(-(-len(batch) // n // engines) * n, n)
    return max((_generate_all(Engine(costs, max_num_seqs), batch[i:i + part], version)[0]
                for i in range(0, len(batch), part)), default=0.0)


def _tokens(samples: list[Sample], prompt_len: int) -> int:
    return sum(s.length + prompt_len for s in samples)


def simulate(mode: str, costs: Costs, lengths: list[int], steps: int, groups_per_step: int, n: int,
             max_num_seqs: int, max_staleness: int = 1, engines: int = 1) -> Result:
    """Run `steps` updates of `mode`; sample k's response length is lengths[k % len(lengths)] (group g: n of them).
    engines: rollout engines working at once. sync and async split each batch in that many contiguous parts (the
    DP dispatch of megappo's worker groups) and wait for the slowest part; fully_async pools them (a sample goes
    wherever a slot is free: one engine with engines x max_num_seqs slots whose step costs what one engine's
    step over an even share of the active samples costs)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose from {', '.join(MODES)}")
    if engines < 1:
        raise ValueError(f"engines={engines}: give the number of rollout engines (>= 1)")
    per_step = groups_per_step * n
    counter = iter(range(10**12))

    def group(g: int, version: int = 0) -> list[Sample]:
        return [Sample(g, max(1, lengths[(g * n + j) % len(lengths)]), start_version=version) for j in range(n)]

    if mode == "sync":
        t = busy_e = busy_t = 0.0
        tokens = 0
        for step in range(steps):
            batch = [s for _ in range(groups_per_step) for s in group(next(counter), step)]
            gen_s = _generate_split(costs, max_num_seqs, engines, batch, step, n)
            train_s = costs.train_s(_tokens(batch, costs.prompt_len))
            t += gen_s + train_s + costs.weight_sync_s
            busy_e, busy_t, tokens = busy_e + gen_s, busy_t + train_s, tokens + _tokens(batch, costs.prompt_len)
        return Result(mode, t, tokens, busy_e, busy_t)
    if mode == "async":  # megappo's _launch_rollout: sync weights, start the next batch, train this one
        def batch_of(step):
            return [s for _ in range(groups_per_step) for s in group(next(counter), step)]

        batch = batch_of(0)
        gen_s = _generate_split(costs, max_num_seqs, engines, batch, 0, n)
        t, busy_e, busy_t, tokens = gen_s, gen_s, 0.0, 0
        for step in range(steps):
            t += costs.weight_sync_s
            train_s = costs.train_s(_tokens(batch, costs.prompt_len))
            nxt, next_gen = (batch_of(step + 1), 0.0) if step + 1 < steps else ([], 0.0)
            if nxt:
                next_gen = _generate_split(costs, max_num_seqs, engines, nxt, step, n)
            t += max(train_s, next_gen)  # the driver waits for both before the next step
            busy_e, busy_t, tokens = busy_e + next_gen, busy_t + train_s, tokens + _tokens(batch, costs.prompt_len)
            batch = nxt
        return Result(mode, t, tokens, busy_e, busy_t)
    return _fully_async(costs, lengths, steps, groups_per_step, n, max_staleness, Engine(costs, max_num_seqs, engines),
                        group)


def _fully_async(costs: Costs, lengths, steps, groups_per_step, n, max_staleness, engine: Engine, group) -> Result:
    """The engine steps continuously; the trainer (its own devices) trains whenever a batch of complete groups is
    buffered; each update ends with a weight sync that stalls the engine. A group is admitted (all n samples) only
    while groups started <= (version + max_staleness + 1) * groups_per_step: then every sample that can still be
    trained is at most max_staleness versions old when it is (AReaL's admission control)."""
    t = busy_e = busy_t = 0.0
    version, started, next_group = 0, 0, 0
    pending: dict[int, list] = {}  # group -> finished samples
    ready: list[list[Sample]] = []  # complete groups, oldest first
    train_until: Optional[float] = None  # the trainer's current update ends then
    training: list[list[Sample]] = []
    res = Result("fully_async", 0.0, 0, 0.0, 0.0)
    updates = 0
    while updates < steps:
        # admission: whole groups, within the staleness bound and the engine's slots
        while engine.free() >= n and started < (version + max_staleness + 1) * groups_per_step:
            for s in group(next_group, version):
                engine.add(s)
            next_group, started = next_group + 1, started + 1
        # the trainer starts an update as soon as a batch is buffered
        if train_until is None and len(ready) >= groups_per_step:
            training, ready = ready[:groups_per_step], ready[groups_per_step:]
            tokens = sum(_tokens(g, costs.prompt_len) for g in training)
            dt = costs.train_s(tokens)
            train_until, busy_t = t + dt, busy_t + dt
            res.trained_tokens += tokens
            for g in training:
                for s in g:
                    behind = version - min(s.versions)
                    res.staleness.append(behind)
                    res.token_staleness += [version - v for v in s.versions]
                    res.cross_update += len(set(s.versions)) > 1
                    res.over_bound += behind > max_staleness
        if engine.active:
            dt, fin = engine.advance(version)
            t, busy_e = t + dt, busy_e + dt
            for s in fin:
                pending.setdefault(s.group, []).append(s)
                if len(pending[s.group]) == n:
                    ready.append(pending.pop(s.group))
            if train_until is not None and t >= train_until:  # the update ended during this step: its weights
                t += costs.weight_sync_s  # load between two engine steps (paused, in-flight KV kept)
                version, updates, train_until = version + 1, updates + 1, None
        elif train_until is not None:  # nothing to generate: the engine waits for the update and its sync
            t = train_until + costs.weight_sync_s
            version, updates, train_until = version + 1, updates + 1, None
        else:
            raise RuntimeError("fully_async: nothing in flight and no batch to train (groups_per_step * n > engines * max_num_seqs?)")
    res.seconds, res.engine_busy_s, res.trainer_busy_s = t, busy_e, busy_t
    return res


def lengths_from(spec, seed: int = 0, count: int = 4096) -> list[int]:
    """A list as given, or {"lognormal": {"median", "sigma", "min", "max"}} drawn with `seed`."""
    if isinstance(spec, list):
        return [int(x) for x in spec]
    ln = spec["lognormal"]
    rng = random.Random(seed)
    return [int(min(max(round(rng.lognormvariate(math.log(ln["median"]), ln["sigma"])), ln["min"]), ln["max"]))
            for _ in range(count)]


DEMO = {"decode_s": {"1": 0.02, "64": 0.03, "256": 0.08}, "prefill_s_per_token": 2e-5, "update_s_per_token": 2e-4,
        "update_s_fixed": 1.0, "weight_sync_s": 1.0, "prompt_len": 64,
        "lengths": {"lognormal": {"median": 203, "sigma": 0.9, "min": 7, "max": 512}},
        "groups_per_step": 8, "n": 8, "max_num_seqs": 256, "max_staleness": 1, "seed": 0}


def run(inputs: dict, steps: int, modes=MODES) -> dict:
    """Simulate each mode; inputs["per_mode"][mode] (optional) overrides keys for that mode (each mode's own layout:
    its engines, its trainer's update costs, its weight sync)."""
    out = {"inputs": inputs, "steps": steps}
    for mode in modes:
        m = {**inputs, **inputs.get("per_mode", {}).get(mode, {})}
        costs = Costs(m["decode_s"], float(m["update_s_per_token"]), float(m.get("update_s_fixed", 0.0)),
                      float(m.get("weight_sync_s", 0.0)), float(m.get("prefill_s_per_token", 0.0)),
                      int(m.get("prompt_len", 64)))
        out[mode] = simulate(mode, costs, lengths_from(m["lengths"], int(m.get("seed", 0))), steps,
                             int(m["groups_per_step"]), int(m["n"]), int(m["max_num_seqs"]),
                             int(m.get("max_staleness", 1)), int(m.get("engines", 1))).summary()
    base = out[modes[0]]["trained_tokens_per_s"]
    for mode in modes:
        out[mode]["speedup_vs_" + modes[0]] = round(out[mode]["trained_tokens_per_s"] / base, 3)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--inputs", help="the measured costs (JSON; see the module docstring)")
    g.add_argument("--demo", action="store_true", help="made-up costs")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    inputs = DEMO if args.demo else json.loads(open(args.inputs).read())
    print(json.dumps(run(inputs, args.steps)))


if __name__ == "__main__":
    main()
