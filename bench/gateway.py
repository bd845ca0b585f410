"""The gateway's cost: tokens/s of the same samples drawn in-process (one batched `LLM.generate`, what the
built-in loop does per turn) and through the OpenAI-compatible gateway (`megappo/gateway/`: one session per
sample, the unmodified `openai` SDK over HTTP on loopback, the engine batching the concurrent requests).

Both paths sample the same prompts with the same per-sample seeds, so they draw the same tokens (checked:
the JSON says whether the sampled ids were identical); the repetitions alternate the two paths, and the
ratio is from one run (the machine is shared and noisy). Issue #38's bound: HTTP <= 1.15x slower.

    .venv/bin/python bench/gateway.py [--model assets/tiny-llama] [--samples 32] [--max-tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPT = "Question {k}: add {a} and {b}, then explain the steps."


def in_process(llm, prompts: list[list[int]], max_tokens: int, seed: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + k, logprobs=0)
              for k in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def over_http(gateway, url: str, messages: list[list[dict]], max_tokens: int, seed: int):
    import openai

    async def one(k: int):
        state = gateway.open_session()
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.key, max_retries=0)
        r = await client.chat.completions.create(model="policy", messages=messages[k], max_tokens=max_tokens,
                                                 temperature=1.0, seed=seed + k)
        await client.close()
        gateway.close_session(state.id)
        return r.choices[0].model_extra["token_ids"]

    async def main():
        return await asyncio.gather(*(one(k) for k in range(len(messages))))

    t0 = time.perf_counter()
    ids = asyncio.run(main())
    return time.perf_counter() - t0, ids


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF dir (default: the tiny llama, built locally)")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)

    from megappo.config.schema import RolloutConfig
    from megappo.gateway.app import Gateway, make_app
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.gateway.serve import GatewayServer
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    model = args.model
    if model is None:
        from megappo.assets import ensure_assets

        model = str(ensure_assets(REPO / "assets")["tiny-llama"])
    max_len = 512
    rollout = VLLMRollout(model, RolloutConfig(max_new_tokens=args.max_tokens, kv_cache_memory_mb=256), seed=0,
                          max_model_len=max_len)
    tok = rollout.tokenizer
    if tok.chat_template is None:
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [[{"role": "user", "content": PROMPT.format(k=k, a=17 * k, b=31 * k)}] for k in range(args.samples)]
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
               for m in messages]
    engine = AsyncTokenEngine.for_llm(rollout.llm)
    gateway = Gateway(engine, tok, model_name="policy", max_model_len=max_len, max_tokens=args.max_tokens)
    server = GatewayServer(make_app(gateway))
    url = server.start()
    try:
        with engine.paused():  # warm-up (both paths share the engine)
            in_process(rollout.llm, prompts, args.max_tokens, 10_000)
        over_http(gateway, url, messages, args.max_tokens, 10_000)
        runs = {"in_process": [], "http": []}
        same = True
        for rep in range(args.reps):
            seed = 1000 * (rep + 1)
            with engine.paused():  # one thread steps the engine at a time
                t_in, ids_in = in_process(rollout.llm, prompts, args.max_tokens, seed)
            t_http, ids_http = over_http(gateway, url, messages, args.max_tokens, seed)
            same &= ids_in == ids_http
            tokens = sum(map(len, ids_in))
            runs["in_process"].append(tokens / t_in)
            runs["http"].append(sum(map(len, ids_http)) / t_http)
    finally:
        server.stop()
        engine.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(json.dumps({"model": str(model), "samples": args.samples, "max_tokens": args.max_tokens, "reps": args.reps,
                      "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                      "http_slowdown": round(med["in_process"] / med["http"], 3),
                      "same_sampled_ids": same, "engine_steps": engine.steps, "engine_requests": engine.requests}))


if __name__ == "__main__":
    main()
