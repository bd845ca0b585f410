"""The multi-turn agent loop inside the rollout engine: token in, token out.

    loop = AgentLoop(llm, tokenizer, cfg.rollout.multi_turn)
    trajectories = loop.run(prompts, spec, base_seed, tools)   # prompts: token id lists, one per sample;
                                                               # tools: the tool names each may call
    trajectory = await loop.sample(engine, prompt, spec, seed, tools)   # one sample through an AsyncTokenEngine
                                                                        # (fully_async's rollout stream)

Every live sample of the call is generated in one batched vLLM call per turn (never one sample at a
time). A turn ends on EOS / end-of-turn or on `</tool_call>`; a turn that makes a call gets the tool's
result appended as the chat template's tool message + the next assistant header (agent/format.py),
and the sample goes on. A sample ends when a turn makes no call (its answer), after `max_turns`
model turns or `max_tool_calls` calls, or when its response reaches the token budget (the rollout's
max_new_tokens: model and tool tokens together; a tool result that does not fit is cut and ends the
sample). Tool calls of one turn run concurrently (threads: the python tool's work is a child process).

Each sample's tokens are recorded by the same token record as your own agent's requests through the
gateway (agent/capture.Session: one segment, each model turn recorded as sampled, each tool result
observed as rendered). A Trajectory's tokens are the model's exactly as sampled, with the tool tokens between them;
`model_mask` says which is which: the trainer computes no loss, KL or value target on tool tokens
(response_mask 0) but the model attends to them (attention_mask 1). Seeds: turn t of request k is
sampled with base_seed + k + t * TURN_SEED_STRIDE (turn 0 is the single-turn seed). `turns` records
each turn as text (assistant turns; tool calls with their arguments and results): what the row's
environment scores (agent/environment.Episode).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from megappo.agent.capture import Segment, Session
from megappo.agent.format import CALL_END, Observations, forced_call_regex, parse_call
from megappo.agent.tools import TOOLS, ToolResult, make_tools

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
    turns: list = field(default_factory=list)  # {"role": "assistant", "text"} / {"role": "tool", "name", ...}
    stats: dict = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0.0))
    prompt: Optional[list] = None  # the prompt ids it continues when not its row's (rollout.agent: the agent's own)
    versions: list = field(default_factory=list)  # per token, the policy version that sampled it (-1: not, or unknown)
    later: list = field(default_factory=list)  # rollout.agent: the session's later segments (a rewritten history)
    segment_of: Optional[int] = None  # a later segment's row: the index of its sample (trajectory_rows)
    request_s: list = field(default_factory=list)  # rollout.agent: each of its session's requests' latency (seconds)
    images: list = field(default_factory=list)  # rollout.agent: the data URLs of the images its ids hold, in order
    request_ids: list = field(default_factory=list)  # every recorded model turn's engine request, in order

    def take(self, segment: Segment) -> "Trajectory":
        """Its tokens from a session's captured segment (agent/capture.py), as sampled and observed."""
        self.tokens, self.model_mask = list(segment.tokens), list(segment.model_mask)
        self.logprobs, self.versions = list(segment.logprobs), list(segment.versions)
        self.images = list(segment.images)
        self.request_ids = [r for r in segment.request_ids if r is not None]
        return self

    @property
    def request_id(self) -> Optional[str]:
        """The engine request of its last model turn: its forward computed every token before it (prefix caching is
        off while routes are captured), so its routes are the row's (actor.router_replay=r3; None: no turn)."""
        return self.request_ids[-1] if self.request_ids else None


class _Sample:
    """A built-in loop's sample while it runs: its session (the token record) and its trajectory (turns as
    text, statistics, how it ended)."""

    def __init__(self, prompt: list[int]):
        self.session = Session(renderer=None)  # token-level requests only: the loop renders tool results itself
        self.session.completion_prompt(list(prompt))  # the row's prompt opens the sample's one segment
        self.traj = Trajectory()

    @property
    def ids(self) -> list:
        """What the engine continues next: the prompt, then every model and tool token so far."""
        return self.session.segments[-1].ids

    @property
    def used(self) -> int:
        """Response tokens so far (model and tool), against the rollout's budget."""
        return len(self.session.segments[-1].tokens)

    def trajectory(self) -> Trajectory:
        return self.traj.take(self.session.segments[-1])


class AgentLoop:
    def __init__(self, llm, tokenizer, config, share_results=None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.config = config
        # rollout.tp > 1 in the hybrid engine: every TP rank of a vLLM replica runs this loop, and vLLM's external
        # launcher needs the same requests on each. `share_results(compute)` runs `compute` (a turn's tool calls) on
        # the replica's first rank only and gives every rank its results (VLLMRollout.replica_share), so a tool
        # that times out or fails on one rank only cannot make the ranks' next prompts differ. None: one rank.
        self.share_results = share_results
        self.tools = make_tools(TOOLS, config.tool_timeout_s, config.max_tool_output_chars)
        self.observations = Observations(tokenizer)
        self._forced_regex: dict = {}  # tool_choice=required: tool names -> the first turn's regex
        self.lora_request = None  # rollout.lora_sync=adapter: the adapter every turn samples with (load_adapter)
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="megappo-tool")

    def run(self, prompts: list[list[int]], spec, base_seed: int, tools=None) -> list[Trajectory]:
        """One trajectory per entry of `prompts` (request k is prompts[k]); request k may call the tools
        named in tools[k] (default: rollout.multi_turn.tools), others are invalid calls."""
        budget = int(spec.max_new_tokens)
        samples = [_Sample(p) for p in prompts]
        allowed = [tuple(t) for t in tools] if tools is not None else [tuple(self.config.tools)] * len(prompts)
        for turn in range(int(self.config.max_turns)):
            live = [k for k, x in enumerate(samples) if not x.traj.done]
            if not live:
                break
            requests = [{"prompt_token_ids": samples[k].ids} for k in live]
            forced = {k: self._is_forced(turn, allowed[k]) for k in live}
            params = [self._params(spec, budget - samples[k].used, base_seed + k, turn, allowed[k]) for k in live]
            outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
            last_turn = turn == self.config.max_turns - 1
            calls = {}
            for k, o in zip(live, outs):
                c = o.outputs[0]
                lps = [float(c.logprobs[i][tok].logprob) for i, tok in enumerate(c.token_ids)] if c.logprobs else None
                calls[k] = self._model_turn(samples[k], list(c.token_ids), lps, c.finish_reason, c.stop_reason,
                                            budget, last_turn, forced[k], request_id=o.request_id)
            pending = {k: c for k, c in calls.items() if c is not None}

            def execute(pending=pending):
                return list(self.pool.map(self._execute, pending.values(), (allowed[k] for k in pending)))

            results = execute() if self.share_results is None else self.share_results(execute)
            for (k, call), result in zip(pending.items(), results):
                self._tool_turn(samples[k], call, result, budget)
        return [x.trajectory() for x in samples]

    async def sample(self, engine, prompt: list[int], spec, seed: int, tools=None) -> Trajectory:
        """One sample's loop through `engine` (workers/rollout/async_engine.AsyncTokenEngine: requests batched with every
        other in flight, weights loaded under them), seeded as `run` seeds request k when seed = base_seed + k,
        each model token with the policy version that sampled it (Trajectory.versions; -1 for tool tokens)."""
        import asyncio

        budget = int(spec.max_new_tokens)
        x = _Sample(prompt)
        allowed = tuple(tools) if tools is not None else tuple(self.config.tools)
        for turn in range(int(self.config.max_turns)):
            forced = self._is_forced(turn, allowed)
            c = await engine.generate(x.ids, self._params(spec, budget - x.used, seed, turn, allowed))
            call = self._model_turn(x, c.ids, c.logprobs, c.finish_reason, c.stop_string or None, budget,
                                    turn == self.config.max_turns - 1, forced, c.versions, c.request_id)
            if call is None:
                break
            result = await asyncio.get_running_loop().run_in_executor(self.pool, self._execute, call, allowed)
            self._tool_turn(x, call, result, budget)
            if x.traj.done:
                break
        x.traj.done = True
        return x.trajectory()

    def _is_forced(self, turn: int, allowed: tuple) -> bool:
        """tool_choice=required: turn 0 is a well-formed call of one of the row's tools (if it has any)."""
        return self.config.tool_choice == "required" and turn == 0 and bool(allowed)

    def _params(self, spec, max_tokens: int, seed: int, turn: int, allowed: tuple):
        """A turn's SamplingParams: what is left of the budget, seed + turn * TURN_SEED_STRIDE, stop at a call."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        forced = {"structured_outputs": StructuredOutputsParams(regex=self._forced(allowed))} \
            if self._is_forced(turn, allowed) else {}
        return SamplingParams(**{**spec.vllm_kwargs(), "max_tokens": max_tokens}, seed=seed + turn * TURN_SEED_STRIDE,
                              logprobs=0, stop=[CALL_END], include_stop_str_in_output=True, **forced)

    def _forced(self, names: tuple) -> str:
        if names not in self._forced_regex:
            self._forced_regex[names] = forced_call_regex([self.tools[n].schema() for n in names])
        return self._forced_regex[names]

    def _model_turn(self, x: _Sample, toks: list, logprobs, finish_reason, stop_reason, budget: int,
                    last_turn: bool, forced: bool, versions=-1, request_id: Optional[str] = None):
        """Record the model's tokens (a forced turn's as untrained context); returns the call to run, or
        None when the sample is finished. `versions`: the engine's per-token versions (-1: not tracked)."""
        x.session.record(toks, None if forced else logprobs, versions, model=not forced, finish_reason=finish_reason,
                         request_id=request_id)
        traj = x.traj
        traj.stats["num_turns"] += 1
        traj.turns.append({"role": "assistant", "text": self.tokenizer.decode(toks, skip_special_tokens=True)})
        by_call = finish_reason == "stop" and stop_reason == CALL_END
        call = parse_call(self.tokenizer.decode(toks)) if finish_reason == "stop" else None
        if call is None:  # an answer (stopped), or the budget ran out mid-turn (not stopped)
            traj.done, traj.stopped = True, finish_reason == "stop"
            return None
        if last_turn or traj.stats["num_tool_calls"] >= self.config.max_tool_calls or x.used >= budget:
            traj.done = True  # wanted a tool it may not have: cut
            return None
        call.ended_turn = not by_call  # the turn closed with EOS after the call
        return call

    def _execute(self, call, allowed: tuple) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.error, error=True, invalid=True)
        if call.name not in allowed:
            return ToolResult(f"error: unknown tool {call.name!r}; available: {', '.join(allowed)}", error=True,
                              invalid=True)
        return self.tools[call.name].call(call.arguments)

    def _tool_turn(self, x: _Sample, call, result: ToolResult, budget: int) -> None:
        traj, s = x.traj, x.traj.stats
        s["num_tool_calls"] += 1
        s["num_invalid_calls"] += float(result.invalid)
        s["num_tool_errors"] += float(result.error and not result.invalid)
        s["num_tool_timeouts"] += float(result.timed_out)
        s["tool_s"] += result.seconds
        traj.turns.append({"role": "tool", "name": call.name, "arguments": call.arguments, "text": result.text,
                           "error": result.error})
        ids = self.observations.ids(result.text, model_ended_turn=call.ended_turn)
        room = budget - x.used
        if len(ids) >= room:  # no room left for the model to answer
            ids, traj.done = ids[:room], True
        x.session.observe(ids)
        s["tool_tokens"] += len(ids)


def trajectory_rows(trajs: list[Trajectory]) -> list[Trajectory]:
    """The rows a rollout trains: one per sample, then every sample's later segments (rollout.agent's
    rewritten histories, trained as their own sequences: ppo/segments.py), each marked with its sample."""
    rows = list(trajs)
    for k, t in enumerate(trajs):
        for seg in t.later:
            seg.segment_of = k
            rows.append(seg)
    return rows


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
    extra = [k for k in (trajs[0].stats if trajs else {}) if k not in STAT_KEYS]  # e.g. gateway/agents.STATS
    for key in (*STAT_KEYS, *extra):
        out[key] = torch.tensor([t.stats.get(key, 0.0) for t in trajs], dtype=torch.float32, device="cpu")
    return out


def agent_metrics(batch: dict) -> dict:
    """rollout/* of a multi-turn step (empty for a single-turn batch): per-sample statistics over the samples'
    rows (a later segment's row, rollout.agent's rewritten history, carries none: its sample's first row
    has them), the model tokens over every row."""
    if "num_turns" not in batch:
        return {}
    model_tokens = batch["response_mask"].sum().item()
    later = batch["agent_segment"] > 0 if "agent_segment" in batch else torch.zeros_like(batch["num_turns"]).bool()
    batch = {k: v[~later] for k, v in batch.items() if k in STAT_KEYS or k.startswith("agent_")}
    calls = batch["num_tool_calls"].sum().item()
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
        **_own_agent_metrics(batch, later),
    }


def request_latency_metrics(non_tensor: dict) -> dict:
    """timing/agent_request_s_{p50,p95,max}: the latency of every request the step's agents sent (rollout.agent;
    non_tensor "agent_request_s": each sample's first row lists its session's), empty without."""
    lat = torch.tensor([s for row in non_tensor.get("agent_request_s", []) for s in row], dtype=torch.float64)
    if not len(lat):
        return {}
    return {"timing/agent_request_s_p50": lat.quantile(0.5).item(), "timing/agent_request_s_p95": lat.quantile(0.95).item(),
            "timing/agent_request_s_max": lat.max().item()}


def _own_agent_metrics(batch: dict, later: torch.Tensor) -> dict:
    """rollout.agent's rollout/agent_* (gateway/agents.STATS per sample): per-sample means and counted events."""
    if "agent_requests" not in batch:
        return {}
    return {"rollout/agent_requests_mean": batch["agent_requests"].mean().item(),
            "rollout/agent_segments_mean": batch["agent_segments"].mean().item(),
            "rollout/agent_segment_rows": later.sum().item(),
            "rollout/agent_sessions": float(len(batch["agent_requests"])),
            "rollout/agent_fallbacks": batch["agent_fallbacks"].sum().item(),
            "rollout/agent_errors": batch["agent_errors"].sum().item(),
            "rollout/agent_timeouts": batch["agent_timeouts"].sum().item(),
            "rollout/agent_own_prompt": batch["agent_own_prompt"].sum().item(),
            "timing/agent_s_mean": batch["agent_s"].mean().item(),
            "timing/agent_s_p50": batch["agent_s"].float().quantile(0.5).item(),
            "timing/agent_s_p95": batch["agent_s"].float().quantile(0.95).item(),
            "timing/agent_s_max": batch["agent_s"].max().item()}


__all__ = ["AgentLoop", "Trajectory", "trajectory_rows", "trajectory_tensors", "agent_metrics", "request_latency_metrics", "STAT_KEYS", "TURN_SEED_STRIDE"]
