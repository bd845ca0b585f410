"""What a request to the gateway may say (gateway/app.py's routes): the fields this server refuses in one line, the
ones a training session fixes, the caps on n and logprobs, and the readers of messages, tools, max_tokens and the
bearer key. Every refusal is a GatewayError, which the app answers as OpenAI's error object with one line."""

from __future__ import annotations

import functools
from typing import Optional


ROLES = ("system", "user", "assistant", "tool")


class GatewayError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


# what each route reads (the OpenAI fields and the vLLM extensions this server does); any other key is one 400
# line naming it (vLLM's server would ignore an unknown key, debug-logged: pydantic extra="allow"). `user` has
# no effect (as on vLLM's); `return_token_ids`: the ids are always returned (prompt_token_ids, token_ids).
_SAMPLING = ("model", "max_tokens", "n", "seed", "stop", "stop_token_ids", "stream", "stream_options", "temperature",
             "top_p", "top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logit_bias", "logprobs", "user", "return_token_ids")
FIELDS = {"/v1/completions": frozenset(_SAMPLING + ("prompt", "echo")),
          "/v1/chat/completions": frozenset(_SAMPLING + ("messages", "max_completion_tokens", "top_logprobs", "tools",
                                                         "tool_choice", "parallel_tool_calls", "chat_template_kwargs"))}
# fields a request may send that this server does not do (refused in one line unless they ask for nothing: the
# value in NO_OP, or vLLM's own default for a vLLM field): field -> what it is
UNSUPPORTED = {"response_format": "structured output formats other than text", "suffix": "insertion",
               "best_of": "best-of-n ranking", "functions": "the legacy functions API: send tools",
               "function_call": "the legacy functions API: send tool_choice", "prediction": "predicted outputs",
               "audio": "audio output", "modalities": "output modalities other than text"}
NO_OP = {"response_format": {"type": "text"}, "best_of": 1, "modalities": ["text"]}
# what would change the distribution a training session samples from -> the value that changes nothing (min_tokens
# masks the stop tokens, so the sampled log-probs would not be the policy's the trainer scores)
SESSION_FIXED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {},
                 "min_tokens": 0}
LOGPROB_FLOOR = -9999.0  # vLLM's server writes a -inf log-prob (a token top_k / top_p cut) as this: JSON has no inf


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


def refuse_unsupported(body: dict, route: str) -> None:
    """Every key of the request is one `route` reads (FIELDS) or asks for nothing (a null, NO_OP, vLLM's default
    for a vLLM field); else GatewayError naming it."""
    vllm_defaults = _vllm_defaults(route)
    for key, value in body.items():
        if value is None or (key in NO_OP and value == NO_OP[key]):
            continue
        if key in UNSUPPORTED:
            raise GatewayError(400, f"{key} is not supported by this server ({UNSUPPORTED[key]}); drop it")
        if key in FIELDS[route] or vllm_defaults.get(key, ...) == value:
            continue
        if key in vllm_defaults:
            raise GatewayError(400, f"{key}={_short(value)} (a vLLM extension) is not supported by this server; "
                                    "drop it")
        raise GatewayError(400, f"{key} is not a field of {route} (vLLM's server would ignore it): drop it, or check "
                                "its spelling")


# vLLM's request model of each route (module under vllm.entrypoints.openai, class)
_VLLM_REQUESTS = {"/v1/completions": ("completion", "CompletionRequest"),
                  "/v1/chat/completions": ("chat_completion", "ChatCompletionRequest")}


@functools.cache
def _vllm_defaults(route: str) -> dict:
    """The fields of vLLM 0.32's request model of `route`, each with its default (what asks for nothing)."""
    import importlib

    module, name = _VLLM_REQUESTS[route]
    model = getattr(importlib.import_module(f"vllm.entrypoints.openai.{module}.protocol"), name)
    return {field: info.get_default(call_default_factory=True) for field, info in model.model_fields.items()}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def floored(logprob: float) -> float:
    """A log-prob as vLLM's server writes it: -inf as LOGPROB_FLOOR."""
    return max(logprob, LOGPROB_FLOOR)


def given(body: dict, key: str, default: float, kind: type = float) -> float:
    """A number the request gives, or the default for one it leaves out or sends as null (as vLLM's server);
    ValueError for one that is not a `kind` (an int: an integer, no bool, no float)."""
    value = body.get(key)
    if value is None:
        return default
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{key}={value!r} must be an integer")
    return kind(value)


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
        if isinstance(content, list):
            content = _parts(content, i)
        if content is not None and not isinstance(content, (str, list)):
            raise GatewayError(400, f"messages[{i}].content must be a string, a list of text and image_url parts, "
                                    "or null")
        out.append({**m, "content": content})
    return out


def _parts(content: list, i: int):
    """A message's content parts: text ones joined into one string; with images, the parts as the chat template
    reads them (text, and image_url with the image's data URL: a remote URL is refused, nothing is fetched)."""
    from megappo.utils.images import from_data_url

    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind == "text":
            parts.append({"type": "text", "text": p.get("text", "")})
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            try:
                from_data_url(url, f"messages[{i}].content[{j}]")
            except ValueError as e:
                raise GatewayError(400, str(e)) from None
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise GatewayError(400, f"messages[{i}] has a {kind!r} content part; this server takes text and image_url "
                                    "parts")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts



def tools(tools) -> Optional[list]:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and t["function"].get("name") for t in tools):
        raise GatewayError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}')
    return tools
