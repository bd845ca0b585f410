"""The rollout's own MoE routes (actor.router_replay=r3): which experts vLLM's routers sent every token to, prompt
tokens and sampled ones, so that the trainer can replay them (models/routing_replay.py).

    llm.collective_rpc(install_capture)        # once, after the engine is built: hooks on every MoE router
    llm.collective_rpc(start_capture)          # before a generate call (a stream: once, at its start)
    got = llm.collective_rpc(take_routes, args=(request_ids,))[0]   # {request id: (positions [n], routes [n, L, k])}
    got = llm.collective_rpc(pop_routes, args=(request_ids,))[0]    # a stream's finished requests, capture on
    routes = rows_of_routes(got, ids, prompt_lengths, width, ...)  # [rows, width, L, k] int16, -1 where none

How (vLLM 0.32, the V1 model runner megappo pins; on CPU):
- vLLM's routers (fused_moe/router/base_router.py) call `capture_fn(topk_ids)` with the step's flattened tokens'
  logical expert ids, before any expert-parallel remapping; vLLM's own `bind_routed_experts_capturer` sets
  that hook on every MoE layer with the layer's global index. A `_Capture` takes its calls: one step buffer
  [tokens, layers, k].
- The step's tokens are laid out request by request in the runner's input batch (`input_batch.req_ids`,
  `query_start_loc`), each with its position (`positions`), which `_model_forward` (the runner's documented
  override point) is called with: after each forward the buffer is cut per request and kept by position. vLLM's
  request ids are the caller's id + "-" + a suffix: routes are kept under the caller's.
- A token vLLM did not compute is not captured: a prompt prefix found in the prefix cache. The rollout turns
  prefix caching off when it captures (every prompt token is then computed once per sample). The last sampled
  token is never fed to the model: it has no route (the trainer's router picks its experts; nothing reads its
  output for the policy's log-probs).
On GPU the same code runs on the same V1 runner, eager (rollout.enforce_eager, megappo's default: no CUDA graph,
no torch.compile, so every forward calls the hook; config/moe_checks.route_capture_problem refuses r3 otherwise).
vLLM's binder also wires the GPU kernels that route inside one fused call (a monolithic kernel's routing sink),
and refuses a kernel that cannot report its routes. The step buffer lives on the routes' device and comes to
the host once per forward, not once per layer. vLLM's own route output (`enable_return_routed_experts`, the
AuxOutput connector) needs the V2 runner, whose sampler and log-prob processing differ from V1's: megappo pins
V1 on every device (vllm_env.setup_env) so that GPU and CPU runs sample and report log-probs alike, and keeps one
capture path for both. Not run on a GPU yet.
"""

from __future__ import annotations

from typing import Optional

import torch

_ATTR = "megappo_route_capture"  # the vLLM worker's attribute holding its _Capture


class _Capture:
    def __init__(self, runner, num_layers: int, topk: int):
        self.runner = runner
        self.shape = (num_layers, topk)
        self.step: Optional[torch.Tensor] = None
        self.active = False
        self.routes: dict[str, list] = {}  # caller's request id -> [(positions [n], routes [n, L, k])]

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:  # vLLM's capturer interface
        if not self.active:
            return
        n = topk_ids.shape[0]
        if self.step is None or self.step.shape[0] < n or self.step.device != topk_ids.device:
            self.step = torch.full((max(n, 256), *self.shape), -1, dtype=torch.int16, device=topk_ids.device)
        self.step[:n, layer_id] = topk_ids.to(torch.int16)  # on its device: no host sync per layer

    def after_forward(self, positions: torch.Tensor) -> None:
        if not self.active or self.step is None:
            return
        batch = self.runner.input_batch
        n = batch.num_reqs
        bounds = self.runner.query_start_loc.cpu[:n + 1].tolist()
        positions = positions[:bounds[-1]].to("cpu")
        step = self.step[:bounds[-1]].to("cpu", copy=True)  # the forward's routes, to the host once
        for i, req_id in enumerate(batch.req_ids[:n]):
            a, b = bounds[i], bounds[i + 1]
            caller = req_id.rsplit("-", 1)[0]
            self.routes.setdefault(caller, []).append((positions[a:b].clone(), step[a:b].clone()))
        self.step[:bounds[-1]] = -1


def install_capture(worker, num_layers: int, topk: int) -> int:
    """collective_rpc target: hooks on the model's MoE routers and its runner's forward; the routers bound."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    runner = worker.model_runner
    cap = _Capture(runner, num_layers, topk)
    bind_routed_experts_capturer(runner.get_model(), cap)
    forward = runner._model_forward

    def model_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        cap.after_forward(kwargs["positions"] if "positions" in kwargs else args[1])
        return out

    runner._model_forward = model_forward
    setattr(worker, _ATTR, cap)
    return sum(1 for m in runner.get_model().modules() if getattr(getattr(m, "router", None), "capture_fn", None))


def start_capture(worker) -> None:
    """collective_rpc target: capture the next generate call's routes (earlier ones dropped)."""
    cap = getattr(worker, _ATTR)
    cap.routes.clear()
    cap.active = True


def take_routes(worker, request_ids: list) -> dict:
    """collective_rpc target: {request id: (positions [n], routes [n, L, k])} of the capture since start_capture
    (each position once: the last step that computed it), and the capture stopped."""
    cap = getattr(worker, _ATTR)
    cap.active = False
    out = _routes_of(cap, request_ids)
    cap.routes.clear()
    return out


def pop_routes(worker, request_ids: list) -> dict:
    """collective_rpc target: as take_routes for finished requests, while the capture goes on for the others (a
    stream, rollout/stream.py: requests finish while others run; its thread steps the engine meanwhile, and a
    finished request's last forward was recorded before its completion was delivered)."""
    return _routes_of(getattr(worker, _ATTR), request_ids)


def _routes_of(cap: _Capture, request_ids: list) -> dict:
    out = {}
    for rid in request_ids:
        parts = cap.routes.pop(str(rid), [])
        if parts:
            positions, routes = torch.cat([p for p, _ in parts]), torch.cat([r for _, r in parts])
            keep = _last_of_each(positions)  # a preempted request recomputes its tokens: the last pass counts
            out[str(rid)] = (positions[keep], routes[keep])
    return out


def _last_of_each(positions: torch.Tensor) -> torch.Tensor:
    """Indices of the last occurrence of each position in `positions` [n] (in capture order), by position."""
    n = positions.numel()
    order = (positions.long() * n + torch.arange(n)).argsort()
    p = positions[order]
    last = torch.ones(n, dtype=torch.bool)
    last[:-1] = p[1:] != p[:-1]
    return order[last]


def rows_of_routes(got: dict, request_ids: list, prompt_lengths: list, prompt_width: int, width: int,
                   shape: tuple) -> torch.Tensor:
    """The rows' routes aligned with the rollout batch's input_ids [rows, width] (a left-padded prompt of
    `prompt_width` columns, then the response): position p of row k sits at column prompt_width - plen_k + p.
    -1 where a token has no route (padding, the last sampled token)."""
    out = torch.full((len(request_ids), width, *shape), -1, dtype=torch.int16)
    for k, (rid, plen) in enumerate(zip(request_ids, prompt_lengths)):
        if str(rid) not in got:
            continue
        positions, routes = got[str(rid)]
        cols = prompt_width - int(plen) + positions.long()
        keep = (cols >= 0) & (cols < width)
        out[k, cols[keep]] = routes[keep]
    return out
