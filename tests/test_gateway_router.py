"""megappo/gateway/router.py: one endpoint over several workers' gateways. Two real gateways (two workers'
session tables; here over one tiny vLLM engine, the module's one) behind the router: sessions spread over
them, a session's requests all reach its own worker, a raw HTTP client and the openai SDK both work through
it, and keys are checked (the router's 401 for a key it never issued; the worker's 403 for another session)."""

import http.client
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def routed(tiny_assets):
    from megappo.config.schema import RolloutConfig
    from megappo.gateway.app import Gateway, make_app
    from megappo.gateway.engine import AsyncTokenEngine
    from megappo.gateway.router import Router, make_router_app
    from megappo.gateway.serve import GatewayServer
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    rollout = VLLMRollout(tiny_assets["tiny-llama"], RolloutConfig(max_new_tokens=8, kv_cache_memory_mb=32),
                          seed=0, dtype="float32", max_model_len=256)
    rollout.tokenizer.chat_template = TEMPLATE
    engine = AsyncTokenEngine.for_llm(rollout.llm)
    admin = "mp-admin-router-test"
    gateways = [Gateway(engine, rollout.tokenizer, model_name="tiny", max_model_len=256, max_tokens=8, admin_key=admin)
                for _ in range(2)]
    servers = [GatewayServer(make_app(g)) for g in gateways]
    urls = [s.start() for s in servers]
    router_server = GatewayServer(make_router_app(Router(urls, admin)))
    url = router_server.start()
    yield gateways, url, admin
    router_server.stop()
    for s in servers:
        s.stop()
    engine.close()


def _post(url: str, path: str, body: dict, key: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_sessions_spread_over_workers_and_stay_on_theirs(routed):
    import openai

    gateways, url, admin = routed
    opened = [_post(url, "/megappo/v1/sessions", {"row": {"k": k}}, admin) for k in range(6)]
    assert all(status == 200 for status, _ in opened), opened
    assert sorted(o["worker"] for _, o in opened) == [0, 0, 0, 1, 1, 1]
    for _, o in opened[:4]:  # two requests per session, through the SDK and through a raw client
        client = openai.OpenAI(base_url=url + "/v1", api_key=o["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": "count"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, seed=1)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        status, raw = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4}, o["api_key"])
        assert status == 200 and raw["choices"][0]["token_ids"]
    o = opened[4][1]  # stream=true through the router: the worker's server-sent events pass as they are
    chunks = list(openai.OpenAI(base_url=url + "/v1", api_key=o["api_key"], max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=4, seed=1, stream=True))
    assert chunks and sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks), [])
    for _, o in opened[:4]:
        status, record = _post(url, f"/megappo/v1/sessions/{o['session_id']}/close", {}, admin)
        assert status == 200 and record["requests"] == 2 and record["fallbacks"] == 0
        other = gateways[1 - o["worker"]]
        assert o["session_id"] not in other.sessions  # never reached the other worker


def test_keys_are_checked_by_the_router_and_by_the_worker(routed):
    _, url, admin = routed
    status, body = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "sk-nope")
    assert status == 401 and "unknown API key" in body["error"]["message"]
    status, body = _post(url, "/megappo/v1/sessions", {}, "sk-nope")
    assert status == 401 and "admin key" in body["error"]["message"]
    (_, a), (_, b) = (_post(url, "/megappo/v1/sessions", {}, admin) for _ in range(2))
    status, body = _post(url, f"/megappo/v1/sessions/{b['session_id']}/reward", {"reward": 1.0}, a["api_key"])
    assert status in (403, 404) and "\n" not in body["error"]["message"]  # the worker's own refusal, one line


def test_32_concurrent_sessions_over_two_workers_are_batched(routed):
    """The issue's load: 32 agents at once through the router, two requests each; the sessions spread evenly over
    the workers, every request reaches its session's worker, and the engine batches them (a step samples for
    many requests: far fewer steps than sampled tokens)."""
    from gateway_helpers import run_two_turn_agents

    gateways, url, admin = routed
    engine = gateways[0].engine
    opened = [_post(url, "/megappo/v1/sessions", {}, admin)[1] for _ in range(32)]
    per_worker = [len(g.sessions) for g in gateways]  # the least-loaded worker gets each: even, whatever was open
    assert abs(per_worker[0] - per_worker[1]) <= 1 and min(o["worker"] for o in opened) == 0 < max(o["worker"] for o in opened)
    steps0, requests0 = engine.steps, engine.requests

    run_two_turn_agents(url, [o["api_key"] for o in opened], "tiny", 8)
    steps, requests = engine.steps - steps0, engine.requests - requests0
    records = [_post(url, f"/megappo/v1/sessions/{o['session_id']}/close", {}, admin)[1] for o in opened]
    assert all(r["requests"] == 2 and r["fallbacks"] == 0 for r in records), records[0]
    for o in opened:  # each session lived on its own worker only
        assert o["session_id"] not in gateways[1 - o["worker"]].sessions
    sampled = sum(sum(seg["model_mask"]) for r in records for seg in r["segments"])
    assert requests == 64 and steps * 4 < sampled, (steps, sampled)


def test_the_workers_answer_headers_pass_through_the_router(routed):
    """Headers a client acts on come back through the router as the worker sent them: a 405's Allow (and a
    session's 409 x-should-retry: false, which keeps the OpenAI SDK from retrying it, by the same path)."""
    _, url, admin = routed
    _, opened = _post(url, "/megappo/v1/sessions", {}, admin)
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/models", "{}", {"Authorization": f"Bearer {opened['api_key']}"})
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 405 and "GET" in (r.getheader("allow") or "") and "Method Not Allowed" in body["error"]["message"]
    _post(url, f"/megappo/v1/sessions/{opened['session_id']}/close", {}, admin)
