"""Token in, token out: what a session records, so the trainer trains on exactly the ids the engine sampled
and never on a re-tokenisation of the agent's text. The one token record of every multi-turn sample: the
rollout gateway's sessions (your own agent, gateway/app.py) and the built-in loop (agent/loop.py) alike.

    renderer = ChatRenderer(tokenizer)
    session = Session(renderer)
    ids = session.chat_prompt(messages, tools)        # what the engine is asked to continue (+ template kwargs)
    session.record(sampled_ids, logprobs, version, reply)   # reply: the assistant message returned
    session.observe(tool_ids)                         # the built-in loop: a tool result's tokens, as rendered

A request **extends** the session's conversation when its messages start with the previous request's
messages followed by the assistant message the gateway returned (compared by role, content and the
tool calls' names and parsed arguments: a client that re-serialises the JSON still extends) and its
tools are the same. Then its prompt is the previous prompt + the sampled ids (as sampled) + the
template's tokens for the new messages (`ChatRenderer.delta_ids`: end of the assistant turn unless the
model's own last token closed it, the tool / user messages, the next assistant header): the model's
tokens are never re-tokenised. Any other request (the agent rewrote history, a template that is not
append-only such as Qwen3 dropping old thinking, other tools or other chat_template_kwargs) starts a new
**segment**, rendered whole
and trained as its own sequence; `Session.fallbacks` counts them. Completions requests extend when their
prompt ids start with the segment's ids so far (a token-level test).

A Segment is one trained sequence: its first prompt, then model tokens (model_mask 1, their sampled
log-probs, the policy version that sampled each) and observation tokens between them (mask 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from megappo.agent.format import between_turns, with_tools
from megappo.utils.images import expand_pads, from_data_url, image_urls


@dataclass
class Segment:
    prompt_ids: list
    tokens: list = field(default_factory=list)  # after the prompt: model turns and observations
    model_mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)  # per token: the policy version that sampled it (-1: not sampled)
    turns: int = 0
    finish_reasons: list = field(default_factory=list)  # per model turn: the engine's ("stop", "length", "abort")
    images: list = field(default_factory=list)  # the data URLs of the images its ids hold, in order (a VL model)
    request_ids: list = field(default_factory=list)  # per recorded model turn: the engine request that sampled it

    @property
    def ids(self) -> list:
        return self.prompt_ids + self.tokens

    def add(self, ids, logprobs=None, version=-1, model: bool = False) -> None:
        """`version`: one for every id, or one per id (a request in flight across a weight load); -1 for tokens
        no engine sampled. `model`: trained (model_mask 1); a sampled turn kept as untrained context (the
        built-in loop's forced first call) is model=False with its version."""
        self.tokens += list(ids)
        self.model_mask += [int(model)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += [version] * len(ids) if isinstance(version, int) else list(version)
        self.turns += int(model or version != -1)  # the engine's turns, trained or kept as context

    def mark(self) -> tuple:
        """Where it ends now (it only grows): what `truncate` goes back to."""
        return len(self.tokens), len(self.finish_reasons), self.turns, len(self.images)

    def truncate(self, mark: tuple) -> None:
        n, finished, self.turns, images = mark
        for tokens in (self.tokens, self.model_mask, self.logprobs, self.versions):
            del tokens[n:]
        del self.finish_reasons[finished:], self.request_ids[finished:], self.images[images:]

    def to_dict(self, mark: Optional[tuple] = None) -> dict:
        """A copy (as it was at `mark`, when given)."""
        n, finished, turns, images = mark or self.mark()
        return {"prompt_ids": list(self.prompt_ids), "tokens": self.tokens[:n], "model_mask": self.model_mask[:n],
                "logprobs": self.logprobs[:n], "versions": self.versions[:n], "turns": turns,
                "finish_reasons": self.finish_reasons[:finished], "images": self.images[:images],
                "request_ids": self.request_ids[:finished]}


class ChatRenderer:
    """Chat messages -> prompt ids with the model's own chat template (tools shown as agent/format.py does). With
    a vision-language model's HF `processor`, image_url parts (data URLs) are rendered as the template places them
    and each expanded into the run of pads its processor gives it (data/images.expand_pads): the ids vLLM expands
    them to, and the trainer scores."""

    def __init__(self, tokenizer, tool_prompt: Optional[str] = None, processor=None):
        self.tokenizer = tokenizer
        self.tool_prompt = tool_prompt
        self.processor = processor
        self.special_ids = set(tokenizer.all_special_ids)

    def prompt_ids(self, messages: list[dict], tools: Optional[list] = None,
                   template_kwargs: Optional[dict] = None) -> list[int]:
        """`template_kwargs`: variables for the template (a request's chat_template_kwargs, e.g. enable_thinking);
        what the renderer sets itself (the generation prompt, the tools) wins, as in vLLM's server."""
        self._takes_images(messages)
        msgs, kwargs = with_tools(messages, self.tokenizer, tools, self.tool_prompt) if tools else (messages, {})
        text = self.tokenizer.apply_chat_template(_plain(msgs), **{**(template_kwargs or {}), **kwargs,
                                                                   "add_generation_prompt": True, "tokenize": False})
        return self._expanded(self.tokenizer.encode(text, add_special_tokens=False), messages)

    def delta_ids(self, new_messages: list[dict], last_sampled: Optional[int],
                  template_kwargs: Optional[dict] = None) -> list[int]:
        """The template's tokens between the model's turn and its next one, given the messages that came
        after it; the model's own closing token (EOS / end-of-turn, last_sampled) is not repeated."""
        self._takes_images(new_messages)
        closing = self.tokenizer.decode([last_sampled]) if last_sampled in self.special_ids else None
        tail = between_turns(self.tokenizer, _plain(new_messages), closing, template_kwargs)
        return self._expanded(self.tokenizer.encode(tail, add_special_tokens=False), new_messages)

    def _takes_images(self, messages: list[dict]) -> None:
        if self.processor is None and image_urls(messages):
            raise ValueError("this model takes text only: send no image_url parts (serve a vision-language model, "
                             "Qwen2.5-VL, for images)")

    def _expanded(self, ids: list[int], messages: list[dict]) -> list[int]:
        urls = image_urls(messages)
        if not urls:
            return ids
        return expand_pads(ids, [from_data_url(u, "an image_url part") for u in urls], self.processor, "the request")


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as a template that knows nothing of OpenAI's tool_calls renders them: an assistant turn's
    calls become the Hermes text the model writes (used only when a history is rendered anew)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.pop("tool_calls", None) or []
        for c in calls:
            f = c.get("function", {})
            args = _arguments(f, missing={})
            text = f'<tool_call>\n{json.dumps({"name": f.get("name"), "arguments": args})}\n</tool_call>'
            m["content"] = m["content"] + ([{"type": "text", "text": text}] if isinstance(m["content"], list) else text)
        out.append(m)
    return out


def _arguments(function: dict, missing=None):
    """A tool call's arguments, parsed when the client sent them as a JSON string (as OpenAI does)."""
    args = function.get("arguments", missing)
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def _key(message: dict) -> tuple:
    """What makes two messages the same turn: role, text, and the calls' names with parsed arguments."""
    calls = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", {})
        calls.append((f.get("name"), json.dumps(_arguments(f), sort_keys=True)))
    return message.get("role"), message.get("content") or "", tuple(calls)


class Session:
    """One agent episode's token record (see the module docstring)."""

    def __init__(self, renderer: ChatRenderer, max_segments: Optional[int] = None):
        self.renderer = renderer
        self.max_segments = max_segments  # a training session's cap: each segment is a trained row of the sample
        self.segments: list[Segment] = []
        self.fallbacks = 0  # requests that did not extend the conversation: a new segment each
        self.requests = 0
        self.tool_calls = 0  # the calls the replies handed out (chat requests), and the call blocks no reader could read
        self.invalid_calls = 0
        self._history: Optional[list] = None  # the last request's messages + the reply returned
        self._shown = None  # its tools and template kwargs

    def chat_prompt(self, messages: list[dict], tools: Optional[list] = None,
                    template_kwargs: Optional[dict] = None) -> list[int]:
        """The ids the engine continues for this chat request (extending the live segment when it can)."""
        self.requests += 1
        h, shown = self._history, (tools, template_kwargs or {})
        if h is not None and shown == self._shown and len(messages) > len(h) \
                and [_key(m) for m in messages[:len(h)]] == [_key(m) for m in h]:
            seg = self.segments[-1]
            seg.add(self.renderer.delta_ids(messages[len(h):], seg.ids[-1] if seg.tokens else None, template_kwargs))
            seg.images += image_urls(messages[len(h):])
        else:
            self._new_segment(self.renderer.prompt_ids(messages, tools, template_kwargs))
            self.segments[-1].images = image_urls(messages)
        self._history, self._shown = list(messages), shown
        return self.segments[-1].ids

    def completion_prompt(self, prompt_ids: list[int]) -> list[int]:
        """Completions API: the prompt extends the live segment when it starts with all of its ids."""
        self.requests += 1
        seg = self.segments[-1] if self.segments else None
        if seg is not None and len(prompt_ids) >= len(seg.ids) and prompt_ids[:len(seg.ids)] == seg.ids:
            seg.add(prompt_ids[len(seg.ids):])
        else:
            self._new_segment(list(prompt_ids))
        self._history = None  # a chat request after a raw completion starts a new segment
        return self.segments[-1].ids

    def record(self, ids: list[int], logprobs, version, reply: Optional[dict] = None, model: bool = True,
               finish_reason: Optional[str] = None, invalid_calls: int = 0, request_id: Optional[str] = None) -> None:
        """The engine's answer to the last prompt: ids and log-probs as sampled, the version(s) that sampled
        them (Segment.add), why it ended; reply: the assistant message returned to the client (what its next
        request must repeat to extend); invalid_calls: call blocks in it that could not be read; request_id: the
        engine's (its routes, actor.router_replay=r3)."""
        self.segments[-1].add(ids, logprobs, version, model=model)
        self.segments[-1].finish_reasons.append(finish_reason)
        self.segments[-1].request_ids.append(request_id)
        self.tool_calls += len((reply or {}).get("tool_calls") or [])
        self.invalid_calls += invalid_calls
        if reply is not None and self._history is not None:
            self._history.append(reply)

    def observe(self, ids: list[int]) -> None:
        """Tokens that follow the model's turn in the live segment and that no engine sampled (a tool result
        rendered by the chat template: agent/format.Observations), untrained."""
        self.segments[-1].add(ids)

    def snapshot(self) -> tuple:
        """What restore() needs to undo a request that was refused or failed after its prompt was built: where the
        record ends now. A request only adds (it extends the last segment or appends one; the history it replaces
        is a new list), so lengths and references are enough: O(1) per request, not a copy of a session that grows
        with each one."""
        last = self.segments[-1].mark() if self.segments else None
        return (len(self.segments), last, self.fallbacks, self.requests, self.tool_calls, self.invalid_calls,
                self._history, self._shown)

    def restore(self, snap: tuple) -> None:
        n, last, self.fallbacks, self.requests, self.tool_calls, self.invalid_calls, self._history, self._shown = snap
        del self.segments[n:]
        if last is not None:
            self.segments[-1].truncate(last)

    def as_of(self, snap: Optional[tuple] = None) -> dict:
        """A copy of the record (as it was at `snap`, a `snapshot()`, when given): counts and segments."""
        n, last = (snap[0], snap[1]) if snap is not None else (len(self.segments), None)
        fallbacks, requests, tool_calls, invalid_calls = snap[2:6] if snap is not None else \
            (self.fallbacks, self.requests, self.tool_calls, self.invalid_calls)
        segments = [seg.to_dict(last if i == n - 1 else None) for i, seg in enumerate(self.segments[:n])]
        return {"requests": requests, "fallbacks": fallbacks, "tool_calls": tool_calls, "invalid_calls": invalid_calls,
                "segments": segments}

    @property
    def tokens_used(self) -> int:
        """Tokens after each segment's prompt, over the whole session (a response budget counts these)."""
        return sum(len(seg.tokens) for seg in self.segments)

    def _new_segment(self, prompt_ids: list[int]) -> None:
        if self.max_segments is not None and len(self.segments) >= self.max_segments:
            raise ValueError(f"this session has started {len(self.segments)} segments (rewritten histories, each a "
                             f"trained row of the sample: rollout.agent_max_segments={self.max_segments}); end the "
                             "episode, or keep the history append-only (a template that re-renders past turns, "
                             "as Qwen3's drops old thinking, starts one per request)")
        if self.segments:
            self.fallbacks += 1
        self.segments.append(Segment(list(prompt_ids)))
