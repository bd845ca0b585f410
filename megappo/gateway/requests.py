"""What a request to the gateway may say (gateway/app.py's routes): the fields this server refuses in one line, the
ones a training session fixes, the caps on n and logprobs, and the readers of messages, tools, max_tokens and the
bearer key. Every refusal is a GatewayError, which the app answers as OpenAI's error object with one line."""

from __future__ import annotations

from typing import Optional


ROLES = ("system", "user", "assistant", "tool")


class GatewayError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


# what a request may ask for that this server does not do (refused in one line, not ignored): field -> what it is
UNSUPPORTED = {"response_format": "structured output formats other than text", "suffix": "insertion",
               "best_of": "best-of-n ranking", "functions": "the legacy functions API: send tools",
               "function_call": "the legacy functions API: send tool_choice", "prediction": "predicted outputs",
               "audio": "audio output", "modalities": "output modalities other than text", "logprobs_mode": ""}
# what would change the distribution a training session samples from -> the value that changes nothing
SESSION_FIXED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {}}


MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's cap)
MAX_N = 16  # samples per prompt one request may ask for


def n(body: dict, state) -> int:
    """Samples per prompt (null: 1). A session is one conversation: one sample per request."""
    n = body.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise GatewayError(400, f"n={n!r} must be an integer in [1, {MAX_N}]")
    if n > 1 and state is not None:
        raise GatewayError(400, "n must be 1 in a session (one conversation): open one session per sample")
    return n


def nth(body: dict, j: int) -> dict:
    """Sample j of a request with n > 1: the request's seed + j (every sample its own stream), or none."""
    return body if j == 0 or body.get("seed") is None else {**body, "seed": body["seed"] + j}


def top_logprobs(body: dict) -> Optional[int]:
    """Chat: alternatives per sampled token (top_logprobs, which needs logprobs: true)."""
    top = body.get("top_logprobs")
    if top is None:
        return None
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
        raise GatewayError(400, f"top_logprobs={top!r} must be an integer in [0, {MAX_LOGPROBS}]")
    if not body.get("logprobs"):
        raise GatewayError(400, "top_logprobs needs logprobs: true")
    return top


def refuse_unsupported(body: dict) -> None:
    for key, what in UNSUPPORTED.items():
        value = body.get(key)
        if value is None or (key == "response_format" and isinstance(value, dict) and value.get("type") == "text") \
                or (key == "best_of" and value == 1) or (key == "modalities" and value == ["text"]):
            continue
        raise GatewayError(400, f"{key} is not supported by this server ({what}); drop it" if what else
                                f"{key} is not supported by this server; drop it")


def given(body: dict, key: str, default: float) -> float:
    """A number the request gives, or the default for one it leaves out or sends as null (as vLLM's server)."""
    value = body.get(key)
    return default if value is None else float(value)


def max_tokens(body: dict, default: int):
    """What the request asks for (max_completion_tokens, else max_tokens; 0 is an ask, refused later), else default."""
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return body[key]
    return default


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def bearer(authorization: Optional[str]) -> str:
    """The key of an `Authorization: Bearer <key>` header ('' when there is none)."""
    return (authorization or "").removeprefix("Bearer ").strip()


def messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise GatewayError(400, f"messages[{i}] must be an object with a role in {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if content is not None and not isinstance(content, str):
            raise GatewayError(400, f"messages[{i}].content must be a string, a list of text parts or null")
        out.append({**m, "content": content})
    return out


def tools(tools) -> Optional[list]:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and t["function"].get("name") for t in tools):
        raise GatewayError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}')
    return tools
