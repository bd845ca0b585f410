"""One request to an OpenAI-compatible server, retried as megappo's clients of one retry it (the distillation
teacher's endpoint, the generative judge): a connection error, a timeout, a 408/425/429/5xx or an answer that is not
JSON is tried again (`retries` more times, backoff doubling from `backoff_s`, capped at MAX_BACKOFF_S, jittered);
another status is the server's refusal at once. The caller says what each outcome means in its own words."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Callable

RETRY_STATUS = (408, 425, 429)  # and every 5xx
MAX_BACKOFF_S = 30.0


class Refused(Exception):
    """The server refused the request (a status no retry changes): `status`, `line` (its error message)."""

    def __init__(self, status: int, line: str):
        super().__init__(f"HTTP {status}: {line}")
        self.status, self.line = status, line


class GaveUp(Exception):
    """Every try failed: `tries`, `last` (what the last one got)."""

    def __init__(self, tries: int, last: str):
        super().__init__(f"{tries} times (last: {last})")
        self.tries, self.last = tries, last


async def request_json(client, method: str, path: str, body, retries: int, backoff_s: float,
                       attempt: Callable = contextlib.nullcontext, on_retry: Callable = lambda: None) -> dict:
    """The answer's JSON; Refused or GaveUp otherwise. `attempt()`: an async context around each try (a concurrency
    gate, counters); `on_retry()`: called before each retry's wait. `client`: an httpx.AsyncClient."""
    import httpx

    last = ""
    for n in range(retries + 1):
        if n:
            on_retry()
            await asyncio.sleep(min(MAX_BACKOFF_S, backoff_s * 2 ** (n - 1)) * random.uniform(0.5, 1.5))
        async with attempt():
            try:
                r = await client.request(method, path, json=body)
            except httpx.TransportError as e:  # refused, reset, timed out
                last = f"{type(e).__name__}: {e}".strip(": ")
                continue
        if r.status_code == 200:
            try:
                return r.json()
            except ValueError:
                last = "an answer that is not JSON"
                continue
        line = error_line(r)
        if r.status_code in RETRY_STATUS or r.status_code >= 500:
            last = f"HTTP {r.status_code}: {line}"
            continue
        raise Refused(r.status_code, line)
    raise GaveUp(retries + 1, last)


def error_line(r) -> str:
    """A failed answer's message as one line (OpenAI's error object, else the body)."""
    try:
        err = r.json().get("error")
        text = err.get("message") if isinstance(err, dict) else (err or r.text)
    except (ValueError, AttributeError):
        text = r.text
    return " ".join(str(text).split())[:300]
