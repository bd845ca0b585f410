"""OpenAI's Responses API (`POST /v1/responses`: the OpenAI Agents SDK's default, and what NeMo Gym speaks) as a
chat request: the request's input items become chat messages, the chat reply becomes the response's output items.
The gateway samples and records it as a chat request (agent/capture.py: the same exact-token capture, a session's
requests extending its conversation). Pure functions; app.py routes them.

Input: a string, or items: messages ({role, content}: a string or input_text / output_text / input_image parts (an
image as a data URL, for a vision-language model); `developer` is
a system message), `function_call` items (an assistant turn's calls) and `function_call_output` items (a tool
message each); `instructions` is a system message first. Tools: function tools ({type: function, name, parameters,
description}). Output: a `message` item with one `output_text` part when the reply has text (its `logprobs`
with `include: ["message.output_text.logprobs"]`, `top_logprobs` alternatives each, as vLLM's server), a
`function_call` item per call. `reasoning.effort` reaches the chat template as vLLM's server passes it
(`reasoning_effort`, and `enable_thinking` unless chat_template_kwargs sets it). Not here (one 400 line each):
`previous_response_id` / `store: true` (nothing is stored: send the whole conversation, as the Agents SDK does by
default), built-in tools, streaming, non-text input parts, `truncation: auto` (a prompt is never cut),
`reasoning.summary` (no reasoning parser), any other `include`, `top_logprobs` without that `include` (vLLM's
server would return no log-probs). Follows vLLM's server where the spec and it differ.
"""

from __future__ import annotations

import secrets
import time
# what a Responses request may set that maps to a chat request, and its chat name (vLLM's ResponsesRequest fields)
_SAMPLING = {"max_output_tokens": "max_tokens", **{k: k for k in (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "parallel_tool_calls", "chat_template_kwargs", "model")}}
# accepted and without effect here (bookkeeping, as on vLLM's server)
_IGNORED = ("metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key")
LOGPROBS = "message.output_text.logprobs"  # the one `include` this server returns


class ResponsesError(ValueError):
    """A request this server cannot answer as asked: one line naming the fix (a 400)."""


def chat_request(body: dict) -> dict:
    """A Responses request as the chat request the gateway samples (ResponsesError for what it cannot do)."""
    if body.get("stream"):
        raise ResponsesError("stream=true is not supported on /v1/responses here; send stream=false")
    if body.get("previous_response_id") is not None or body.get("store"):
        raise ResponsesError("this server stores no responses (previous_response_id, store=true): send the whole "
                             "conversation as input, with store=false")
    fmt = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if fmt != "text":
        raise ResponsesError(f"text.format {fmt!r} is not supported here; use text")
    known = set(_SAMPLING) | set(_IGNORED) | {"input", "instructions", "tools", "tool_choice", "stream", "store",
                                              "previous_response_id", "text", "reasoning", "truncation", "include",
                                              "top_logprobs"}
    unknown = sorted(k for k in body if k not in known and body[k] is not None)
    if unknown:
        raise ResponsesError(f"{unknown[0]} is not supported on /v1/responses here; drop it")
    if body.get("truncation") not in (None, "disabled"):
        raise ResponsesError(f"truncation={body['truncation']!r} is not supported here (a prompt is never cut): send "
                             "truncation disabled, with an input that fits")
    messages = ([{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []) + \
        input_messages(body.get("input"))
    chat = {"messages": messages}
    chat.update({name: body[key] for key, name in _SAMPLING.items() if body.get(key) is not None})
    if wants_logprobs(body):
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    elif body.get("top_logprobs"):
        raise ResponsesError(f'top_logprobs needs include: ["{LOGPROBS}"] (without it no log-probs are returned)')
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:  # as vLLM's server: the template's reasoning_effort, and enable_thinking unless given
        given = dict(chat.get("chat_template_kwargs") or {})
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none", **given, "reasoning_effort": effort}
    if body.get("tools"):
        chat["tools"] = [_chat_tool(t) for t in body["tools"]]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    return chat


def wants_logprobs(body: dict) -> bool:
    """The request's `include` asks for the output text's log-probs (ResponsesError for any other include)."""
    include = body.get("include") or []
    if not isinstance(include, list):
        raise ResponsesError(f'include must be a list, e.g. ["{LOGPROBS}"]')
    other = [x for x in include if x != LOGPROBS]
    if other:
        raise ResponsesError(f"include {other[0]!r} is not returned by this server (it returns {LOGPROBS} only); "
                             "drop it")
    return LOGPROBS in include


def _reasoning_effort(reasoning):
    """reasoning.effort (None when not given); ResponsesError for another reasoning setting."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise ResponsesError('reasoning must be an object such as {"effort": "low"}')
    other = sorted(k for k, v in reasoning.items() if k != "effort" and v is not None)
    if other:
        raise ResponsesError(f"reasoning.{other[0]} is not supported here (no reasoning parser: the reply is "
                             "returned as text); send reasoning.effort alone")
    return reasoning.get("effort")


def input_messages(items) -> list[dict]:
    """The input as chat messages (function_call items join the assistant message before them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesError("input must be a string or a non-empty list of items (messages, function_call, "
                             "function_call_output)")
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ResponsesError(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_call_id"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, i)})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: not part of what this model is shown again
        else:
            raise ResponsesError(f"input[{i}] is a {kind!r} item; this server takes messages, function_call and "
                                 "function_call_output items")
    return out


def _text(content, i: int):
    """A message's content as chat content: its text parts joined, or with input_image parts (an image_url:
    a data URL) the chat request's text and image_url parts (checked there: requests.messages)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content if isinstance(content, list) else [content]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise ResponsesError(f"input[{i}] has a {kind!r} content part; this server takes input_text and "
                                 "input_image parts")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _chat_tool(tool: dict) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
        raise ResponsesError("tools must be function tools ({type: function, name, parameters}); built-in tools "
                             "(web search, file search, ...) are not served here")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def _chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesError("tool_choice must be auto, none, required or {type: function, name}")


def response(body: dict, chat: dict, model: str) -> dict:
    """The Responses object of a chat completion `chat` answered for request `body`."""
    choice = chat["choices"][0]
    message = choice["message"]
    logprobs = choice["logprobs"]["content"] if wants_logprobs(body) else None
    output = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed",
                       "role": "assistant", "content": [{"type": "output_text", "text": message["content"],
                                                         "annotations": [], "logprobs": logprobs}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    usage = chat["usage"]
    return {
        "id": f"resp_{secrets.token_hex(12)}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "model": model, "output": output, "instructions": body.get("instructions"),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None, "reasoning": body.get("reasoning"), "store": False,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "top_logprobs": body.get("top_logprobs") or 0,
        "metadata": body.get("metadata") or {}, "user": body.get("user"),
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        # vLLM's extra fields, as on the chat answers: what was sampled, exactly
        "prompt_token_ids": chat["prompt_token_ids"], "token_ids": choice["token_ids"],
    }

