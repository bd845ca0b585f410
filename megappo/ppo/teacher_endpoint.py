"""On-policy distillation's teacher behind an OpenAI-compatible server (`teacher.endpoint`): the log-probability
it gives each token of each row. One `/v1/completions` request per `rows_per_request` consecutive rows (a GRPO
group's samples), their token ids as a batch prompt with `echo: true, logprobs: 0` (the prompts' log-probs, as
lm-evaluation-harness asks vLLM's server and megappo serve for them; vLLM scores prompt tokens without the
sampling processors, so at temperature 1), `concurrency` requests in flight. The answers are read on the client's
own thread, never the driver's. A connection error, a timeout, a 408/425/429/5xx or an unreadable answer is retried (`retries` times,
backoff doubling from `backoff_s`, capped at 30 s, jittered); another 4xx is the server's own line at once. A
request that fails every try fails the step (TeacherEndpointError): no row is trained without its teacher.

The trainer submits a batch before its own forwards and collects it after (ppo/ray_trainer._score_tokens), so
the server's time hides behind pi_old's and the reference's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from megappo.utils.http_retry import GaveUp, Refused, request_json

class TeacherEndpointError(RuntimeError):
    """The teacher server failed a row on every try, or refused it: the step cannot be trained."""


@dataclass
class TeacherStats:
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0
    latencies: list = field(default_factory=list)

    def metrics(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        return {"distill/teacher_requests": self.requests, "distill/teacher_retries": self.retries,
                "timing/teacher_s": self.seconds, "perf/teacher_latency_p50_s": lat[len(lat) // 2],
                "perf/teacher_latency_max_s": lat[-1]}


class TeacherEndpoint:
    def __init__(self, url: str, model: Optional[str] = None, api_key: Optional[str] = None, concurrency: int = 16,
                 timeout_s: float = 120.0, retries: int = 3, backoff_s: float = 1.0, rows_per_request: int = 8):
        self.url = url.rstrip("/")
        self.model, self.api_key = model, api_key
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.rows_per_request = rows_per_request
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="teacher")

    @classmethod
    def from_config(cls, teacher) -> "TeacherEndpoint":
        return cls(teacher.endpoint, teacher.endpoint_model, os.environ.get(teacher.api_key_env),
                   teacher.concurrency, teacher.timeout_s, teacher.retries, teacher.backoff_s, teacher.rows_per_request)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the trainer's calls -----------------------------------------------------------------------------

    def submit(self, rows: list[list[int]]) -> concurrent.futures.Future:
        """Score `rows` (token ids, prompt and response) in the background: a future of (per row, the log-prob of
        each token after the first; TeacherStats)."""
        return self._pool.submit(lambda: asyncio.run(self._score_all(rows)))

    def score(self, rows: list[list[int]]) -> tuple[list[list[float]], TeacherStats]:
        return self.submit(rows).result()

    def check(self) -> str:
        """The model name the server serves (`teacher.endpoint_model`, else the first /v1/models lists), asked
        with the same retries: a server that is not there fails in one line before the workers start."""
        return self._pool.submit(lambda: asyncio.run(self._model_name())).result()

    # ---- over HTTP ---------------------------------------------------------------------------------------

    def _client(self):
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=self.timeout_s, limits=limits)

    async def _model_name(self) -> str:
        if self.model:
            return self.model
        async with self._client() as client:
            body = await self._request(client, "GET", "/models", None, TeacherStats(), "the model list")
        data = body.get("data") if isinstance(body, dict) else None
        names = [m.get("id") for m in data if isinstance(m, dict) and m.get("id")] if isinstance(data, list) else []
        if not names:
            raise TeacherEndpointError(f"teacher.endpoint {self.url} lists no model at /models; set "
                                       "teacher.endpoint_model")
        self.model = names[0]
        return self.model

    async def _score_all(self, rows: list[list[int]]) -> tuple[list[list[float]], TeacherStats]:
        stats, start = TeacherStats(), time.perf_counter()
        model = await self._model_name()
        gate = asyncio.Semaphore(self.concurrency)
        async with self._client() as client:
            async def one(first: int, chunk: list[list[int]]) -> list[list[float]]:
                what = f"row {first}" if len(chunk) == 1 else f"rows {first}-{first + len(chunk) - 1}"
                async with gate:
                    body = {"model": model, "prompt": chunk, "echo": True, "logprobs": 0, "max_tokens": 1,
                            "temperature": 1.0}
                    t0 = time.perf_counter()
                    answer = await self._request(client, "POST", "/completions", body, stats, what)
                    stats.latencies.append(time.perf_counter() - t0)
                    return self._rows_log_probs(answer, chunk, first, what)

            n = self.rows_per_request
            parts = await asyncio.gather(*(one(i, rows[i:i + n]) for i in range(0, len(rows), n)))
        stats.seconds = time.perf_counter() - start
        return [lp for part in parts for lp in part], stats

    def _rows_log_probs(self, answer, chunk: list[list[int]], first: int, what: str) -> list[list[float]]:
        """Each row's log-probs from a batch prompt's answer (`what`: its rows, for the error line): one choice per
        prompt, in the order of their index."""
        choices = answer.get("choices") if isinstance(answer, dict) else None
        try:
            choices = sorted(choices, key=lambda c: c["index"])
        except (KeyError, TypeError):  # no list, or a choice without an index
            choices = None
        if choices is None or len(choices) != len(chunk):
            raise TeacherEndpointError(f"teacher.endpoint {self.url}: a batch of {len(chunk)} prompts ({what}) came "
                                       "back with "
                                       f"{'no indexed' if choices is None else len(choices)} choices; it must be an "
                                       "OpenAI-compatible completions server that takes a batch of token-id prompts "
                                       "(vllm serve, megappo serve), or set teacher.rows_per_request=1")
        top = answer.get("prompt_token_ids") if len(chunk) == 1 else None  # (a one-prompt answer may carry it there)
        return [self._prompt_log_probs(c, top, ids, first + k) for k, (c, ids) in enumerate(zip(choices, chunk))]

    def _prompt_log_probs(self, choice: dict, top, ids: list[int], i: int) -> list[float]:
        """log p(ids[k] | ids[:k]) for k >= 1 from an echoed completion's choice (its first len(ids) entries)."""
        try:
            lps = choice["logprobs"]["token_logprobs"][:len(ids)]
            echoed = choice.get("prompt_token_ids") or top
        except (KeyError, IndexError, TypeError):
            raise TeacherEndpointError(f"teacher.endpoint {self.url}: row {i}'s answer has no echoed logprobs "
                                       "(choices[].logprobs.token_logprobs); it must be an OpenAI-compatible "
                                       "completions server that supports echo (vllm serve, megappo serve)") from None
        if len(lps) < len(ids) or any(lp is None for lp in lps[1:]) or echoed is not None and list(echoed) != ids:
            raise TeacherEndpointError(f"teacher.endpoint {self.url}: row {i}'s {len(ids)} token ids came back as "
                                       f"{len(lps)} log-probs or other ids: the server must score the ids as sent "
                                       "(the teacher shares the student's tokenizer)")
        return [float(lp) for lp in lps[1:]]

    async def _request(self, client, method: str, path: str, body, stats: TeacherStats, what: str) -> dict:
        @contextlib.asynccontextmanager
        async def counted():
            stats.requests += 1
            yield

        def retried():
            stats.retries += 1

        try:
            return await request_json(client, method, path, body, self.retries, self.backoff_s, counted, retried)
        except Refused as e:
            raise TeacherEndpointError(f"teacher.endpoint {self.url} refused {what}: {e}") from None
        except GaveUp as e:
            raise TeacherEndpointError(f"teacher.endpoint {self.url} failed {what} {e}; check the server, or raise "
                                       "teacher.retries / teacher.timeout_s") from None


def place(rows_log_probs: list[list[float]], attention_mask, prompt_width: int):
    """The teacher's log-probs as a [B, R] tensor beside the batch's responses: row i's response token j is
    its (real prompt length + j)-th token, scored from the log-probs of its tokens after the first."""
    import torch

    b, width = attention_mask.shape
    out = torch.zeros(b, width - prompt_width, dtype=torch.float32)
    for i, lps in enumerate(rows_log_probs):
        p = int(attention_mask[i, :prompt_width].sum())
        n = int(attention_mask[i, prompt_width:].sum())
        out[i, :n] = torch.tensor(lps[p - 1:p - 1 + n], dtype=torch.float32)
    return out


def rows_of(input_ids, attention_mask) -> list[list[int]]:
    """Each row's real tokens (its prompt, then every response token: sampled, tool results, text an agent
    inserted), which the teacher scores as context."""
    return [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
