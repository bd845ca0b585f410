"""Start N local worker processes (MASTER_ADDR=127.0.0.1, a free port): the launcher behind the `megappo
logprobs` CLI, the benchmark and the multi-process tests.

    results = spawn_local(fn, nprocs, *args)   # fn(rank, world_size, port, *args) -> picklable

Each worker's return value comes back in rank order; a worker exception is re-raised here with its
traceback. Entry scripts need `if __name__ == "__main__":` (as for spawn).

The workers are forked from multiprocessing's fork server, which imported torch, megatron-core and
transformers once (PRELOAD): a worker starts with them imported instead of spending ~3 s of CPU on them
(8 workers on 2 cores: ~12 s less per launch). Nothing in PRELOAD starts a thread or touches CUDA at import,
so forking after it is safe. The server was started with this process's environment of that moment: each
worker takes this process's environment as it is at the launch.
"""

from __future__ import annotations

import io
import os
import random
import socket
import traceback
from pathlib import Path


# Rendezvous ports are drawn from here up to the kernel's ephemeral range: above Ray's worker ports
# (`ray start` default 10002-19999, which slurm/ray_on_slurm.sh keeps) and its client server (10001).
PORT_FLOOR = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()  # never twice: the driver picks every group's port before any listens
# what the fork server imports once for every worker (vLLM not: no gain measured, and it reads env vars at import);
# transformers' AutoConfig.from_pretrained (load_hf_config) imports modeling_auto, and with it generation, scipy and
# sklearn: ~1.5 s of CPU per worker otherwise
PRELOAD = ["torch", "megatron.core", "transformers", "transformers.models.auto.modeling_auto"]


def ephemeral_port_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports connect() takes its local end from (Linux's ip_local_port_range; 32768-60999 elsewhere)."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bind(host: str, port: int) -> int:
    """The port `host:port` binds to now (port 0: the OS's pick); OSError when it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, port))
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a rendezvous that listens on it seconds later.

    Not bind(0): that port comes from the ephemeral range, where any outgoing connection (another
    group's gloo mesh or TCPStore clients starting meanwhile) may take it as its local end before our
    TCPStore listens, and the rendezvous fails with EADDRINUSE. CI saw exactly that with three worker
    groups starting side by side. So: a random free port outside that range, between PORT_FLOOR and its
    low end (or above its high end on a host whose range starts low), never one this process handed out
    already; random from the OS, not the `random` module, which workers seed alike.
    """
    low, high = ephemeral_port_range()
    span = range(PORT_FLOOR, low) if low - PORT_FLOOR >= 1000 else range(high + 1, 65536)
    if len(span) >= 100:  # else no room outside the range: the OS's pick below
        rng = random.SystemRandom()
        for port in (rng.choice(span) for _ in range(200)):
            if port in _handed_out:
                continue
            try:
                _bind(host, port)
            except OSError:
                continue
            _handed_out.add(port)
            return port
    return _bind(host, 0)


def _worker(rank, fn, world_size, port, queue, args, threads, env=None):
    if env is not None:  # a forkserver child has the server's environment: the caller's, as it is now
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        import torch

        torch.set_num_threads(threads)
        out = fn(rank, world_size, port, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: tensors must outlive this process (no shared-memory fds)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def spawn_local(fn, nprocs: int, *args, timeout: float = 600.0, threads: int | None = None):
    """Run fn(rank, nprocs, port, *args) in `nprocs` processes (forked by the fork server); results by rank."""
    import torch.multiprocessing as mp

    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.SimpleQueue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, fn, nprocs, port, queue, args, threads, env), daemon=False)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < nprocs:
        if not queue.empty():
            rank, ok, out = queue.get()
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{out}")
            if errors:
                break
            continue
        if time.monotonic() > deadline:
            errors.append(f"timed out after {timeout}s")
            break
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and queue.empty():
            time.sleep(0.5)
            if queue.empty():
                errors.append(f"worker(s) died: exit codes {[p.exitcode for p in procs]}")
                break
        time.sleep(0.05)
    if errors:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        raise RuntimeError("worker failed: " + "\n".join(errors))
    for p in procs:
        p.join(timeout=60)
    return [results[r] for r in range(nprocs)]
