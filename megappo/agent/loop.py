"""The multi-turn agent loop inside the rollout engine: token in, token out.

    loop = AgentLoop(llm, tokenizer, cfg.rollout.multi_turn)
    trajectories = loop.run(prompts, spec, base_seed)   # prompts: token id lists, one per sample

Every live sample of the call is generated in one batched vLLM call per turn (never one sample at a
time). A turn ends on EOS / end-of-turn or on `</tool_call>`; a turn that makes a call gets the tool's
result appended as the chat template's tool message + the next assistant header (agent/format.py),
and the sample goes on. A sample ends when a turn makes no call (its answer), after `max_turns`
model turns or `max_tool_calls` calls, or when its response reaches the token budget (the rollout's
max_new_tokens: model and tool tokens together; a tool result that does not fit is cut and ends the
sample). Tool calls of one turn run concurrently (threads: the python tool's work is a child process).

A Trajectory's tokens are the model's exactly as sampled, with the tool tokens between them;
`model_mask` says which is which: the trainer computes no loss, KL or value target on tool tokens
(response_mask 0) but the model attends to them (attention_mask 1). Seeds: turn t of request k is
sampled with base_seed + k + t * TURN_SEED_STRIDE (turn 0 is the single-turn seed).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from megappo.agent.format import CALL_END, Observations, forced_call_regex, parse_call
from megappo.agent.tools import ToolResult, make_tools

TURN_SEED_STRIDE = 1_000_003
# per-row statistics a multi-turn rollout adds to the batch (float32 [B]); ppo/metrics.agent_metrics reads them
STAT_KEYS = ("num_turns", "num_tool_calls", "num_invalid_calls", "num_tool_errors", "num_tool_timeouts",
             "tool_s", "tool_tokens")


@dataclass
class Trajectory:
    tokens: list = field(default_factory=list)
    model_mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    stopped: bool = False  # ended with an answer turn closed by EOS / a stop token
    done: bool = False
    stats: dict = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0.0))

    def add(self, tokens, logprobs=None, model: bool = True) -> None:
        self.tokens += list(tokens)
        self.model_mask += [int(model)] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


class AgentLoop:
    def __init__(self, llm, tokenizer, config):
        self.llm = llm
        self.tokenizer = tokenizer
        self.config = config
        self.tools = make_tools(config.tools, config.tool_timeout_s, config.max_tool_output_chars)
        self.observations = Observations(tokenizer)
        self.forced = None  # tool_choice=required: the first turn's regex
        if config.tool_choice == "required":
            self.forced = forced_call_regex([t.schema() for t in self.tools.values()])
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="megappo-tool")

    def run(self, prompts: list[list[int]], spec, base_seed: int) -> list[Trajectory]:
        """One trajectory per entry of `prompts` (request k is prompts[k])."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        budget = int(spec.max_new_tokens)
        trajs = [Trajectory() for _ in prompts]
        kwargs = spec.vllm_kwargs()
        for turn in range(int(self.config.max_turns)):
            live = [k for k, t in enumerate(trajs) if not t.done]
            if not live:
                break
            requests = [{"prompt_token_ids": prompts[k] + trajs[k].tokens} for k in live]
            forced = self.forced is not None and turn == 0
            extra = {"structured_outputs": StructuredOutputsParams(regex=self.forced)} if forced else {}
            params = [SamplingParams(**{**kwargs, "max_tokens": budget - len(trajs[k].tokens)},
                                     seed=base_seed + k + turn * TURN_SEED_STRIDE, logprobs=0, stop=[CALL_END],
                                     include_stop_str_in_output=True, **extra)
                      for k in live]
            outs = self.llm.generate(requests, params, use_tqdm=False)
            last_turn = turn == self.config.max_turns - 1
            calls = {k: self._model_turn(trajs[k], o.outputs[0], budget, last_turn, forced) for k, o in zip(live, outs)}
            pending = {k: c for k, c in calls.items() if c is not None}
            for (k, call), result in zip(pending.items(), self.pool.map(self._execute, pending.values())):
                self._tool_turn(trajs[k], result, call.ended_turn, budget)
        return trajs

    def _model_turn(self, traj: Trajectory, out, budget: int, last_turn: bool, forced: bool):
        """Append the model's tokens (a forced turn's as untrained context); returns the call to run, or
        None when the sample is finished."""
        toks = list(out.token_ids)
        lp = out.logprobs or []
        traj.add(toks, None if forced else [float(lp[i][tok].logprob) for i, tok in enumerate(toks)], model=not forced)
        traj.stats["num_turns"] += 1
        by_call = out.finish_reason == "stop" and out.stop_reason == CALL_END
        call = parse_call(self.tokenizer.decode(toks)) if out.finish_reason == "stop" else None
        if call is None:  # an answer (stopped), or the budget ran out mid-turn (not stopped)
            traj.done, traj.stopped = True, out.finish_reason == "stop"
            return None
        if last_turn or traj.stats["num_tool_calls"] >= self.config.max_tool_calls or len(traj.tokens) >= budget:
            traj.done = True  # wanted a tool it may not have: cut
            return None
        call.ended_turn = not by_call  # the turn closed with EOS after the call
        return call

    def _execute(self, call) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.error, error=True, invalid=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: unknown tool {call.name!r}; available: {', '.join(self.tools)}", error=True,
                              invalid=True)
        return tool.call(call.arguments)

    def _tool_turn(self, traj: Trajectory, result: ToolResult, ended_turn: bool, budget: int) -> None:
        s = traj.stats
        s["num_tool_calls"] += 1
        s["num_invalid_calls"] += float(result.invalid)
        s["num_tool_errors"] += float(result.error and not result.invalid)
        s["num_tool_timeouts"] += float(result.timed_out)
        s["tool_s"] += result.seconds
        ids = self.observations.ids(result.text, model_ended_turn=ended_turn)
        room = budget - len(traj.tokens)
        if len(ids) >= room:  # no room left for the model to answer
            ids, traj.done = ids[:room], True
        traj.add(ids, model=False)
        s["tool_tokens"] += len(ids)


def trajectory_tensors(trajs: list[Trajectory], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """responses / response_mask (model tokens) / token_mask (every real token) / rollout_log_probs /
    stopped and the STAT_KEYS rows, [len(trajs), width] right-padded."""
    rows = len(trajs)
    out = {"responses": torch.full((rows, width), pad_id, dtype=torch.long, device="cpu"),
           "response_mask": torch.zeros((rows, width), dtype=torch.long, device="cpu"),
           "token_mask": torch.zeros((rows, width), dtype=torch.long, device="cpu"),
           "rollout_log_probs": torch.zeros((rows, width), dtype=torch.float32, device="cpu"),
           "stopped": torch.tensor([t.stopped for t in trajs], dtype=torch.bool, device="cpu")}
    for i, t in enumerate(trajs):
        n = min(len(t.tokens), width)
        if n:
            out["responses"][i, :n] = torch.tensor(t.tokens[:n], dtype=torch.long)
            out["response_mask"][i, :n] = torch.tensor(t.model_mask[:n], dtype=torch.long)
            out["token_mask"][i, :n] = 1
            out["rollout_log_probs"][i, :n] = torch.tensor(t.logprobs[:n], dtype=torch.float32)
    for key in STAT_KEYS:
        out[key] = torch.tensor([t.stats[key] for t in trajs], dtype=torch.float32, device="cpu")
    return out


def agent_metrics(batch: dict) -> dict:
    """rollout/* of a multi-turn step (empty for a single-turn batch)."""
    if "num_turns" not in batch:
        return {}
    calls = batch["num_tool_calls"].sum().item()
    model_tokens = batch["response_mask"].sum().item()
    return {
        "rollout/turns_mean": batch["num_turns"].mean().item(),
        "rollout/tool_calls_mean": batch["num_tool_calls"].mean().item(),
        "rollout/tool_call_rate": (batch["num_tool_calls"] > 0).float().mean().item(),
        "rollout/tool_call_valid_rate": 1.0 - batch["num_invalid_calls"].sum().item() / calls if calls else float("nan"),
        "rollout/tool_errors": batch["num_tool_errors"].sum().item(),
        "rollout/tool_timeouts": batch["num_tool_timeouts"].sum().item(),
        "rollout/tokens_model": model_tokens,
        "rollout/tokens_tool": batch["tool_tokens"].sum().item(),
        "timing/tool_s": batch["tool_s"].sum().item(),
    }


__all__ = ["AgentLoop", "Trajectory", "trajectory_tensors", "agent_metrics", "STAT_KEYS", "TURN_SEED_STRIDE"]
