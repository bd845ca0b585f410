"""Token capture without an engine (megappo/agent/capture.py, gateway/app.py's reply): the drift corpus on the
tiny tokenizer with scripted sampled ids (tool-call JSON re-serialised by the client, a sample that is not the
tokenizer's own encoding of its text, a turn cut at max_tokens ending in whitespace that the template trims, a
stop string the reply drops, a rewritten history): naive re-tokenisation of the conversation differs from what
was sampled, the capture keeps the sampled ids, and a rewritten history starts a counted new segment. Also
the reply the gateway builds from the sampled text (tool calls, stream chunks). The same against a real vLLM
engine and the openai SDK: tests/test_gateway.py."""

import json

import pytest

from gateway_helpers import TEMPLATE


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets["tiny-llama"]))
    tok.chat_template = TEMPLATE
    return tok


def naive_ids(tokenizer, messages) -> list[int]:
    """What a trainer that re-tokenises the agent's conversation would train on."""
    from megappo.agent.capture import _plain

    text = tokenizer.apply_chat_template(_plain(messages), tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def run_turn(session, tokenizer, messages, sampled: list[int], reply: dict) -> list[int]:
    """One request of an agent: the prompt the gateway builds, then the sampled ids recorded."""
    prompt = session.chat_prompt(messages)
    session.record(sampled, [-0.5] * len(sampled), version=0, reply=reply)
    return prompt


def test_capture_keeps_the_sampled_ids_where_naive_retokenisation_drifts(tokenizer):
    from megappo.agent.capture import ChatRenderer, Session

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    word = next(w for w in ("question", "answer", "compute", "number", "people") if len(enc(w)) < len(w))
    cases = {
        # the model wrote compact JSON; the client's echo is re-serialised by json.dumps in any re-render
        "tool-call JSON": (enc('<tool_call>{"name":"calculator","arguments":{"expression":"2+2"}}</tool_call>')
                           + [im_end], {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                               "name": "calculator", "arguments": '{"expression": "2+2"}'}}]}),
        # sampled letter by letter: not the tokenizer's own encoding of the same text
        "non-canonical BPE": ([t for c in word for t in enc(c)] + [im_end], {"content": word}),
        # cut at max_tokens after a space: the template trims it away on re-render
        "max_tokens cut": (enc("the result is "), {"content": "the result is "}),
        # ended by a stop string that OpenAI's reply leaves out of the content
        "stop string": (enc("Action: add\nObservation:"), {"content": "Action: add"}),
    }
    for name, (sampled, reply) in cases.items():
        session = Session(ChatRenderer(tokenizer))
        msgs = [{"role": "user", "content": "what is 2+2?"}]
        first = run_turn(session, tokenizer, msgs, sampled, {"role": "assistant", **reply})
        msgs2 = msgs + [{"role": "assistant", **reply}, {"role": "tool" if "tool_calls" in reply else "user",
                                                          "content": "4"}]
        second_sampled = enc("four") + [im_end]
        second = run_turn(session, tokenizer, msgs2, second_sampled, {"role": "assistant", "content": "four"})
        seg, = session.segments
        assert session.fallbacks == 0 and seg.prompt_ids == first, name
        assert second[:len(first) + len(sampled)] == first + sampled, name  # the model's tokens, not re-tokenised
        model = [t for t, m in zip(seg.tokens, seg.model_mask) if m]
        assert model == sampled + second_sampled and seg.ids == second + second_sampled, name
        naive = naive_ids(tokenizer, msgs2 + [{"role": "assistant", "content": "four"}])
        assert naive[:len(first) + len(sampled)] != first + sampled, (name, "naive re-tokenisation should drift here")


def test_a_rewritten_history_starts_a_new_segment(tokenizer):
    from megappo.agent.capture import ChatRenderer, Session

    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    session = Session(ChatRenderer(tokenizer))
    msgs = [{"role": "user", "content": "say one"}]
    run_turn(session, tokenizer, msgs, enc("one"), {"role": "assistant", "content": "one"})
    edited = [{"role": "user", "content": "say one"}, {"role": "assistant", "content": "ONE (edited)"},
              {"role": "user", "content": "and two"}]
    run_turn(session, tokenizer, edited, enc("two"), {"role": "assistant", "content": "two"})
    assert session.fallbacks == 1 and len(session.segments) == 2
    assert session.segments[1].prompt_ids == naive_ids(tokenizer, edited) + enc("<|im_start|>assistant\n")
    for seg, want in zip(session.segments, ("one", "two")):
        assert [t for t, m in zip(seg.tokens, seg.model_mask) if m] == enc(want)


# ---- the reply built from the sampled text -------------------------------------------------------------

def test_stream_chunks_rebuild_the_reply_as_the_sdk_reads_them():
    """stream_chunks is what stream=true sends: each chunk is a valid ChatCompletionChunk / Completion for the
    openai SDK's own models, and joining the deltas gives back the reply, its tool calls and finish reason."""
    from openai.types.chat import ChatCompletionChunk

    from megappo.gateway.streaming import stream_chunks

    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "calculator",
                                                                  "arguments": json.dumps({"expression": e})}}
             for i, e in enumerate(("2+3", "4*5"))]
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    chat = {"id": "mp-1", "object": "chat.completion", "created": 1, "model": "tiny", "prompt_token_ids": [1, 2, 3, 4, 5],
            "usage": usage, "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [7, 8, 9],
                                         "logprobs": None, "message": {"role": "assistant", "content": "Let me add.",
                                                                       "tool_calls": calls}}]}
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream_chunks(chat, include_usage=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == "Let me add."
    got = [t.model_dump(exclude_none=True) for d in deltas for t in d.tool_calls or []]
    assert [{k: v for k, v in t.items() if k != "index"} for t in got] == calls and [t["index"] for t in got] == [0, 1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.total_tokens == 8 and chunks[0].model_extra["prompt_token_ids"] == [1, 2, 3, 4, 5]
    assert sum((c.choices[0].model_extra.get("token_ids", []) for c in chunks if c.choices), []) == [7, 8, 9]
    text = {**chat, "object": "text_completion",
            "choices": [{"index": 0, "text": " five", "finish_reason": "stop", "token_ids": [7], "logprobs": None}]}
    parts = stream_chunks(text)  # (the SDK's Completion model rejects the null finish_reason every stream sends)
    assert "".join(p["choices"][0]["text"] for p in parts) == " five" and parts[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(p["object"] == "text_completion" for p in parts)


def test_chat_replies_parse_the_models_tool_calls(tokenizer):
    """Gateway.chat's reply as OpenAI's: Hermes <tool_call> blocks become `tool_calls` (arguments a JSON string),
    the content loses them, finish_reason is "tool_calls"; a plain answer loses the stop string that ended it.
    The engine here is a script that returns fixed text (this tests the gateway's reply, not vLLM); the
    capture still records exactly the scripted ids, and the next request, repeating the reply with its
    tool_calls re-serialised, extends the session. The sample's tool statistics (rollout/tool_call_rate,
    tool_call_valid_rate, tokens_tool) are counted: the calls handed out, an unreadable block, the tool result's
    tokens."""
    import asyncio

    from megappo.gateway.agents import _trajectory
    from megappo.gateway.app import Gateway, GatewayError
    from megappo.workers.rollout.async_engine import Completion

    turns = ['Let me add.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
             "It is 5.\n\n"]
    stops = ["</tool_call>", "\n\n"]

    class Scripted:
        version = requests = steps = 0

        async def generate(self, prompt, params, multi_modal=None):
            text, stop = turns.pop(0), stops.pop(0)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return Completion(list(prompt), ids, [-0.5] * len(ids), "stop", 0, stop_string=stop)

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "2 + 3?"}]
    plain = Gateway(Scripted(), tokenizer, model_name="tiny", max_model_len=256, max_tokens=64)
    with pytest.raises(GatewayError, match="no tools section"):  # a 400 naming the fix, not a 500
        asyncio.run(plain.chat({"messages": msgs, "tools": tools}, f"Bearer {plain.open_session().key}"))
    gw = Gateway(Scripted(), tokenizer, model_name="tiny", max_model_len=256, max_tokens=64, tool_prompt="Tools: {tools}")
    s = gw.open_session()
    auth = f"Bearer {s.key}"
    first = asyncio.run(gw.chat({"messages": msgs, "tools": tools}, auth))
    choice = first["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {"expression": "2 + 3"}
    sent_back = dict(choice["message"], tool_calls=[{**call, "function": {**call["function"], "arguments":
                                                                          '{"expression":"2 + 3"}'}}])  # re-serialised
    msgs += [sent_back, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    second_reply = asyncio.run(gw.chat({"messages": msgs, "tools": tools}, auth))
    second, second_prompt = second_reply["choices"][0], second_reply["prompt_token_ids"]
    assert second["finish_reason"] == "stop" and second["message"]["content"] == "It is 5."  # no stop string
    assert "tool_calls" not in second["message"]
    record = gw.close_session(s.id)
    assert record["fallbacks"] == 0 and len(record["segments"]) == 1  # the re-serialised call still extends
    seg = record["segments"][0]
    assert [t for t, m in zip(seg["tokens"], seg["model_mask"]) if m] == choice["token_ids"] + second["token_ids"]
    assert seg["finish_reasons"] == ["stop", "stop"]
    # the sample's tool statistics (rollout/tool_call_rate, tokens_tool, as the built-in loop names them): one
    # call handed out, and the tokens between the two model turns that no engine sampled (the tool result)
    t = _trajectory(record, seg["prompt_ids"], None, None, False, 0.0, tokenizer)
    between = len(second_prompt) - len(first["prompt_token_ids"]) - len(choice["token_ids"])
    assert between > 0 and t.stats["tool_tokens"] == between
    assert t.stats["num_tool_calls"] == 1 and t.stats["num_invalid_calls"] == 0
    # a call block no reader can read (its JSON cut off) is no tool call for the agent, but the model wrote one
    turns.append('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 +\n</tool_call>')
    stops.append("</tool_call>")
    s = gw.open_session()
    bad = asyncio.run(gw.chat({"messages": msgs[:1], "tools": tools}, f"Bearer {s.key}"))["choices"][0]
    assert "tool_calls" not in bad["message"] and bad["finish_reason"] == "stop"
    record = gw.close_session(s.id)
    assert (record["tool_calls"], record["invalid_calls"]) == (0, 1)
    t = _trajectory(record, record["segments"][0]["prompt_ids"], None, None, False, 0.0, tokenizer)
    assert t.stats["num_tool_calls"] == 1 and t.stats["num_invalid_calls"] == 1 and t.stats["tool_tokens"] == 0


def _scripted_reply(tokenizer, text: str, parser, tools, stop=None, *, eos=False, **body) -> dict:
    """Gateway.chat's reply to one request whose sampled text is `text` (+ EOS: the turn ended on it), read with
    `parser`, from a scripted engine."""
    import asyncio

    from megappo.gateway.app import Gateway
    from megappo.workers.rollout.async_engine import Completion

    sampled = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])

    class Scripted:
        version = requests = steps = 0

        async def generate(self, prompt, params, multi_modal=None):
            return Completion(list(prompt), sampled, [-0.5] * len(sampled), "stop", 0, stop_string=stop or "")

    gw = Gateway(Scripted(), tokenizer, model_name="tiny", max_model_len=256, max_tokens=64,
                 tool_prompt="Tools: {tools}", tool_parser=parser)
    s = gw.open_session()
    out = asyncio.run(gw.chat({"messages": [{"role": "user", "content": "2 + 3?"}], "tools": tools, **body},
                              f"Bearer {s.key}"))["choices"][0]
    seg = gw.close_session(s.id)["segments"][0]
    assert [t for t, m in zip(seg["tokens"], seg["model_mask"]) if m] == out["token_ids"] == sampled  # EOS too
    return out


def test_tool_calls_read_in_the_models_format_with_vllms_parsers(tokenizer):
    """rollout.agent_tool_parser / serve --tool-parser: the reply read as vLLM's server reads it with that parser.
    vLLM's `hermes` reads megappo's default format as megappo's own reader does; `llama3_json` reads Llama 3's
    JSON calls (the tokenizer given Llama 3's <|python_tag|> marker), which megappo's reader leaves as content.
    The token that stopped the reply is not content, special or not; tool_choice "none" or no tools: no calls.
    A tool vLLM's schema refuses is a 400 before anything is sampled; a name vLLM lacks, or a parser whose
    marker token the model's vocabulary lacks, is one line naming the fix."""
    import asyncio

    from transformers import AutoTokenizer

    from megappo.gateway.app import Gateway, GatewayError
    from megappo.gateway.tool_calls import ToolCallReader, check_tool_parser, vllm_tool_parsers

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    hermes = ('Let me add.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
              '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4 * 5"}}\n</tool_call>')
    ours, theirs = (_scripted_reply(tokenizer, hermes, p, tools, stop="</tool_call>") for p in (None, "hermes"))
    for r in (ours, theirs):
        assert r["finish_reason"] == "tool_calls" and r["message"]["content"].strip() == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours["message"]["tool_calls"]] \
        == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in theirs["message"]["tool_calls"]] \
        == [("calculator", {"expression": "2 + 3"}), ("calculator", {"expression": "4 * 5"})]
    for parser in (None, "hermes"):  # the stop string, or the EOS that ended the turn, is not content
        assert _scripted_reply(tokenizer, "It is 5.\n\n", parser, tools, stop="\n\n")["message"] == \
            {"role": "assistant", "content": "It is 5."}
        assert _scripted_reply(tokenizer, "It is 5.", parser, tools, eos=True)["message"]["content"] == "It is 5."
    for parser, listed, extra in ((None, tools, {"tool_choice": "none"}), ("hermes", tools, {"tool_choice": "none"}),
                                  ("hermes", None, {})):  # vLLM's server reads no calls then; megappo's reader too
        r = _scripted_reply(tokenizer, hermes, parser, listed, stop="</tool_call>", **extra)
        assert "tool_calls" not in r["message"] and "<tool_call>" in r["message"]["content"]

    llama = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    llama.chat_template = tokenizer.chat_template
    llama.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eom_id|>"]})
    text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "7 - 2"}}<|eom_id|>'
    r = _scripted_reply(llama, text, "llama3_json", tools)  # a stop token that is not EOS ends the turn
    (call,) = r["message"]["tool_calls"]
    assert r["finish_reason"] == "tool_calls" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "7 - 2"}
    assert not r["message"]["content"]
    assert "tool_calls" not in _scripted_reply(llama, text, None, tools)["message"]  # not megappo's format

    gw = Gateway(None, tokenizer, model_name="tiny", max_model_len=256, max_tokens=64, tool_prompt="T: {tools}",
                 tool_parser="hermes")
    bad = [{"type": "function", "function": {"name": 123}}]
    with pytest.raises(GatewayError, match="^tools: .*name"):  # before sampling: the engine is None here
        asyncio.run(gw.chat({"messages": [{"role": "user", "content": "hi"}], "tools": bad},
                            f"Bearer {gw.open_session().key}"))
    assert "llama3_json" in vllm_tool_parsers() and "mistral" in vllm_tool_parsers()
    with pytest.raises(ValueError, match="not one of vLLM's: choose one of .*hermes"):
        check_tool_parser("hermez")
    with pytest.raises(ValueError, match="does not fit this model's tokenizer"):
        ToolCallReader(tokenizer, "llama3_json")  # no <|python_tag|> in tiny-llama's vocabulary


def test_a_requests_undo_point_is_constant_size_and_restores_the_record_exactly(tokenizer):
    """Each gateway request saves where the session ends so a refused or failed request can be undone (and a
    close meanwhile hands out the record without it). It was a deep copy of every segment: quadratic in a
    session's length. Now lengths and references: the same size after 200 requests as after 1, and restoring it,
    or reading the record as of it, gives exactly the record before the request."""
    from megappo.agent.capture import ChatRenderer, Segment, Session

    session = Session(ChatRenderer(tokenizer))
    msgs = [{"role": "user", "content": "count"}]
    sizes = []
    for k in range(200):
        snap = session.snapshot()
        sizes.append(len(snap))
        assert not any(isinstance(x, list) and x and isinstance(x[0], Segment) for x in snap)  # no segments held
        reply = {"role": "assistant", "content": str(k)}
        run_turn(session, tokenizer, msgs, tokenizer.encode(str(k), add_special_tokens=False), reply)
        msgs = msgs + [reply, {"role": "user", "content": "more"}]
    assert len(set(sizes)) == 1 and len(session.segments) == 1  # one growing segment
    before = session.as_of()
    snap = session.snapshot()
    assert session.as_of(snap) == before
    session.chat_prompt(msgs)  # a request extends the segment, then fails before its answer
    session.record([5, 6], [-0.1, -0.2], version=3)
    assert session.as_of(snap) == before != session.as_of()
    session.restore(snap)
    assert session.as_of() == before
    session.chat_prompt([{"role": "user", "content": "another history"}])  # a rewritten history: a new segment
    assert len(session.segments) == 2
    session.restore(snap)
    assert session.as_of() == before and len(session.segments) == 1


def test_latency_p95_is_by_nearest_rank():
    """p95 of few latencies was the smallest one's neighbour (index int(0.95 * (n - 1)): the first of two)."""
    from megappo.gateway.app import nearest_rank

    assert nearest_rank([1.0, 2.0], 0.95) == 2.0
    assert nearest_rank([float(i) for i in range(1, 101)], 0.95) == 95.0
    assert nearest_rank([3.0], 0.95) == 3.0 and nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
