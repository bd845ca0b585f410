"""Bring your own agent: the user's async function, run once per sample against the gateway, turned into
the trajectories the trainer trains on (the same shape megappo/agent/loop.AgentLoop.run returns).

    # my_pkg/my_agent.py
    async def run(client, row):               # client: openai.AsyncOpenAI bound to this sample's session
        messages = list(row["messages"])      # the row's prompt: send it first, as it is
        while True:
            r = await client.chat.completions.create(model="policy", messages=messages, tools=MY_TOOLS)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return my_score(msg.content, row["ground_truth"])   # or None: the row's rule scores it
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": my_tool(call)})

    runner = AgentRunner(AsyncTokenEngine.for_llm(llm), tokenizer, "my_pkg.my_agent:run", max_model_len=...,
                         concurrency=32, timeout_s=60)
    trajectories = runner.run(prompt_ids, spec, base_seed, rows)

Each sample gets its own session (its own key; the gateway's sampling: the rollout's temperature / top_p
are enforced, so the trainer's log-probs are taken at what sampled; a seed per request from the sample's
seed; max_tokens capped to what is left of the response budget, spec.max_new_tokens, model and
observation tokens together). Up to `concurrency` agents run at once; the engine batches their requests. A plain
function runs in a thread of its own (in_thread), so all of them run at once, each timed from its start; one
that hangs past its timeout is abandoned, not waited for.
A trajectory is the session's first segment, which must start from the row's prompt ids (the row's
messages sent as they are): its tokens after the prompt, model tokens masked in with their sampled
log-probs. A later segment (the agent rewrote history: agent/capture.py) is trained as a row of its own,
its prompt and model tokens as captured (Trajectory.later; ppo/segments.py: the sample's reward and
advantage). A sample's turns (what its rule scores) are the model turns of all its segments. A sample whose agent
raises, runs past `timeout_s` or returns something other than a finite number or None is kept empty
(nothing trained) and counted in agent_errors / agent_timeouts; the step goes on. The returned reward (or one set over HTTP) rides in the trajectory's
turns as {"role": "reward", "value": r}, which the row's environment uses instead of its rule.

An agent that is not Python runs under a small async shim that starts it with the session's address and key
(`client.base_url`, `client.api_key`) and `row["session_id"]`: it calls `/v1/chat/completions` and may post
its reward to `/megappo/v1/sessions/{session_id}/reward` with the same key (tests/test_gateway.py drives curl).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from functools import partial
from typing import Callable, Optional

from megappo.agent.factory import is_async_agent, load_agent  # noqa: F401 (load_agent re-exported: one loader)
from megappo.agent.loop import TURN_SEED_STRIDE

# request t of sample k is seeded base_seed + k + t * TURN_SEED_STRIDE: the built-in loop's turns' seeds (agent/loop.py)
STATS = ("agent_requests", "agent_segments", "agent_fallbacks", "agent_errors", "agent_timeouts",
         "agent_own_prompt", "agent_s", "agent_segment")  # agent_segment: a row's place in its session (0: first)


def agent_builder(rollout, engine_for: Callable) -> Optional[Callable]:
    """What a rollout engine samples with, as a builder `(llm, tokenizer) -> agent` (VLLMRollout calls it once its
    engine exists): your own agent (rollout.agent) run against a gateway on the engine (`engine_for(llm)`: the
    rollout's asynchronous front, workers/rollout/async_engine.py), else the built-in multi-turn loop
    (rollout.multi_turn, agent/factory.py), else None (single-turn)."""
    if getattr(rollout, "agent", None):
        return partial(_runner_for, rollout=rollout, engine_for=engine_for)
    from megappo.agent.factory import agent_loop_builder

    return agent_loop_builder(getattr(rollout, "multi_turn", None))


def _runner_for(llm, tokenizer, rollout, engine_for: Callable) -> "AgentRunner":
    from megappo.data.images import processor_for

    model = llm.llm_engine.model_config
    return AgentRunner(engine_for(llm), tokenizer, rollout.agent, max_model_len=model.max_model_len,
                       max_tokens=rollout.max_new_tokens, concurrency=rollout.agent_concurrency,
                       timeout_s=rollout.agent_timeout_s, tool_prompt=rollout.multi_turn.tool_prompt,
                       tool_parser=rollout.agent_tool_parser, max_segments=rollout.agent_max_segments,
                       processor=processor_for(model.model))


def sample_rows(non_tensor: dict, n: int) -> list[dict]:
    """What each sample's agent is given: its row's chat messages (a row's images as image_url parts with data URLs,
    where the data placed them), ground truth, data_source, extra_info and index (data/dataset.py's non_tensor
    batch), each row repeated for its n samples."""
    from megappo.data.images import IMAGES, with_image_urls

    rows = []
    for i, prompt in enumerate(non_tensor["raw_prompt"]):
        images = non_tensor[IMAGES][i] if IMAGES in non_tensor else None
        messages = with_image_urls(prompt, list(images), f"row {i}") if images is not None and len(images) else \
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        truth = (non_tensor["reward_model"][i] or {}).get("ground_truth") if "reward_model" in non_tensor else None
        row = {"messages": messages, "ground_truth": truth,
               "data_source": str(non_tensor["data_source"][i]) if "data_source" in non_tensor else None,
               "extra_info": non_tensor["extra_info"][i] if "extra_info" in non_tensor else None,
               "index": int(non_tensor["index"][i]) if "index" in non_tensor else i}
        rows += [row] * n
    return rows


class AgentRunner:
    def __init__(self, engine, tokenizer, agent: str | Callable, *, max_model_len: int, max_tokens: int,
                 concurrency: int = 32, timeout_s: float = 60.0, tool_prompt: Optional[str] = None,
                 tool_parser: Optional[str] = None, max_segments: Optional[int] = 8, processor=None):
        from megappo.gateway.app import Gateway, make_app
        from megappo.gateway.serve import GatewayServer

        self.fn = load_agent(agent) if isinstance(agent, str) else agent
        self.max_segments = max_segments
        self.engine = engine  # the rollout's AsyncTokenEngine (workers/rollout/async_engine.py)
        self.gateway = Gateway(self.engine, tokenizer, model_name="policy", max_model_len=max_model_len,
                               max_tokens=max_tokens, tool_prompt=tool_prompt, tool_parser=tool_parser,
                               processor=processor)
        self.server = GatewayServer(make_app(self.gateway))
        self.url = self.server.start()
        self.concurrency, self.timeout_s = int(concurrency), float(timeout_s)

    def run(self, prompts: list[list[int]], spec, base_seed: int, rows: list[dict]):
        """One trajectory per prompt (sample k runs rows[k]'s agent, seeded base_seed + k)."""
        trajectories = asyncio.run(self._run_all(prompts, spec, base_seed, rows))
        # every session is closed and its requests cancelled (sample); an abort the stepping thread has not taken
        # yet is done here, under its lock: nothing of this rollout's agents decodes on into the weight sync or
        # the engine's sleep that follows (the synchronous rollout: the engine serves this rollout alone)
        self.engine.abort_all()
        return trajectories

    async def _run_all(self, prompts, spec, base_seed, rows):
        gate = asyncio.Semaphore(self.concurrency)
        return await asyncio.gather(*(self.sample(prompts[k], spec, None if base_seed is None else base_seed + k,
                                                  rows[k], gate) for k in range(len(prompts))))

    async def sample(self, prompt: list[int], spec, seed: Optional[int], row: dict, gate: asyncio.Semaphore):
        """One sample: the agent run on `row` in a session of its own (its requests seeded seed + t * TURN_SEED_STRIDE),
        under `gate` (at most `concurrency` at once), as a trajectory. Also what fully_async's rollout stream
        starts for each sample of a group (workers/rollout/stream.py)."""
        import openai

        from megappo.gateway.app import as_reward

        # the rollout's sampling, whatever the agent asks for (the trainer scores what this distribution sampled)
        sampling = {"temperature": spec.temperature if spec.do_sample else 0.0,
                    "top_p": spec.top_p if spec.do_sample else 1.0, "top_k": spec.top_k if spec.do_sample else -1,
                    "stop_token_ids": list(spec.stop_token_ids)}
        async with gate:
            state = self.gateway.open_session(row)
            state.budget = int(spec.max_new_tokens)  # over the whole session, all its segments
            state.session.max_segments = self.max_segments
            state.forced = {**sampling, "seed": seed, "seed_stride": TURN_SEED_STRIDE}
            blocking = not is_async_agent(self.fn)  # a plain function: in a thread, with the synchronous client
            client = (openai.OpenAI if blocking else openai.AsyncOpenAI)(
                base_url=self.url + "/v1", api_key=state.key, max_retries=0, timeout=self.timeout_s)
            t0, error, timed_out, returned = time.perf_counter(), None, False, None
            try:
                # its own task: an agent that cancels itself cancels that task, not the rollout's; a synchronous
                # one runs off the event loop, so the other samples' agents (and the gateway) go on meanwhile
                job = in_thread(self.fn, client, {**row, "session_id": state.id}) if blocking \
                    else self.fn(client, {**row, "session_id": state.id})
                run = asyncio.ensure_future(job)
                returned = await asyncio.wait_for(run, self.timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the rollout itself is being cancelled
                    raise
                error = "CancelledError: the agent cancelled its own run"
            except Exception as e:  # noqa: BLE001 - a user's agent failing on one sample drops that sample
                error = f"{type(e).__name__}: {e}"
            finally:
                if blocking:
                    client.close()
                else:
                    await client.close()
            reward = None
            if returned is not None and error is None:
                try:
                    reward = as_reward(returned)
                except ValueError as e:  # the sample is dropped and counted, as an agent that raises
                    error = f"the agent's return value: {e}"
            record = self.gateway.close_session(state.id)  # cancels what the agent left in flight (a timeout)
            for _ in range(1000):  # and waits (5 s at most) until it is gone: each aborted in the engine
                if not state.tasks:
                    break
                await asyncio.sleep(0.005)
            if reward is None:
                reward = record["reward"]
            return _trajectory(record, prompt, reward, error, timed_out, time.perf_counter() - t0,
                               self.gateway.tokenizer)

    @property
    def lora_request(self):
        return self.engine.lora_request

    @lora_request.setter
    def lora_request(self, request) -> None:
        """rollout.lora_sync=adapter: every request of every session samples with this adapter from now on."""
        self.engine.lora_request = request

    def close(self) -> None:
        self.server.stop()  # the engine stays: it is the LLM's own (AsyncTokenEngine.for_llm)


async def in_thread(fn: Callable, *args):
    """`fn(*args)` in a daemon thread of its own, started at once: a synchronous agent (or an environment's blocking
    call, gateway/adapters.py) off the event loop. Not asyncio's default pool, whose min(32, cpus + 4) threads
    (6 on 2 cores) would queue the rest of `concurrency` agents, their timeouts running as they wait, and whose
    shutdown waits (asyncio.run: 300 s) for a hung one. Cancelling the await (a timeout) abandons the thread, which
    runs on with nothing waiting for it: a thread cannot be killed, and no shutdown joins it."""
    loop, context = asyncio.get_running_loop(), contextvars.copy_context()
    done = loop.create_future()

    def settle(result, error) -> None:
        if not done.done():  # not cancelled meanwhile
            done.set_exception(error) if error is not None else done.set_result(result)

    def work() -> None:
        try:
            result, error = context.run(fn, *args), None
        except BaseException as e:  # noqa: BLE001 - raised where it is awaited, as asyncio.to_thread does
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # its loop is closed: the run it belonged to is over
            pass

    threading.Thread(target=work, name="megappo-agent", daemon=True).start()
    return await done


def _trajectory(record: dict, prompt: list[int], reward, error: Optional[str], timed_out: bool, seconds: float,
                tokenizer):
    from megappo.agent.loop import Trajectory

    t = Trajectory()
    segments = record["segments"]
    first = segments[0] if segments else None
    own_prompt = first is not None and first["prompt_ids"] != list(prompt)
    stats = {"agent_requests": record["requests"], "agent_segments": len(segments), "agent_fallbacks": record["fallbacks"],
             "agent_errors": float(error is not None), "agent_timeouts": float(timed_out),
             "agent_own_prompt": float(own_prompt), "agent_s": seconds, "agent_segment": 0.0}
    t.stats.update(stats)
    t.request_s = list(record.get("latencies", []))
    if first is not None and error is None and not timed_out:
        if own_prompt:  # tools= shown, a system prompt added, the row's messages changed: trained as it was sent
            t.prompt = list(first["prompt_ids"])
        _fill(t, first, tokenizer)
        for j, seg in enumerate(segments[1:], 1):  # a rewritten history: a row of its own, its prompt as rendered
            later = Trajectory(prompt=list(seg["prompt_ids"]), stats={**dict.fromkeys(t.stats, 0.0), "agent_segment": j})
            _fill(later, seg, tokenizer)  # its statistics 0: the sample's are on its first row
            t.later.append(later)
        t.stats["num_turns"] = float(sum(seg["turns"] for seg in segments))
        # the built-in loop's tool statistics as far as the gateway sees them: every call the model wrote in its
        # chat replies (read or not; the loop counts only the calls it runs, within max_tool_calls), the unreadable
        # ones, and the tokens between model turns no engine sampled (tool results, user messages, the template's
        # glue); the tools' own errors and timeouts are the agent's, not seen here
        t.stats["num_tool_calls"] = float(record["tool_calls"] + record["invalid_calls"])
        t.stats["num_invalid_calls"] = float(record["invalid_calls"])
        t.stats["tool_tokens"] = float(sum(v == -1 and not m for seg in segments
                                           for m, v in zip(seg["model_mask"], seg["versions"])))
        if t.later:  # the sample stopped (or not) where its last segment did (the non-stop penalty reads it)
            t.stopped = t.later[-1].stopped
        t.turns = [turn for row in (t, *t.later) for turn in row.turns]  # what the sample's rule scores
    if error:
        t.turns.append({"role": "error", "text": error})
    t.turns.append({"role": "reward", "value": None if reward is None else float(reward)})  # last: environment.py
    t.done = True
    for later in t.later:  # every row of the sample reads as the sample (DAPO's filter scores rows)
        later.turns = t.turns
    return t


def _fill(t, segment: dict, tokenizer) -> None:
    """A trajectory row from a captured segment (Segment.to_dict): its tokens as sampled, its model turns as text."""
    from megappo.agent.capture import Segment

    t.take(Segment(**segment))
    sampled = [m or v != -1 for m, v in zip(t.model_mask, t.versions)]  # a forced call too: context, not trained
    t.turns = [{"role": "assistant", "text": tokenizer.decode(run, skip_special_tokens=True)}
               for run in _model_runs(t.tokens, sampled)]
    t.stopped = bool(t.tokens) and t.tokens[-1] in set(tokenizer.all_special_ids)
    t.done = True


def _model_runs(tokens: list, mask: list) -> list[list]:
    """The model's turns: the runs of consecutive tokens the engine sampled."""
    runs, cur = [], []
    for tok, m in zip(tokens, mask):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])
