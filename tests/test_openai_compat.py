"""The gateway answers what vLLM's OpenAI server answers, for the fields clients send (the session's one served
engine, conftest `served`): completions with logprobs / echo / max_tokens 0 (prompt log-probs, checked against
HF transformers), a batch of prompts, n samples, chat logprobs with top_logprobs, nulls as defaults, a missing
max_tokens as the rest of the context, fresh randomness per unseeded request, any model name; what it does not do
is one 400 line, and a training session refuses what would change the distribution it samples from."""

from __future__ import annotations

import http.client
import json

import pytest
import torch

from gateway_helpers import MAX_LEN, MAX_TOKENS, served_gateway


@pytest.fixture(scope="module")
def served(tiny_assets):
    yield from served_gateway(tiny_assets)



def post(url: str, path: str, body: dict, key: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def hf_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, by transformers in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_requests_get_the_prompts_log_probs(served, tiny_assets):
    """lm-evaluation-harness's local-completions log-likelihood request: a batch of token-id prompts, echo,
    logprobs 1, max_tokens 0 (or 1), temperature 0. Each choice echoes its prompt with token_logprobs (None for
    the first token) equal to transformers' (fp32, 1e-4), the top-1 alternative at each position (for is_greedy)
    and text offsets; with max_tokens 1 the sampled token follows the prompt's. It was `logprobs: null`, no echo,
    and max_tokens 0 a 400."""
    rollout, _, gateway, url = served
    prompts = [[5, 17, 33, 9, 41, 2, 8, 60], [7, 7, 12, 90, 3]]
    status, r = post(url, "/v1/completions", {"model": "anything", "prompt": prompts, "echo": True, "logprobs": 1,
                                               "max_tokens": 0, "temperature": 0}, gateway.admin_key)
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["usage"]["completion_tokens"] == 0
    for ids, choice in zip(prompts, r["choices"]):
        lp = choice["logprobs"]
        assert choice["text"] == rollout.tokenizer.decode(ids) and choice["token_ids"] == []
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_prompt_logprobs(tiny_assets["tiny-llama"], ids)
        assert (torch.tensor(lp["token_logprobs"][1:]) - ref).abs().max() < 1e-4
        for top in lp["top_logprobs"][1:]:
            assert 1 <= len(top) <= 2  # the top-1 and the prompt's own token when it is not that one
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    status, r = post(url, "/v1/completions", {"prompt": prompts[0], "echo": True, "logprobs": 1, "max_tokens": 1,
                                               "temperature": 0}, gateway.admin_key)
    lp = r["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(prompts[0]) + 1 and len(r["choices"][0]["token_ids"]) == 1
    greedy = max(lp["top_logprobs"][-1].values())
    assert lp["token_logprobs"][-1] == pytest.approx(greedy)  # temperature 0: the argmax was sampled
    status, r = post(url, "/v1/completions", {"prompt": prompts[0], "max_tokens": 0}, gateway.admin_key)
    assert status == 400 and "with echo=true it returns the prompt's log-probs" in r["error"]["message"]


def test_unseeded_requests_sample_afresh_and_n_samples_are_choices(served):
    """Unseeded requests at temperature 1 returned the same completion every time (each engine step puts the
    process's RNG back: one noise for all); now each draws its own seed. n > 1 gives n choices (seed + j when
    seeded), as vLLM's server."""
    _, _, gateway, url = served
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 1.0}
    texts = [tuple(post(url, "/v1/completions", body, gateway.admin_key)[1]["choices"][0]["token_ids"])
             for _ in range(4)]
    assert len(set(texts)) > 1, texts
    status, r = post(url, "/v1/completions", {**body, "n": 3, "seed": 7}, gateway.admin_key)
    assert status == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2]
    again = post(url, "/v1/completions", {**body, "seed": 8}, gateway.admin_key)[1]["choices"][0]["token_ids"]
    assert r["choices"][1]["token_ids"] == again  # sample j is seeded seed + j
    state = gateway.open_session()
    status, r = post(url, "/v1/completions", {**body, "n": 2}, state.key)
    assert status == 400 and "n must be 1 in a session" in r["error"]["message"]
    gateway.close_session(state.id)


def test_chat_top_logprobs_nulls_and_the_rest_of_the_context(served):
    """Chat: logprobs with top_logprobs k gives each sampled token k alternatives in vLLM's server's order (the
    sampled token first, then the others best first: its engine's order, of which it writes the first k); a null
    temperature / top_p / n / max_tokens is the default (they were 400s); a missing max_tokens is what the context
    has left within the server's budget (a long prompt was a 400)."""
    _, _, gateway, url = served
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    status, r = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "logprobs": True,
                                                    "top_logprobs": 3, "seed": 1}, gateway.admin_key)
    assert status == 200, r
    for entry in r["choices"][0]["logprobs"]["content"]:
        alts = [a["logprob"] for a in entry["top_logprobs"]]
        assert len(alts) == 3 and entry["top_logprobs"][0]["token"] == entry["token"] and alts[0] == entry["logprob"]
        assert alts[1:] == sorted(alts[1:], reverse=True)
        assert bytes(entry["bytes"]).decode() == entry["token"]
    nulls = {"messages": msgs, "temperature": None, "top_p": None, "n": None, "max_tokens": None, "seed": None}
    status, r = post(url, "/v1/chat/completions", nulls, gateway.admin_key)
    assert status == 200 and len(r["choices"]) == 1, r
    long_prompt = list(range(10, 10 + MAX_LEN - 5))  # 5 positions left, fewer than the server's MAX_TOKENS
    status, r = post(url, "/v1/completions", {"prompt": long_prompt, "temperature": 0}, gateway.admin_key)
    assert status == 200 and 1 <= len(r["choices"][0]["token_ids"]) <= 5 < MAX_TOKENS, r
    status, r = post(url, "/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}, gateway.admin_key)
    assert status == 400 and "top_logprobs needs logprobs: true" in r["error"]["message"]


def test_what_is_not_done_is_one_line_and_a_session_keeps_its_sampling(served):
    """response_format (JSON mode), the legacy functions API, a key no route reads (it was ignored) and a vLLM
    extension this server does not do are refused in one line, not ignored (a vLLM field at vLLM's default asks for
    nothing: accepted); logit_bias and the penalties apply outside a session (a +100 bias makes the token the only
    one sampled), and inside a training session, whose sampling is the rollout's, they are refused, and min_tokens
    with them (it masks the stop tokens: the sampled log-probs would not be the policy's)."""
    _, _, gateway, url = served
    msgs = [{"role": "user", "content": "hi"}]
    for path, extra, said in (
            ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format is not supported"),
            ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions is not supported"),
            ("/v1/chat/completions", {"echo": True}, "echo=True (a vLLM extension) is not supported"),
            ("/v1/chat/completions", {"store": False}, "store is not a field of /v1/chat/completions"),
            ("/v1/completions", {"max_completion_tokens": 2}, "max_completion_tokens is not a field of /v1/comp")):
        body = {"messages": msgs} if path == "/v1/chat/completions" else {"prompt": [1, 2, 3]}
        status, r = post(url, path, {**body, "max_tokens": 2, **extra}, gateway.admin_key)
        assert status == 400 and said in r["error"]["message"] and "\n" not in r["error"]["message"], r
    at_default = {"echo": False, "ignore_eos": False, "skip_special_tokens": True}  # vLLM's defaults: nothing asked
    status, r = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **at_default}, gateway.admin_key)
    assert status == 200, r
    status, r = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2,
                                                    "response_format": {"type": "text"}}, gateway.admin_key)
    assert status == 200
    status, r = post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "logit_bias": {"77": 100},
                                               "temperature": 1.0}, gateway.admin_key)
    assert status == 200 and r["choices"][0]["token_ids"] == [77] * 4, r
    state = gateway.open_session()
    state.forced = {"temperature": 1.0, "top_p": 1.0, "seed": 3, "seed_stride": 1}
    for extra, said in (({"presence_penalty": 1.5}, "presence_penalty=1.5"), ({"min_tokens": 2}, "min_tokens=2")):
        status, r = post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, **extra}, state.key)
        assert status == 400 and f"{said} would change what a training session samples from" in \
            r["error"]["message"], r
    gateway.close_session(state.id)


# an enum argument: a random tiny model's free string would run past any token budget before it closed
PICK = {"type": "function", "name": "pick", "description": "pick an operation",
        "parameters": {"type": "object", "properties": {"op": {"enum": ["add", "sub"]}}, "required": ["op"]}}


def test_the_responses_api_samples_and_records_as_chat(served):
    """/v1/responses (the OpenAI Agents SDK's default): input items to chat messages, the reply to output items. A
    forced call comes back as a function_call item; the next request sends it with its function_call_output and
    extends the session's one conversation: the record's sampled tokens are exactly the two responses' token_ids."""
    import asyncio

    from megappo.gateway.app import Gateway, GatewayError

    rollout, engine, _, url = served
    gw = Gateway(engine, rollout.tokenizer, model_name="tiny", max_model_len=MAX_LEN, max_tokens=120,
                 tool_prompt="You may call these tools:\n{tools}")  # room for a forced call's JSON
    state = gw.open_session()
    first = {"model": "gpt-4o", "instructions": "Use the tool.", "input": "What is 17 * 23?",
             "tools": [PICK], "tool_choice": "required", "max_output_tokens": 100, "seed": 1, "store": False}
    r = asyncio.run(gw.responses(first, f"Bearer {state.key}"))
    assert r["object"] == "response" and r["status"] in ("completed", "incomplete"), r
    calls = [item for item in r["output"] if item["type"] == "function_call"]
    assert calls, (r["output"], rollout.tokenizer.decode(r["token_ids"]))
    assert calls[0]["name"] == "pick" and json.loads(calls[0]["arguments"])["op"] in ("add", "sub")
    assert r["usage"]["output_tokens"] == len(r["token_ids"]) > 0
    second = {"model": "gpt-4o", "instructions": "Use the tool.", "max_output_tokens": 8, "seed": 2,
              # as the Agents SDK sends it: the conversation so far, the response's output items as they came
              "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is 17 * 23?"}]},
                        *r["output"],
                        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "391"}],
              "tools": [PICK]}
    r2 = asyncio.run(gw.responses(second, f"Bearer {state.key}"))
    record = gw.close_session(state.id)
    assert len(record["segments"]) == 1 and record["fallbacks"] == 0  # extended, not re-rendered
    seg = record["segments"][0]
    sampled = [t for t, m in zip(seg["tokens"], seg["model_mask"]) if m]
    assert sampled == r2["token_ids"]  # the forced call is context (not trained), the free turn trained as sampled
    assert seg["tokens"][:len(r["token_ids"])] == r["token_ids"]
    for bad, said in (({"input": "hi", "previous_response_id": "resp_1"}, "stores no responses"),
                      ({"input": "hi", "stream": True}, "stream=true is not supported"),
                      ({"input": "hi", "tools": [{"type": "web_search"}]}, "built-in tools"),
                      ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                       "is not a data URL; megappo fetches nothing"),
                      ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
                       "takes input_text and input_image parts"),
                      # accepted and without effect before
                      ({"input": "hi", "truncation": "auto"}, "a prompt is never cut"),
                      ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "is not returned by this server"),
                      ({"input": "hi", "top_logprobs": 2}, "top_logprobs needs include"),
                      ({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary")):
        with pytest.raises(GatewayError, match=said):
            asyncio.run(gw.responses(bad, f"Bearer {gw.admin_key}"))
    status, r = post(url, "/v1/responses", {"input": "hi", "max_output_tokens": 4}, served[2].admin_key)
    assert status == 200 and r["usage"]["output_tokens"] <= 4  # the route, over HTTP


LM_EVAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
"""
LM_EVAL_KINDS = {
    "mp_choice": "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
                 "metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n",
    "mp_answer": "output_type: generate_until\ndoc_to_target: answer\n"
                 "generation_kwargs: {until: ['\\n'], max_gen_toks: 8, do_sample: false}\n"
                 "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n",
}


def test_lm_evaluation_harness_scores_choices_and_generates_over_http(served, tiny_assets, tmp_path, monkeypatch):
    """lm-evaluation-harness, unchanged (its `local-completions` model over HTTP, token-id prompts, its own
    tokenizer), on a local task file: the log-likelihood of each choice of a multiple-choice task is transformers'
    (fp32, 1e-3 on the sum), its `acc` the argmax's; a generate_until task's answers are transformers' greedy
    continuations, cut at the task's stop string, as vLLM's server writes text (tests/test_vllm_server_parity.py)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, gateway, url = served
    rows = [{"question": f"What is {a} + {b}?", "choices": [str(a + b - 1), str(a + b), str(a + b + 1)], "label": 1,
             "answer": str(a + b)} for a, b in ((2, 3), (4, 4), (1, 5))]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, kind in LM_EVAL_KINDS.items():
        (tmp_path / f"{name}.yaml").write_text(LM_EVAL_TASK.format(name=name, data=data) + kind)
    monkeypatch.setenv("OPENAI_API_KEY", gateway.admin_key)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = str(tiny_assets["tiny-llama"])
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=list(LM_EVAL_KINDS), task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": url + "/v1/completions", "model": "tiny", "tokenizer": model_dir,
                    "tokenizer_backend": "huggingface", "max_length": MAX_LEN})
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scored = out["samples"]["mp_choice"]
    assert len(scored) == len(rows)
    right = []
    for sample in scored:
        lls = []
        for (context, continuation), ((ll, _),) in zip(sample["arguments"], sample["resps"]):
            ctx, whole = tok(context)["input_ids"], tok(context + continuation)["input_ids"]
            ref = hf_prompt_logprobs(tiny_assets["tiny-llama"], whole)[len(ctx) - 1:].sum().item()
            assert ll == pytest.approx(ref, abs=1e-3), (context, continuation)
            lls.append(ref)
        right.append(float(max(range(len(lls)), key=lls.__getitem__) == sample["target"]))
    assert out["results"]["mp_choice"]["acc,none"] == pytest.approx(sum(right) / len(right))
    for sample in out["samples"]["mp_answer"]:
        (context, _), = sample["arguments"]
        ids = tok(context, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            greedy = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
        text = tok.decode(greedy, skip_special_tokens=True)
        # cut at the stop string; else the bytes of an unfinished UTF-8 character at the end (decoded as U+FFFD)
        # are not written, as vLLM's detokenizer holds them back
        text = text.split("\n")[0] if "\n" in text else text.rstrip("\ufffd")
        assert sample["resps"] == [[text]]


def test_the_gateway_serves_as_an_on_policy_distillation_teacher(served, tiny_assets):
    """teacher.endpoint's client (ppo/teacher_endpoint.py) against the gateway, as against `megappo serve` or
    `vllm serve`: each row's log-probs after its first token are transformers' (fp32, 1e-4), rows of several
    lengths in one batch prompt (teacher.rows_per_request)."""
    from megappo.ppo.teacher_endpoint import TeacherEndpoint

    _, _, gateway, url = served
    rows = [[5, 17, 33, 9, 41, 2, 8, 60], [7, 7, 12, 90, 3], list(range(40, 70))]
    client = TeacherEndpoint(url + "/v1", api_key=gateway.admin_key, concurrency=2)
    try:
        assert client.check() == "tiny"
        lps, stats = client.score(rows)
    finally:
        client.close()
    assert stats.requests == 1 and stats.retries == 0  # the three rows in one request
    for ids, lp in zip(rows, lps):
        assert (torch.tensor(lp) - hf_prompt_logprobs(tiny_assets["tiny-llama"], ids)).abs().max() < 1e-4


def test_docs_list_what_the_gateway_refuses():
    """docs/agents.md names every field the gateway refuses in one line and every one a training session fixes."""
    from pathlib import Path

    from megappo.gateway import requests as rq

    docs = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    missing = [k for k in (*rq.UNSUPPORTED, *rq.SESSION_FIXED) if f"`{k}`" not in docs]
    assert not missing, f"docs/agents.md does not list {missing}"
