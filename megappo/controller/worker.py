"""Worker: the base class of every Ray worker (one process = one rank of one worker group).

The group starts each worker with its place in the group in the environment:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (+ MEGAPPO_GROUP, the group's name). Rank 0 is started
first with MASTER_ADDR/PORT empty (so not the ones a torchrun-style job script may export on the node,
which every group would share) and picks a free port on its own node (127.0.0.1 when the whole pool is
on one node, else its node IP); the group reads it back with `info()` and starts the other ranks with it.
So each group has its own torch.distributed world and, per process, its own megatron parallel_state.

Subclasses call `super().__init__()` first and mark the methods the driver may call with
`@register(Dispatch.X)` (see dispatch.py). Worker classes live in megappo.workers; this module is
the only part of the controller that runs inside the worker processes.
"""

from __future__ import annotations

import os
import socket

from megappo.controller.dispatch import Dispatch, register
from megappo.parallel.launch import free_port

__all__ = ["Worker"]


def node_ip() -> str:
    """This node's address as Ray sees it (routable from the other nodes); 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray (unit use): this host
        return "127.0.0.1"


class Worker:
    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.group_name = os.environ.get("MEGAPPO_GROUP", "worker")
        if not os.environ.get("MASTER_PORT"):  # empty: the group asks rank 0 to pick, whatever was inherited
            if self.rank != 0:
                raise RuntimeError(f"{self.group_name} rank {self.rank}: MASTER_PORT missing from the environment")
            addr = os.environ.get("MASTER_ADDR") or node_ip()
            os.environ["MASTER_ADDR"] = addr
            os.environ["MASTER_PORT"] = str(free_port(addr))
        self.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.master_port = int(os.environ["MASTER_PORT"])
        # what `release` undoes before the group kills this process (Ray's kill skips atexit): tmpfs dirs
        self.on_release: list = []

    # ------------------------------------------------------------------ group plumbing (not registered)
    def info(self) -> dict:
        """Cheap identity the group records at spawn (for error messages and the master address)."""
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "node_ip": node_ip(),
                "hostname": socket.gethostname(), "master_addr": self.master_addr, "master_port": self.master_port,
                "device": os.environ.get("MEGAPPO_DEVICE"), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def release(self) -> int:
        """Run the `on_release` callbacks (the group calls this just before it kills the process); one that
        fails does not stop the others. Returns how many ran."""
        done = 0
        while self.on_release:
            try:
                self.on_release.pop()()
                done += 1
            except Exception:  # noqa: BLE001 - best effort: the process is killed next
                pass
        return done

    def init_distributed(self, backend: str | None = None) -> None:
        """torch.distributed for this group (gloo on CPU, nccl on GPU); idempotent."""
        from megappo.parallel.megatron_init import init_distributed

        init_distributed(self.rank, self.world_size, self.master_addr, self.master_port, backend=backend)

    def init_megatron(self, layout, seed: int = 1234) -> None:
        """torch.distributed + megatron parallel_state for `layout` (a ParallelLayout of this group)."""
        from megappo.parallel.megatron_init import init_megatron

        if layout.world_size != self.world_size:
            raise ValueError(f"{self.group_name}: layout {layout} needs {layout.world_size} workers, "
                             f"the group has {self.world_size}")
        self.init_distributed()
        init_megatron(layout, seed=seed)

    @register(Dispatch.ONE_TO_ALL)
    def megatron_coords(self) -> tuple[int, int, int, int]:
        """This rank's (dp, pp, tp, cp) as megatron's parallel_state sees it."""
        from megappo.parallel.megatron_init import coords

        return coords()
