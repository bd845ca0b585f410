"""What the gateway tests share: the chat template they render with, and the agents they run against a real
server with the unmodified openai SDK."""

import asyncio
import contextlib

# a template that trims assistant text (as Qwen's do) and knows nothing of tool_calls
MAX_TOKENS, MAX_LEN = 24, 512  # the session's served gateway (conftest `served`)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.role == 'assistant' %}{{ m.content | trim }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def run_two_turn_agents(url: str, keys: list[str], model: str, max_tokens: int) -> None:
    """One agent per key, all at once: two chat turns each (its reply sent back, then "go on"), seeded by its
    place, as concurrent users of an agent framework would load the engine."""
    import openai

    async def agent(key, k):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": f"count to {k}"}]
        for _ in range(2):
            r = await client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, seed=k)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await client.close()

    async def main():
        await asyncio.gather(*(agent(key, k) for k, key in enumerate(keys)))

    asyncio.run(main())


@contextlib.contextmanager
def serve_process(model, *args: str, key: str = "k-test-123", timeout: float = 180):
    """`megappo serve --model MODEL ARGS` in its own process on a free loopback port, its key in
    $MEGAPPO_API_KEY, as a user starts it; yields (the process, its base URL) once the port answers. Its output
    goes to a file (a pipe nobody reads would fill and block it), read into `proc.log` after it stops."""
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megappo.cli", "serve", "--model", str(model), "--port",
                                 str(port), *args], env={**os.environ, "MEGAPPO_API_KEY": key}, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None, (log.seek(0), log.read())[1]
                    assert time.time() < deadline, f"megappo serve did not answer in {timeout} s"
                    time.sleep(0.5)
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            stop_process(proc)
            log.seek(0)
            proc.log = log.read()


def stop_process(proc) -> None:
    """SIGTERM, and SIGKILL if it is still there 30 s later; returns once it is gone."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def served_gateway(tiny_assets):
    """A gateway over one vLLM engine of the tiny llama (its module's fixture `served`: per module, as vLLM's
    in-process engines share the process's distributed state, which an engine torn down in another module ends):
    yields (rollout, engine, gateway, url). A test that loads other weights puts the old back."""
    from megappo.config.schema import RolloutConfig
    from megappo.gateway.app import Gateway, make_app
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.gateway.serve import GatewayServer
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    rollout = VLLMRollout(tiny_assets["tiny-llama"], RolloutConfig(max_new_tokens=MAX_TOKENS, kv_cache_memory_mb=32),
                          seed=0, dtype="float32", max_model_len=MAX_LEN)
    rollout.tokenizer.chat_template = TEMPLATE
    engine = AsyncTokenEngine.for_llm(rollout.llm)
    gateway = Gateway(engine, rollout.tokenizer, model_name="tiny", max_model_len=MAX_LEN, max_tokens=MAX_TOKENS,
                      tool_prompt="You may call these tools:\n{tools}")
    server = GatewayServer(make_app(gateway))
    server.start()
    yield rollout, engine, gateway, server.url
    server.stop()
    engine.close()

