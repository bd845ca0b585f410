"""stream=true: a finished chat.completion or text_completion as OpenAI's server-sent chunks (the role, the text in
one delta, each tool call, the finish reason, the usage when asked, then [DONE]; vLLM's prompt_token_ids on the first
chunk and token_ids on the text's)."""

from __future__ import annotations

import json

from fastapi.responses import StreamingResponse


def stream_chunks(response: dict, include_usage: bool = False) -> list[dict]:
    """A finished chat.completion or text_completion as OpenAI's stream chunks (in order)."""
    chat = response["object"] == "chat.completion"
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for choice in response["choices"]:  # one choice after another (n > 1, or a batch of prompts)
        def chunk(part: dict, finish=None, **extra) -> dict:
            body = {"delta": part} if chat else {"text": part.get("content", "")}
            return {**head, **extra,
                    "choices": [{"index": choice["index"], **body, "logprobs": None, "finish_reason": finish}]}

        text = choice["message"]["content"] if chat else choice["text"]
        out.append(chunk({"role": "assistant", "content": ""} if chat else {},
                         prompt_token_ids=choice.get("prompt_token_ids", response["prompt_token_ids"])))
        out.append(chunk({"content": text or ""}))
        out[-1]["choices"][0]["token_ids"] = choice["token_ids"]
        if choice["logprobs"] is not None:
            out[-1]["choices"][0]["logprobs"] = choice["logprobs"]
        for i, call in enumerate(choice["message"].get("tool_calls", []) if chat else []):
            out.append(chunk({"tool_calls": [{"index": i, **call}]}))
        out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": response["usage"]})
    return out


def streamed(response: dict, body: dict) -> StreamingResponse:
    chunks = stream_chunks(response, bool((body.get("stream_options") or {}).get("include_usage")))
    events = [f"data: {json.dumps(c, allow_nan=False)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(events), media_type="text/event-stream")
