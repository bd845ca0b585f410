"""Trainer -> rollout-pool weight broadcast for async (one-step off-policy) PPO.

In async mode the actor (Megatron, its own gloo/nccl world) and the rollout engines (vLLM, another
worker group with its own world) are different processes. After every training step the actor's
weights are pushed to the rollout pool over ONE extra collective group that spans both pools:

    sync group = {actor global rank 0} + {every rollout worker}      (size 1 + rollout_workers)

- it is a "stateless" process group (`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL`
  built on its own TCPStore, rendezvous at actor rank 0's address), so neither world's default
  group or megatron's parallel_state is touched;
- sender side: EVERY actor rank iterates `parallel/resharding.py`'s buckets with rollout_tp=1
  (collective over the actor world: TP all-gather + PP broadcast, so each bucket arrives as full
  HF-named tensors), and actor rank 0 broadcasts each bucket over the sync group: a small JSON
  header (names, shapes, dtype) then one flat tensor. The last header carries the trainer-side weight
  fingerprints (rollout/fingerprint.py);
- receiver side: every rollout worker loads each bucket into its vLLM engine (`load_weights`: vLLM
  fuses and TP-slices the HF tensors itself, so any rollout TP works), resets the prefix cache, and
  compares the fingerprints of what its kernels hold with the trainer's (`WeightSyncError` if not).

Bytes on the wire per sync = one copy of the model per rollout worker (a broadcast); the driver never
touches a weight. Both sides must enter `send` / `receive` concurrently (the driver submits both).
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Optional

import torch
import torch.distributed as dist

from megappo.parallel import device
from megappo.workers.rollout.fingerprint import compare, tensor_fingerprint_on_device, tolerance_for, \
    with_tied_head
from megappo.workers.rollout.hybrid_engine import WeightSyncError

__all__ = ["StatelessGroup", "WeightSender", "WeightReceiver"]


class StatelessGroup:
    """A process group of `world` processes that belong to different torch.distributed worlds."""

    def __init__(self, host: str, port: int, rank: int, world: int, backend: Optional[str] = None,
                 timeout_s: float = 600.0):
        backend = backend or ("nccl" if device.on_gpu() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("megappo_weight_sync", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
            self.device = torch.device("cpu")
        self.rank, self.world = rank, world

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        t = tensor.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self.pg.broadcast([t], opts).wait()
        return t

    def broadcast_json(self, obj=None, root: int = 0):
        """Root sends a JSON-able object; everyone returns it."""
        if self.rank == root:
            data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
            n = torch.tensor([data.numel()], dtype=torch.int64, device="cpu")
        else:
            data, n = None, torch.zeros(1, dtype=torch.int64, device="cpu")
        n = self.broadcast(n, root)
        if data is None:
            data = torch.empty(int(n.item()), dtype=torch.uint8, device="cpu")
        data = self.broadcast(data, root)
        return None if self.rank == root else json.loads(bytes(data.cpu().numpy()).decode())


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightSender:
    """On every actor rank; `group` is the sync group on actor rank 0 and None elsewhere."""

    def __init__(self, engine, group: Optional[StatelessGroup], bucket_mb: float = 256):
        from megappo.parallel.resharding import Resharder
        from megappo.models.lora import merged_named_parameters

        self.engine, self.group = engine, group
        self.resharder = Resharder(engine.inner_chunks(), engine.dims, engine.layout, rollout_tp=1,
                                   bucket_bytes=int(bucket_mb * (1 << 20)),
                                   fingerprint_fn=tensor_fingerprint_on_device,
                                   named_weights=merged_named_parameters)  # LoRA: the adapted linears merged

    def send(self) -> dict:
        t0 = time.perf_counter()
        sent = 0
        with self.engine.resident(parts=["params"]):  # an offloaded actor's weights come back for the send
            for bucket in self.resharder.buckets():  # collective over the actor world
                if self.group is None:
                    continue
                names = [n for n, _ in bucket.tensors]
                shapes = [list(t.shape) for _, t in bucket.tensors]
                dtype = str(bucket.tensors[0][1].dtype).removeprefix("torch.")
                self.group.broadcast_json({"names": names, "shapes": shapes, "dtype": dtype})
                flat = torch.cat([t.reshape(-1) for _, t in bucket.tensors])
                self.group.broadcast(flat)
                sent += flat.numel() * flat.element_size()
        if self.group is not None:
            fps = with_tied_head(self.resharder.expected_fingerprints, self.engine.dims.tied_embeddings)
            self.group.broadcast_json({"end": True, "fingerprints": fps})
        return {"timing/weight_send_s": time.perf_counter() - t0,
                "rollout/weight_sync_bytes_sent": float(sent * (self.group.world - 1 if self.group else 0))}


class WeightReceiver:
    """On every rollout worker (sync rank >= 1)."""

    def __init__(self, rollout, group: StatelessGroup):
        self.rollout, self.group = rollout, group

    def receive(self) -> dict:
        t0 = time.perf_counter()
        received = 0
        while True:
            header = self.group.broadcast_json()
            if header.get("end"):
                break
            dtype = _DTYPES[header["dtype"]]
            numels = [int(torch.Size(s).numel()) for s in header["shapes"]]
            # on the group's device (GPU: straight from nccl into vLLM's load, no host round trip)
            flat = self.group.broadcast(torch.empty(sum(numels), dtype=dtype, device=self.group.device))
            received += flat.numel() * flat.element_size()
            tensors, off = [], 0
            for name, shape, k in zip(header["names"], header["shapes"], numels):
                tensors.append((name, flat[off:off + k].view(shape)))
                off += k
            self.rollout.load_weights(tensors, reset_prefix_cache=False)
        self.rollout.reset_prefix_cache()  # REQUIRED: cached KV blocks were computed with the old weights
        expected = {k: tuple(v) for k, v in header["fingerprints"].items()}
        bad = compare(expected, self.rollout.fingerprint(), tolerance_for(self.rollout.weights_dtype))
        if bad:
            raise WeightSyncError(f"rollout worker: weights held by vLLM differ from the trainer's after the "
                                  f"sync ({len(bad)} tensor(s)): " + "; ".join(bad[:5]))
        return {"timing/weight_receive_s": time.perf_counter() - t0, "rollout/weights_fingerprint_ok": 1.0,
                "rollout/weight_sync_bytes_received": float(received)}
