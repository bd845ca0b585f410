"""The generative judge (reward.judge): a model behind an OpenAI-compatible server (`megappo serve`, vLLM) reads
a template filled with the row's {prompt}, {response} and {ground_truth} and gives its verdict.

    reward:
      judge:
        endpoint: http://10.0.0.5:8000/v1
        tokenizer: /models/judge            # the judge model's HF dir (its tokenizer and chat template)
        prompt: "Question: {prompt}\nAnswer: {response}\nReference: {ground_truth}\nIs the answer right?"
        fallback: 0.5                       # what a row the judge failed gets (counted in reward/judge_errors)
        sources: [my_source]                # data sources the judge scores alone; or a combine term `judge`

or, instead of `endpoint`, `model: /models/judge` (its tokenizer the default): megappo serves the judge on a
vLLM engine of its own (ppo/judge_engine.py: a Ray actor on `gpus` GPUs, on loopback under a key made
there), started once by `start_judges` (the trainer, `megappo reward`) and asked as an endpoint is.

The prompt is rendered here, by the judge's tokenizer: `chat: true` as one user turn through its chat template
(the generation prompt appended), `chat: false` as raw text (with the tokenizer's BOS). Verdict scoring (the
default) sends /v1/completions the token ids prompt + verdict for each of `positive` and `negative`, with
`echo: true, logprobs: 0, max_tokens: 1`, and sums the verdict tokens' echoed log-probs: log P(verdict | prompt)
exactly, the way lm-evaluation-harness scores a log-likelihood request, whatever the top-k holds. (A chat
completion cannot echo a given continuation's log-probs, and a server's own tokenization of text could split
prompt and verdict differently: token ids rendered here are what the server scores.) The score is
P(positive) / (P(positive) + P(negative)). `parse` instead: the judge generates (greedy, `max_tokens`) and the
regex's first group (else its whole match) read as a number is the score.

Each request is retried on a connection error, a timeout, a 408/425/429/5xx or an unreadable answer (`retries`
times, backoff doubling from `backoff_s`, capped at 30 s, jittered), at most `concurrency` in flight (over every
call at once: calls from several threads share the judge's one event loop and its cap). A row that fails (every
try, a refusal, no parsable grade) scores `fallback` with failure "error" (counted in reward/num_scorer_errors)
and judge_errors=1 (reward/judge_errors: the step's count), warned once per call. The judge needs the row's
prompt: the RewardManager and `megappo reward` put it in extra_info[PROMPT] (rewards/rules.py) for a source whose
rule has `needs_prompt`. The API key is read from $`api_key_env` (an own engine's is made for it), never logged.
In training, `overlap` (the default) judges the rows as they come, beside the rollout (ppo/judge_overlap.py).
This module imports no torch; httpx and the tokenizer load on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import string
import threading
from typing import Optional

from megappo.rewards.rules import PROMPT, Scored, as_rule
from megappo.utils.http_retry import GaveUp, Refused, request_json

log = logging.getLogger(__name__)
FIELDS = ("prompt", "response", "ground_truth")
ERRORS = "judge_errors"


class JudgeError(RuntimeError):
    """One row's judgment failed: it gets the fallback."""


def check_template(template) -> None:
    """The prompt template: text whose fields are {prompt}, {response}, {ground_truth} ({response} required)."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError("reward.judge.prompt is empty; give a template with {response} (and {prompt}, "
                         "{ground_truth} as needed)")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ValueError(f"reward.judge.prompt is not a template ({e}); write literal braces as "
                         "{{ and }}") from None
    unknown = sorted(names - set(FIELDS))
    if unknown:
        raise ValueError(f"reward.judge.prompt names {unknown}; its fields are {{prompt}}, {{response}}, "
                         "{ground_truth} (write literal braces as {{ and }})")
    if "response" not in names:
        raise ValueError("reward.judge.prompt has no {response}: the judge would never see the answer; add {response}")


class JudgeReward:
    """A batched rule (rewards/rules.py): `judge(responses, ground_truths, extra_infos) -> [Scored]`."""

    needs_prompt = True

    def __init__(self, judge):
        """From the config's reward.judge section; ValueError in one line naming the fix. reward.judge.model: the
        engine starts in `start()` (the trainer and `megappo reward` start it once and `close()` it)."""
        if judge.model and judge.endpoint:
            raise ValueError("reward.judge sets both endpoint (a server) and model (a judge megappo serves); set one")
        if not (judge.model or judge.endpoint):
            raise ValueError("reward.judge needs reward.judge.endpoint, an OpenAI-compatible server, e.g. "
                             "http://127.0.0.1:8000/v1 (megappo serve --model DIR, vllm serve), or reward.judge.model, "
                             "a HF dir megappo serves on its own engine")
        if judge.model:
            _check_engine(judge)
        tokenizer = judge.tokenizer or judge.model
        if not tokenizer:
            raise ValueError("reward.judge.tokenizer is not set; give the judge model's HF dir (its tokenizer renders "
                             "the prompt the server scores)")
        if not os.path.isdir(os.path.expanduser(str(tokenizer))):
            raise ValueError(f"reward.judge.tokenizer={tokenizer} is not a directory; give the judge model's HF "
                             "dir (its tokenizer renders the prompt the server scores)")
        check_template(judge.prompt)
        for key in ("positive", "negative"):
            if not isinstance(getattr(judge, key), str) or not getattr(judge, key):
                raise ValueError(f"reward.judge.{key} is empty; give the verdict text the judge answers, e.g. "
                                 f"{' Yes' if key == 'positive' else ' No'!r}")
        if judge.positive == judge.negative:
            raise ValueError(f"reward.judge.positive and negative are both {judge.positive!r}; give two verdicts")
        if judge.parse is not None:
            try:
                re.compile(judge.parse)
            except re.error as e:
                raise ValueError(f"reward.judge.parse={judge.parse!r} is not a regex ({e})") from None
        rules = {"concurrency": (_int(judge.concurrency) and judge.concurrency >= 1, "a whole number >= 1"),
                 "retries": (_int(judge.retries) and judge.retries >= 0, "a whole number >= 0"),
                 "max_tokens": (_int(judge.max_tokens) and judge.max_tokens >= 1, "a whole number >= 1"),
                 "timeout_s": (_num(judge.timeout_s) and judge.timeout_s > 0, "a number of seconds > 0"),
                 "backoff_s": (_num(judge.backoff_s) and judge.backoff_s >= 0, "a number of seconds >= 0"),
                 "fallback": (_num(judge.fallback) and math.isfinite(judge.fallback),
                              "a finite number: the score a row gets when its judgment fails (e.g. 0.5)")}
        for key, (ok, rule) in rules.items():
            if not ok:
                raise ValueError(f"reward.judge.{key}={getattr(judge, key)!r} must be {rule}")
        self.cfg, self.tokenizer_dir = judge, os.path.expanduser(str(tokenizer))
        self.url = judge.endpoint.rstrip("/") if judge.endpoint else None  # reward.judge.model: once started
        self.where = f"reward.judge.endpoint {self.url}"  # how an error names the server
        self.engine = None  # reward.judge.model's (ppo/judge_engine.py)
        self.fallback = float(judge.fallback)
        self._tokenizer = None
        self._lock, self._render = threading.Lock(), threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # every call's requests, on one thread (_run)
        self._gate: Optional[asyncio.Semaphore] = None  # its cap: over every call in flight at once
        self.in_flight = self.max_in_flight = self.requests = self.retries = 0

    # ---- rendering ---------------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            except Exception as e:  # noqa: BLE001 - a path that holds no tokenizer
                raise ValueError(f"reward.judge.tokenizer={self.tokenizer_dir}: no tokenizer loads there "
                                 f"({type(e).__name__}); give the judge model's HF dir") from None
        return self._tokenizer

    def prompt_ids(self, prompt, response: str, ground_truth) -> list[int]:
        """The judge's prompt as token ids: the template filled, as a user turn (chat) or raw text."""
        text = self.cfg.prompt.format(prompt="" if prompt is None else prompt, response=response,
                                      ground_truth=ground_truth)
        tok = self.tokenizer
        if self.cfg.chat:
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
            return tok(rendered, add_special_tokens=False)["input_ids"]
        return tok(text)["input_ids"]

    def verdict_ids(self, verdict: str) -> list[int]:
        """A verdict's tokens, encoded alone (as lm-eval encodes a continuation)."""
        return self.tokenizer(verdict, add_special_tokens=False)["input_ids"]

    @staticmethod
    def probability(log_positive: float, log_negative: float) -> float:
        """P(positive) / (P(positive) + P(negative)) from the two log-probabilities (stable at any scale)."""
        return 1.0 / (1.0 + math.exp(min(log_negative - log_positive, 700.0)))

    # ---- reward.judge.model's engine -------------------------------------------------------------------

    def attach(self, engine) -> None:
        """reward.judge.model: `engine` (ppo/judge_engine.JudgeEngine, started by start_judges) serves this judge."""
        self.engine, self.url = engine, engine.url
        self.where = f"reward.judge.model {self.cfg.model} (served at {self.url})"

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    def _run(self, coroutine):
        """`coroutine` on the judge's own event loop (one thread, whatever the caller's loop), waited for: calls from
        several threads at once (the trainer's judge_overlap thread, a validation) share one cap."""
        with self._lock:
            if self._loop is None:
                self._loop, self._gate = asyncio.new_event_loop(), asyncio.Semaphore(self.cfg.concurrency)
                threading.Thread(target=self._loop.run_forever, name="judge", daemon=True).start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    # ---- the rule ----------------------------------------------------------------------------------------

    def __call__(self, responses: list, ground_truths: list, extra_infos: list) -> list[Scored]:
        if self.url is None:
            raise RuntimeError("reward.judge.model's engine is not started: JudgeReward.start() first "
                               "(start_judges, as the trainer and megappo reward do)")
        with self._render:  # one thread at a time in the tokenizer (and its first load)
            rows = [self.prompt_ids((info or {}).get(PROMPT), str(r), t)
                    for r, t, info in zip(responses, ground_truths, extra_infos)]
        results = self._run(self._judge_all(rows))
        out, failed = [], [r for r in results if isinstance(r, Exception)]
        for r in results:
            out.append(Scored(self.fallback, {ERRORS: 1.0}, "error") if isinstance(r, Exception)
                       else Scored(r, {ERRORS: 0.0}))
        if failed:
            log.warning("reward.judge: %d of %d rows failed (%s); they scored reward.judge.fallback=%s",
                        len(failed), len(rows), failed[0], self.fallback)
        return out

    async def _judge_all(self, rows: list[list[int]]) -> list:
        import httpx

        key = self.engine.key if self.engine else os.environ.get(self.cfg.api_key_env or "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        n, gate = self.cfg.concurrency, self._gate
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=self.cfg.timeout_s,
                                     limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as client:
            try:
                model = self.cfg.endpoint_model or await self._model(client, gate)
            except JudgeError as e:  # the server never answered: every row gets the fallback
                return [e] * len(rows)
            verdicts = [self.verdict_ids(self.cfg.positive), self.verdict_ids(self.cfg.negative)]

            async def one(i: int, ids: list[int]):
                try:
                    if self.cfg.parse is not None:
                        return await self._parse(client, gate, model, ids, i)
                    lp = await asyncio.gather(*(self._log_prob(client, gate, model, ids, v, i) for v in verdicts),
                                              return_exceptions=True)  # both finish before the client closes
                    failed = [e for e in lp if isinstance(e, BaseException)]
                    if failed:
                        raise failed[0]
                    return self.probability(*lp)
                except JudgeError as e:
                    return e

            return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(rows)))

    async def _model(self, client, gate) -> str:
        try:
            body = await self._request(client, gate, "GET", "/models", None, "the model list")
            return next(m["id"] for m in body["data"] if isinstance(m, dict) and m.get("id"))
        except (KeyError, TypeError, StopIteration):
            raise JudgeError(f"{self.where} lists no model at /models; set reward.judge.endpoint_model") from None

    async def _log_prob(self, client, gate, model: str, ids: list[int], verdict: list[int], i: int) -> float:
        """log P(verdict | prompt): the verdict tokens' echoed log-probs, summed."""
        full = ids + verdict
        body = {"model": model, "prompt": full, "echo": True, "logprobs": 0, "max_tokens": 1, "temperature": 1.0}
        answer = await self._request(client, gate, "POST", "/completions", body, f"row {i}")
        try:
            lps = answer["choices"][0]["logprobs"]["token_logprobs"][len(ids):len(full)]
            total = sum(float(lp) for lp in lps)
        except (KeyError, IndexError, TypeError, ValueError):
            raise JudgeError(f"{self.where}: row {i}'s answer has no echoed log-probs (choices[0].logprobs."
                             "token_logprobs); it must be a completions server that supports echo (megappo serve, "
                             "vllm serve)") from None
        if len(lps) != len(verdict):
            raise JudgeError(f"{self.where}: row {i}'s {len(full)} token ids came back as fewer log-probs; the "
                             "server must score the ids as sent")
        return total

    async def _parse(self, client, gate, model: str, ids: list[int], i: int) -> float:
        body = {"model": model, "prompt": ids, "max_tokens": self.cfg.max_tokens, "temperature": 0.0}
        answer = await self._request(client, gate, "POST", "/completions", body, f"row {i}")
        try:
            text = str(answer["choices"][0]["text"])
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"{self.where}: row {i}'s answer has no choices[0].text") from None
        match = re.search(self.cfg.parse, text)
        try:
            grade = float(match.group(1) if match.groups() else match.group(0))
        except (AttributeError, TypeError, ValueError):
            raise JudgeError(f"the judge's text for row {i} has no grade reward.judge.parse={self.cfg.parse!r} "
                             f"reads ({text[:80]!r})") from None
        if not math.isfinite(grade):
            raise JudgeError(f"the judge's grade for row {i} is {grade}")
        return grade

    async def _request(self, client, gate, method: str, path: str, body, what: str) -> dict:
        @contextlib.asynccontextmanager
        async def counted():  # one try: within the concurrency cap, counted in flight
            async with gate:
                with self._lock:
                    self.requests += 1
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    yield
                finally:
                    with self._lock:
                        self.in_flight -= 1

        def retried():
            with self._lock:
                self.retries += 1

        c = self.cfg
        try:
            return await request_json(client, method, path, body, c.retries, c.backoff_s, counted, retried)
        except Refused as e:
            raise JudgeError(f"{self.where} refused {what}: {e}") from None
        except GaveUp as e:
            raise JudgeError(f"{self.where} failed {what} {e}; check the server, or raise reward.judge.retries / "
                             "timeout_s") from None


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_engine(judge) -> None:
    """reward.judge.model and its engine's settings, before anything starts."""
    from megappo.model_dirs import ModelDirError, kind_of

    try:
        hf = kind_of(os.path.expanduser(str(judge.model))) == "hf"
    except ModelDirError:
        hf = False
    if not hf:
        raise ValueError(f"reward.judge.model={judge.model} is not a HF model dir (config.json + *.safetensors); give "
                         "one (megappo export turns a checkpoint into one)")
    if judge.gpus not in (None, 0, 1) or isinstance(judge.gpus, bool):
        raise ValueError(f"reward.judge.gpus={judge.gpus!r} must be 0 (the CPU) or 1; a judge on more GPUs: serve it "
                         "(vllm serve --tensor-parallel-size N) and set reward.judge.endpoint")
    rules = {"max_model_len": (judge.max_model_len is None or _int(judge.max_model_len) and judge.max_model_len >= 2,
                               "a whole number >= 2, or null (the model's positions)"),
             "gpu_memory_utilization": (_num(judge.gpu_memory_utilization) and 0 < judge.gpu_memory_utilization <= 1,
                                        "a fraction in (0, 1]"),
             "kv_cache_memory_mb": (_int(judge.kv_cache_memory_mb) and judge.kv_cache_memory_mb >= 1,
                                    "a whole number of MiB >= 1")}
    for key, (ok, rule) in rules.items():
        if not ok:
            raise ValueError(f"reward.judge.{key}={getattr(judge, key)!r} must be {rule}")


def judges_of(scorers: dict) -> list[JudgeReward]:
    """The judges among {data_source: rule} (rewards/rules.load_rewards', a RewardManager's scorers: one, shared by
    its sources and terms)."""
    from megappo.rewards.combine import Combined

    found: list[JudgeReward] = []
    for rule in map(as_rule, scorers.values()):
        fns = [t.rule.fn for t in rule.fn.terms if t.rule] if isinstance(rule.fn, Combined) else [rule.fn]
        found += [fn for fn in fns if isinstance(fn, JudgeReward) and all(fn is not f for f in found)]
    return found
