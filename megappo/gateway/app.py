"""The rollout gateway: the OpenAI API over an AsyncTokenEngine, with exact token capture per session.

    gw = Gateway(engine, tokenizer, model_name="policy", max_model_len=2048, max_tokens=512)
    s = gw.open_session(row)                     # in process; or POST /megappo/v1/sessions (admin key)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=s.key)   # bound to that session
    ...                                          # the agent calls the model as often as it likes
    record = gw.close_session(s.id)              # segments: the ids as sampled, masks, log-probs, versions

OpenAI endpoints (a session's key in `Authorization: Bearer`), answering what vLLM's OpenAI server answers for
the fields clients send: `POST /v1/chat/completions` (messages, `tools` shown through the chat template, tool calls
read into `tool_calls` in the model's format: Hermes `<tool_call>` blocks, or `tool_parser`, one of vLLM's parsers
by name (tool_calls.py); finish_reason `tool_calls` / `stop` / `length`; `logprobs` with `top_logprobs`;
`chat_template_kwargs` rendered as vLLM's server renders them; a vision-language model's `image_url` parts as data
URLs, expanded as its processor does and sent to vLLM as multi_modal_data: agent/capture.ChatRenderer),
`POST /v1/completions` (a string or token ids, or a batch of them; `logprobs` k, `echo`, `max_tokens: 0` with echo
for the prompt's log-probs alone), `POST /v1/responses` (responses.py: mapped to a chat request), `GET /v1/models`.
`n` samples (outside a session), a fresh seed for an unseeded request, a null as the default, a missing
max_tokens as the rest of the context; the penalties, `logit_bias`, `top_k`, `min_p`, `min_tokens` apply outside
a training session and are refused in one (its sampling is the rollout's); any model name is served; a -inf
log-prob (a token top_k / top_p cut) is written as vLLM's -9999.0; the tokens, text and text offsets as vLLM's
server writes them (tests/test_vllm_server_parity.py runs both). Every answer carries
vLLM's extra fields `prompt_token_ids`, `choices[i].token_ids` and `choices[i].stop_reason`. megappo's endpoints for RL (the admin key): `POST /megappo/v1/sessions` (open
one for a row: its id and key), `POST /megappo/v1/sessions/{id}/reward` (the session's own key, or
admin), `GET /megappo/v1/sessions/{id}`, `POST /megappo/v1/sessions/{id}/close`, `GET /megappo/v1/stats`.

A key reaches its own session only (401 for an unknown key, 403 for another session's); `open_key`
(for `megappo serve`) is a key whose requests are served and not recorded. Every bad input is a 4xx
whose body is OpenAI's error object with one line: malformed JSON, an unknown API key, `n` > 1 in a session,
a key the route does not read (requests.py's FIELDS; vLLM's server would ignore it), a field this server does not
do (UNSUPPORTED: response_format other than text, the legacy functions API, ...; a vLLM extension not in FIELDS),
max_tokens < 1 or past the server's budget, a prompt past max_model_len, a request the engine refuses
(token ids out of the vocabulary), a reward that is not a finite number, an unknown route or method; an
unexpected failure is a 500 with one line. Loopback by default (serve.py).

`stream=true` (chat and completions) answers with OpenAI's server-sent chunks once the reply is sampled,
not token by token: the role, the text in one delta, each tool call, the finish reason, the usage when
`stream_options.include_usage`, then `data: [DONE]`; `prompt_token_ids` rides on the first chunk and
`token_ids` on the text's, as vLLM streams them. What is captured for training is the same either way.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import math
import secrets
import statistics
import time
from typing import Optional

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from megappo.agent.capture import ChatRenderer, Session
from megappo.gateway import requests as rq
from megappo.gateway.requests import GatewayError  # noqa: F401 (re-exported)
from megappo.gateway.sessions import SessionState, Turn
from megappo.gateway.streaming import streamed
from megappo.gateway.tool_calls import ToolCallReader
from megappo.rewards.rules import as_reward as rules_as_reward

LATENCIES_KEPT = 10_000  # the gateway's latency stats: over its latest requests (a server runs for weeks)


def nearest_rank(ordered: list, q: float) -> float:
    """The q-quantile of sorted values by the nearest-rank rule: the smallest value with at least q of them at or
    below it (p95 of two latencies is the larger one; of 100, the 95th)."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def as_reward(value) -> float:
    """A reward an agent returns or one posted over HTTP: rewards.rules.as_reward, the one rule for any reward."""
    try:
        return rules_as_reward(value)
    except ValueError as e:
        raise ValueError(f"{e}: send one (or None from an agent, to leave the score to the row's rule)") from None


class Gateway:
    def __init__(self, engine, tokenizer, *, model_name: str, max_model_len: int, max_tokens: int,
                 tool_prompt: Optional[str] = None, tool_parser: Optional[str] = None, admin_key: Optional[str] = None,
                 open_key: Optional[str] = None, processor=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.renderer = ChatRenderer(tokenizer, tool_prompt, processor)  # processor: a VL model's (image_url parts)
        self.tool_calls = ToolCallReader(tokenizer, tool_parser)
        self.model_name, self.max_model_len, self.max_tokens = model_name, int(max_model_len), int(max_tokens)
        self.admin_key = admin_key or "mp-admin-" + secrets.token_urlsafe(24)
        self.open_key = open_key
        self.sessions: dict[str, SessionState] = {}
        self._by_key: dict[str, str] = {}
        self.latencies: collections.deque = collections.deque(maxlen=LATENCIES_KEPT)  # the latest requests'
        self.errors = 0

    # ---- sessions (in process, or over HTTP with the admin key) ----------------------------------------
    def open_session(self, row: Optional[dict] = None) -> SessionState:
        sid = secrets.token_hex(8)
        state = SessionState(sid, f"mp-{sid}-{secrets.token_urlsafe(24)}", Session(self.renderer), row)
        self.sessions[sid] = state
        self._by_key[state.key] = sid
        return state

    def close_session(self, sid: str) -> dict:
        """Its record (a copy). Its requests still in flight (an agent that timed out or was cancelled left them:
        the server does not stop a request whose client went away) are cancelled, which aborts them in the
        engine; each answers 409. Callable from any thread (AgentRunner closes from its own loop)."""
        state = self._state(sid)
        del self._by_key[state.key], self.sessions[sid]  # the key first: _caller (the server's thread) reads it first
        with state.lock:  # a request's prompt or answer goes in wholly before the copy, or not at all
            state.closed = True  # before its tasks are read: a request being started as it closes sees it (_generate)
            record = state.record()  # without the request in flight (aborted below), if any
        for task in list(state.tasks):
            if not task.get_loop().is_closed():
                task.get_loop().call_soon_threadsafe(task.cancel)
        return record

    def stats(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        return {"sessions_open": len(self.sessions), "requests": self.engine.requests, "engine_steps": self.engine.steps,
                "errors": self.errors, "latency_p50_s": statistics.median(lat), "latency_p95_s": nearest_rank(lat, 0.95),
                "policy_version": self.engine.version}

    def _state(self, sid: str) -> SessionState:
        if sid not in self.sessions:
            raise GatewayError(404, f"no open session {sid!r}", "not_found_error")
        return self.sessions[sid]

    def _caller(self, authorization: Optional[str]) -> Optional[SessionState]:
        """The session a key belongs to; None for the admin or the open key."""
        key = rq.bearer(authorization)
        if not key:
            raise GatewayError(401, "missing API key: send Authorization: Bearer <your session's key>",
                               "authentication_error")
        if self._is_admin(key) or (self.open_key and secrets.compare_digest(key, self.open_key)):
            return None
        sid = self._by_key.get(key)
        if sid is None:
            raise GatewayError(401, "unknown API key: open a session (POST /megappo/v1/sessions) and use its key",
                               "authentication_error")
        return self.sessions[sid]

    def _is_admin(self, key: str) -> bool:
        return secrets.compare_digest(key, self.admin_key)

    def _admin(self, authorization: Optional[str]) -> None:
        if self._caller(authorization) is not None or not self._is_admin(rq.bearer(authorization)):
            raise GatewayError(403, "this endpoint needs the gateway's admin key", "permission_error")

    def _own(self, authorization: Optional[str], sid: str) -> SessionState:
        caller = self._caller(authorization)
        state = self._state(sid)
        if caller is not None and caller.id != sid:
            raise GatewayError(403, "this key belongs to another session", "permission_error")
        if caller is None and not self._is_admin(rq.bearer(authorization)):
            raise GatewayError(403, "this endpoint needs the session's own key or the admin key", "permission_error")
        return state

    # ---- the OpenAI API --------------------------------------------------------------------------------
    async def chat(self, body: dict, authorization: Optional[str]) -> dict:
        state = self._caller(authorization)
        rq.refuse_unsupported(body, "/v1/chat/completions")
        messages, tools = rq.messages(body.get("messages")), rq.tools(body.get("tools"))
        shown = (tools, self._template_kwargs(body.get("chat_template_kwargs")))
        n, top = rq.n(body, state), rq.top_logprobs(body)
        outs = await asyncio.gather(*(self._chat_one(rq.nth(body, j), state, messages, shown, top)
                                      for j in range(n)))
        choices = [dict(choice, index=j) for j, (choice, _) in enumerate(outs)]
        return self._envelope("chat.completion", choices, [out for _, out in outs], n)

    async def _chat_one(self, body: dict, state: Optional[SessionState], messages: list, shown: tuple,
                        top: Optional[int]):
        session = state.session if state else Session(self.renderer)
        with Turn(state, session) as turn:
            try:
                with turn.lock:
                    # a tool or tool_choice refused before sampling; tool_choice "required" or a named tool: a constraint
                    parsing, constraint = self.tool_calls.prepare(body)
                    prompt = session.chat_prompt(messages, *shown)
                    images = list(session.segments[-1].images)
            except ValueError as e:  # or tools= for a template without a tools section and no tool_prompt
                raise GatewayError(400, rq.one_line(e)) from None
            out, latency = await self._generate(prompt, body, state, constraint, top_logprobs=top or 0, images=images)
            content, calls, unread = self.tool_calls.read(parsing, out.ids, out.finish_reason, out.stop_string)
            reply = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
                                        "function": {"name": name, "arguments": args}} for name, args in calls]
            # a constrained reply was not sampled from the policy: context, not trained (tool_calls.py)
            turn.record(latency, out.ids, None if constraint else out.logprobs, out.versions, reply,
                        model=constraint is None, finish_reason=out.finish_reason, invalid_calls=unread,
                        request_id=out.request_id)
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        choice = {"index": 0, "message": reply, "finish_reason": finish, "stop_reason": out.stop_reason,
                  "token_ids": out.ids,
                  "logprobs": self._chat_logprobs(out, top) if body.get("logprobs") else None}
        return choice, out

    def _template_kwargs(self, kwargs) -> dict:
        """chat_template_kwargs as vLLM's server renders with them: the variables this template reads (or
        apply_chat_template takes; others dropped), `chat_template` / `tokenize` refused."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict):
            raise GatewayError(400, 'chat_template_kwargs must be an object, e.g. {"enable_thinking": false}')
        from vllm.renderers.hf import resolve_chat_template_kwargs

        try:
            return resolve_chat_template_kwargs(self.tokenizer, self.tokenizer.chat_template, kwargs)
        except ValueError as e:
            raise GatewayError(400, f"chat_template_kwargs: {rq.one_line(e)}: drop them") from None

    async def responses(self, body: dict, authorization: Optional[str]) -> dict:
        """/v1/responses (gateway/responses.py): sampled and recorded as the chat request it maps to."""
        from megappo.gateway.responses import ResponsesError, chat_request, response

        try:
            chat = chat_request(body)
        except ResponsesError as e:
            raise GatewayError(400, str(e)) from None
        return response(body, await self.chat(chat, authorization), self.model_name)

    async def completion(self, body: dict, authorization: Optional[str]) -> dict:
        """/v1/completions as vLLM's server answers it: a prompt (a string or token ids) or a batch of them, `n`
        samples of each, `logprobs` k (each token's log-prob and its top k), `echo` (the prompt first, with its
        log-probs), `max_tokens: 0` with echo (the prompt's log-probs alone: what a log-likelihood harness asks)."""
        state = self._caller(authorization)
        rq.refuse_unsupported(body, "/v1/completions")
        prompts, n, echo = self._prompts(body.get("prompt")), rq.n(body, state), bool(body.get("echo"))
        k = body.get("logprobs")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= rq.MAX_LOGPROBS):
            raise GatewayError(400, f"logprobs={k!r} must be an integer in [0, {rq.MAX_LOGPROBS}] (alternatives per token)")
        only_prompt = rq.max_tokens(body, None) == 0
        if only_prompt and not echo:
            raise GatewayError(400, "max_tokens=0 samples nothing: with echo=true it returns the prompt's log-probs")
        if state is not None and (len(prompts) > 1 or only_prompt):
            raise GatewayError(400, "a session is one conversation: one prompt per request, sampled (no batch, no "
                                    "max_tokens=0)")
        jobs = [(ids, j) for ids in prompts for j in range(n)]
        outs = await asyncio.gather(*(self._complete_one(ids, rq.nth(body, j), state, echo, k, only_prompt)
                                      for ids, j in jobs))
        choices = [dict(choice, index=i) for i, (choice, _) in enumerate(outs)]
        return self._envelope("text_completion", choices, [out for _, out in outs], n)

    def _prompts(self, prompt) -> list[list[int]]:
        """A completions prompt as token id lists: a string, a list of ids, or a batch of either."""
        def one(p):
            if isinstance(p, str) and p:
                return self.tokenizer.encode(p)
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return list(p)
            return None

        batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
            else [prompt]
        if len({type(p) for p in batch}) > 1:  # as vLLM's server: a batch is all strings or all token-id lists
            raise GatewayError(400, "a batch of prompts mixes strings and token-id lists; send one kind per request")
        ids = [one(p) for p in batch]
        if any(i is None for i in ids):
            raise GatewayError(400, "prompt must be a non-empty string or a list of token ids, or a list of those")
        return ids

    async def _complete_one(self, ids: list[int], body: dict, state: Optional[SessionState], echo: bool,
                            k: Optional[int], only_prompt: bool):
        if only_prompt:  # vLLM samples at least one token: it is dropped (as vLLM's server drops it)
            body = {**body, "max_tokens": 1, "max_completion_tokens": None}
        session = state.session if state else Session(self.renderer)
        with Turn(state, session) as turn:
            try:
                with turn.lock:
                    full = session.completion_prompt(ids)
            except ValueError as e:  # a training session's segment cap
                raise GatewayError(400, rq.one_line(e)) from None
            out, latency = await self._generate(full, body, state, top_logprobs=k or 0,
                                                prompt_logprobs=(k or 0) if echo and k is not None else None)
            turn.record(latency, out.ids, out.logprobs, out.versions, finish_reason=out.finish_reason,
                        request_id=out.request_id)
        sampled = [] if only_prompt else out.ids
        text = "" if only_prompt else self._reply_text(out)
        # vLLM's server echoes no prompt text when the ids are asked for (return_token_ids)
        echoed = echo and not body.get("return_token_ids")
        choice = {"index": 0, "text": (self.tokenizer.decode(ids) if echoed else "") + text,
                  "finish_reason": "length" if only_prompt else out.finish_reason,
                  "stop_reason": None if only_prompt else out.stop_reason, "token_ids": sampled,
                  "prompt_token_ids": ids,
                  "logprobs": None if k is None else self._completion_logprobs(ids if echo else [], out, sampled)}
        return choice, out

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "megappo"}]}

    async def _generate(self, prompt: list[int], body: dict, state: Optional[SessionState],
                        constraint=None, top_logprobs: int = 0, prompt_logprobs: Optional[int] = None,
                        images: Optional[list] = None):
        """`images`: the data URLs of the images `prompt` holds (expanded: agent/capture.ChatRenderer), sent to vLLM
        as multi_modal_data beside the prompt with each pad run collapsed; vLLM's expansion must give `prompt`."""
        params = self._sampling(self._within_session(body, state), len(prompt), constraint, top_logprobs,
                                prompt_logprobs)
        from vllm.exceptions import VLLMClientError

        t0 = time.perf_counter()
        request = asyncio.ensure_future(self.engine.generate(prompt, params, self._multi_modal(prompt, images)))
        if state is not None:
            state.tasks.add(request)
            if state.closed:  # closed (from another thread) while this request was being built
                request.cancel()
        try:
            out = await request
        except VLLMClientError as e:  # refused by vLLM's input checks (e.g. ids out of the vocabulary); an engine-
            # wide failure (any other exception a step raises for every request in flight) stays a 500
            raise GatewayError(400, f"the engine refused this request: {rq.one_line(e)}") from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this request's own handler is cancelled (the server stops)
                raise
            raise GatewayError(409, "this request's session was closed while it was in flight: it was aborted",
                               "conflict_error", {"x-should-retry": "false"}) from None
        finally:
            if state is not None:
                state.tasks.discard(request)
        if images and list(out.prompt_ids) != list(prompt):  # the trainer scores `prompt`: what was sampled from
            raise GatewayError(400, f"the engine expanded this request's images to {len(out.prompt_ids)} prompt tokens, "
                                    f"the model's processor to {len(prompt)}: serve the model with its own processor "
                                    "config", "server_error")
        dt = time.perf_counter() - t0
        self.latencies.append(dt)
        return out, dt

    def _multi_modal(self, prompt: list[int], images: Optional[list]) -> Optional[dict]:
        """The vLLM prompt of a request with images: the ids with each pad run as one pad, and the decoded images."""
        if not images:
            return None
        from megappo.utils.images import decode, from_data_url
        from megappo.models.vision import collapsed

        pad = self.renderer.processor.image_token_id
        return {"prompt_token_ids": collapsed(prompt, pad),
                "multi_modal_data": {"image": [decode(from_data_url(u, "an image_url part")) for u in images]}}

    @staticmethod
    def _within_session(body: dict, state: Optional[SessionState]) -> dict:
        """A training session's forced sampling, and max_tokens capped to what its budget has left."""
        if state is None or (not state.forced and state.budget is None):
            return body
        if state.forced:  # the rollout's sampling (forced below) is what the trainer's log-probs assume
            changed = [k for k, default in rq.SESSION_FIXED.items() if body.get(k) not in (None, default)]
            if changed:
                raise GatewayError(400, f"{changed[0]}={body[changed[0]]!r} would change what a training session "
                                        "samples from (the rollout's sampling, which the trainer scores): drop it")
        body = dict(body)
        forced = dict(state.forced)
        stride = forced.pop("seed_stride", 0)
        if forced.get("seed") is not None:
            forced["seed"] += (state.session.requests - 1) * stride
        body.update({k: v for k, v in forced.items() if v is not None})
        if state.budget is not None:  # over the whole session: a rewritten history does not start it anew
            left = state.budget - state.session.tokens_used
            if left <= 0:
                raise GatewayError(400, f"this session's response budget ({state.budget} tokens, model and tool "
                                        "tokens together, over all its segments) is spent: end the episode")
            asked = rq.max_tokens(body, left)
            body["max_tokens"], body["max_completion_tokens"] = min(asked, left) if isinstance(asked, int) else asked, None
        return body

    def _sampling(self, body: dict, prompt_len: int, constraint=None, top_logprobs: int = 0,
                  prompt_logprobs: Optional[int] = None):
        """vLLM's SamplingParams for a request (as vLLM's OpenAI server reads it: a null is the default, a missing
        max_tokens the rest of the context); `constraint`: its StructuredOutputsParams (tool_calls.prepare);
        `top_logprobs`: alternatives per sampled token; `prompt_logprobs`: the prompt's log-probs (echo). A field
        this server does not do is refused in one line, never ignored."""
        from vllm import SamplingParams

        if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
            raise GatewayError(400, 'stream_options must be an object such as {"include_usage": true}')
        max_tokens = rq.max_tokens(body, None)
        room = self.max_model_len - prompt_len
        if max_tokens is None:  # vLLM's server: whatever the context has left (within this server's budget)
            if room < 1:
                raise GatewayError(400, f"the prompt ({prompt_len} tokens) fills max_model_len={self.max_model_len}: "
                                        "shorten the conversation")
            max_tokens = min(self.max_tokens, room)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise GatewayError(400, f"max_tokens={max_tokens!r} must be a positive integer (0 only with echo, on "
                                    "/v1/completions)")
        if max_tokens > self.max_tokens:
            raise GatewayError(400, f"max_tokens={max_tokens} is past this server's budget of {self.max_tokens}; "
                                    f"ask for at most {self.max_tokens}")
        if max_tokens > room:
            raise GatewayError(400, f"the prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceed "
                                    f"max_model_len={self.max_model_len}: shorten the conversation or max_tokens")
        stop, seed = body.get("stop"), body.get("seed")
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63):
            raise GatewayError(400, f"seed={seed!r} must be an integer in [0, 2**63) (vLLM keeps it as int64)")
        if seed is None:  # a fresh one per request: the engine's steps run with the trainer's RNG put back after
            seed = secrets.randbits(63)  # each (utils/checkpoint.preserved_rng), so an unseeded draw repeated itself
        bias = body.get("logit_bias")
        try:
            return SamplingParams(temperature=rq.given(body, "temperature", 1.0), top_p=rq.given(body, "top_p", 1.0),
                                  top_k=int(rq.given(body, "top_k", -1)), min_p=rq.given(body, "min_p", 0.0),
                                  presence_penalty=rq.given(body, "presence_penalty", 0.0),
                                  frequency_penalty=rq.given(body, "frequency_penalty", 0.0),
                                  repetition_penalty=rq.given(body, "repetition_penalty", 1.0),
                                  logit_bias={int(k): float(v) for k, v in bias.items()} if bias else None,
                                  max_tokens=max_tokens, min_tokens=rq.given(body, "min_tokens", 0, int),
                                  seed=seed, logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                                  stop=[stop] if isinstance(stop, str) else stop, include_stop_str_in_output=True,
                                  stop_token_ids=list(body.get("stop_token_ids") or []) or None,
                                  structured_outputs=constraint)
        except (TypeError, ValueError, AttributeError) as e:
            raise GatewayError(400, f"bad sampling parameters: {rq.one_line(e)}") from None

    def _texts(self, positions: list) -> list:
        """Per position of one run of log-probs (a prompt's, or the sampled tokens'), {token id: its text} for its
        token (the dict's first) and the alternatives, as vLLM's engine writes them for its server
        (vllm/v1/engine/logprobs.py: a byte-fallback piece completed from the up to 4 tokens before it, else "");
        None for a position without log-probs (a prompt's first token)."""
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
        from vllm.v1.engine.logprobs import LogprobsProcessor

        vllm = LogprobsProcessor(self.tokenizer, None, None, None, None, None)
        texts, before = [], []
        for d in positions:
            ids = list(d or ())
            texts.append(dict(zip(ids, vllm._verify_tokens(convert_ids_list_to_tokens(self.tokenizer, ids), ids,
                                                           before[-4:]))) if d is not None else None)
            before += ids[:1]
        return texts

    def _reply_text(self, out) -> str:
        """A completion's text as vLLM's server returns it: its detokenizer's (tokenizers' DecodeStream primed with
        the prompt, as vllm/v1/engine/detokenizer.py: the bytes of an unfinished UTF-8 character at the end are not
        written), without the stop token (EOS or a stop_token_ids one) and without the stop string."""
        ids = out.ids[:-1] if out.finish_reason == "stop" and not out.stop_string else out.ids
        from tokenizers.decoders import DecodeStream

        try:  # a fast tokenizer's backend
            stream = DecodeStream(ids=list(out.prompt_ids), skip_special_tokens=True)
            pieces = [stream.step(self.tokenizer._tokenizer, t) or "" for t in ids]
        except Exception:  # noqa: BLE001 - a slow tokenizer, or DecodeStream's invalid-prefix error (vLLM #17448)
            pieces = [self.tokenizer.decode(ids, skip_special_tokens=True)]  # HF's decode, whole
        text = "".join(pieces)
        if not out.stop_string:
            return text
        last = len(text) - len(pieces[-1]) if pieces else 0  # where the last token's text starts
        cut = text.find(out.stop_string, max(0, last - len(out.stop_string) + 1))
        return text[:cut] if cut >= 0 else text

    def _chat_logprobs(self, out, top: Optional[int]) -> dict:
        """OpenAI's chat logprobs: per sampled token its log-prob (vLLM's processed ones: at the sampling
        temperature and top-p, what the trainer scores) and its `top` alternatives; -inf as vLLM writes it."""
        def entry(text: str, lp: float) -> dict:
            return {"token": text, "logprob": rq.floored(lp), "bytes": list(text.encode())}

        content = []
        for t, lp, d, texts in zip(out.ids, out.logprobs, out.top, self._texts(out.top)):
            # as vLLM's server: the first `top` of vLLM's own order (the sampled token, then the rest by rank)
            alts = list(d.items())[:top or 0]
            content.append({**entry(texts[t], lp), "top_logprobs": [entry(texts[a], alp) for a, alp in alts]})
        return {"content": content}

    def _completion_logprobs(self, prompt: list[int], out, sampled: list[int]) -> dict:
        """OpenAI's (legacy) completions logprobs over the echoed prompt, then the sampled tokens: tokens,
        token_logprobs (the prompt's first: None), top_logprobs ({token: log-prob} of the top k and the token
        itself, as vLLM), text_offset (as vLLM's server: the running sum of the tokens' lengths); -inf as vLLM
        writes it."""
        tops = list(out.prompt_top[:len(prompt)]) + list(out.top[:len(sampled)])
        ids = list(prompt) + list(sampled)
        own = [None if d is None else d.get(t) for t, d in zip(ids, tops)]
        own[len(prompt):] = list(out.logprobs[:len(sampled)])
        texts = self._texts(tops[:len(prompt)]) + self._texts(tops[len(prompt):])
        tokens = [self.tokenizer.decode([t]) if m is None else m[t] for t, m in zip(ids, texts)]
        return {"tokens": tokens, "token_logprobs": [None if lp is None else rq.floored(lp) for lp in own],
                "top_logprobs": [None if d is None else {m[a]: rq.floored(lp) for a, lp in d.items()}
                                 for d, m in zip(tops, texts)],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]}

    def _envelope(self, kind: str, choices: list, outs: list, n: int = 1) -> dict:
        """The response around its choices (prompt-major, n samples each): usage counts each prompt once."""
        prompt = sum(len(o.prompt_ids) for o in outs[::n])
        completion = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"mp-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "prompt_token_ids": outs[0].prompt_ids,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def make_app(gateway: Gateway):
    """The FastAPI app: the routes above, every error as OpenAI's error object with one line."""
    app = FastAPI(title="megappo rollout gateway", docs_url=None, redoc_url=None)

    @app.exception_handler(GatewayError)
    async def _error(_, e: GatewayError):
        gateway.errors += 1
        return JSONResponse({"error": {"message": e.message, "type": e.kind, "code": e.status}}, status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _route(request: Request, e: StarletteHTTPException):  # an unknown route or method, as OpenAI's error
        return await _error(request, GatewayError(e.status_code, f"{e.detail}: {request.method} {request.url.path} (served: "
                                                  "/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, "
                                                  "/megappo/v1/...)",
                                                  "not_found_error" if e.status_code == 404 else "invalid_request_error",
                                                  getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug of ours: still one line, as OpenAI's error
        return await _error(request, GatewayError(500, f"internal error: {type(e).__name__}: {rq.one_line(e)}",
                                                  "server_error"))

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as e:  # not JSON, not UTF-8, or an integer past Python's digit limit
            raise GatewayError(400, f"the request body is not valid JSON ({rq.one_line(e)})") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        return body

    @app.post("/v1/chat/completions")
    async def chat(request: Request, authorization: Optional[str] = Header(None)):
        body = await body_of(request)
        out = await gateway.chat(body, authorization)
        return streamed(out, body) if body.get("stream") else out

    @app.post("/v1/responses")
    async def responses(request: Request, authorization: Optional[str] = Header(None)):
        return await gateway.responses(await body_of(request), authorization)

    @app.post("/v1/completions")
    async def completions(request: Request, authorization: Optional[str] = Header(None)):
        body = await body_of(request)
        out = await gateway.completion(body, authorization)
        return streamed(out, body) if body.get("stream") else out

    @app.get("/v1/models")
    async def models(authorization: Optional[str] = Header(None)):
        gateway._caller(authorization)
        return gateway.models()

    @app.post("/megappo/v1/sessions")
    async def open_session(request: Request, authorization: Optional[str] = Header(None)):
        gateway._admin(authorization)
        body = await body_of(request)
        state = gateway.open_session(body.get("row"))
        return {"session_id": state.id, "api_key": state.key}

    @app.post("/megappo/v1/sessions/{sid}/reward")
    async def reward(sid: str, request: Request, authorization: Optional[str] = Header(None)):
        state = gateway._own(authorization, sid)
        try:
            state.reward = as_reward((await body_of(request)).get("reward"))
        except ValueError as e:
            raise GatewayError(400, f'{e}; as {{"reward": <a number>}}') from None
        return {"session_id": sid, "reward": state.reward}

    @app.get("/megappo/v1/sessions/{sid}")
    async def get_session(sid: str, authorization: Optional[str] = Header(None)):
        return gateway._own(authorization, sid).record()

    @app.post("/megappo/v1/sessions/{sid}/close")
    async def close(sid: str, authorization: Optional[str] = Header(None)):
        gateway._admin(authorization)
        return gateway.close_session(sid)

    @app.get("/megappo/v1/stats")
    async def stats(authorization: Optional[str] = Header(None)):
        gateway._admin(authorization)
        return gateway.stats()

    return app
