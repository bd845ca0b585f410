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

With actor.lora and rollout.lora_sync=adapter only the adapters travel: actor rank 0 gathers them
(models/lora_peft.gather_hf_lora, peft's layout) and broadcasts one header + one flat tensor; each rollout worker
writes them as a peft dir (adapter_dirs.py) for its vLLM's own LoRA serving. The base vLLM loaded from
model.path is fingerprinted against the actor's frozen base at every sync (the base's buckets are walked
once, at the first sync, for their fingerprints; nothing of the base is sent).
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

    def __init__(self, engine, group: Optional[StatelessGroup], bucket_mb: float = 256, adapter: bool = False):
        from megappo.parallel.resharding import Resharder
        from megappo.models.lora import base_named_parameters, lazily_merged_named_parameters

        self.engine, self.group = engine, group
        self.adapter = adapter and getattr(engine, "lora", None) is not None  # rollout.lora_sync=adapter
        self._base_fingerprints: Optional[dict] = None
        self.resharder = Resharder(engine.inner_chunks(), engine.dims, engine.layout, rollout_tp=1,
                                   bucket_bytes=int(bucket_mb * (1 << 20)),
                                   fingerprint_fn=tensor_fingerprint_on_device,
                                   named_weights=base_named_parameters if self.adapter
                                   else lazily_merged_named_parameters)  # LoRA: merged when read

    def send(self) -> dict:
        if self.adapter:
            return self._send_adapter()
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

    def _send_adapter(self) -> dict:
        from megappo.models.lora_peft import gather_hf_lora

        t0 = time.perf_counter()
        with self.engine.resident(parts=["params"]):
            if self._base_fingerprints is None:  # the frozen base's, once (collective: every rank walks them)
                self._base_fingerprints = with_tied_head(self.resharder.fingerprints(), self.engine.dims.tied_embeddings)
            adapter = gather_hf_lora(self.engine.inner_chunks(), self.engine.dims)  # on rank 0 only
        sent = 0
        if self.group is not None:
            names = sorted(adapter)
            tensors = [t for n in names for t in adapter[n]]
            self.group.broadcast_json({"adapter": names, "shapes": [list(t.shape) for t in tensors],
                                       "dtype": str(tensors[0].dtype).removeprefix("torch.")})
            flat = self.group.broadcast(torch.cat([t.reshape(-1) for t in tensors]))
            sent = flat.numel() * flat.element_size()
            self.group.broadcast_json({"end": True, "fingerprints": self._base_fingerprints})
        return {"timing/weight_send_s": time.perf_counter() - t0,
                "rollout/weight_sync_bytes_sent": float(sent * (self.group.world - 1 if self.group else 0))}


class WeightReceiver:
    """On every rollout worker (sync rank >= 1)."""

    def __init__(self, rollout, group: StatelessGroup, lora=None):
        """`lora`: (models/lora.LoraConfig, the base model's path) with rollout.lora_sync=adapter."""
        from megappo.workers.rollout.adapter_dirs import AdapterDirs

        self.rollout, self.group, self.lora = rollout, group, lora
        self.adapter_dirs = AdapterDirs()

    def receive(self) -> dict:
        t0 = time.perf_counter()
        received = 0
        extra, refused = {}, None
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
            for shape, k in zip(header["shapes"], numels):
                tensors.append(flat[off:off + k].view(shape))
                off += k
            if "adapter" in header:  # rollout.lora_sync=adapter: (A, B) per HF module, in the header's order
                if self.lora is None:  # read on to the end: the sender's broadcasts must all be met
                    refused = ("rollout worker: the trainer sent LoRA adapters, but this worker was built without "
                               "rollout.lora_sync=adapter")
                    continue
                adapter = {n: (tensors[2 * i].cpu(), tensors[2 * i + 1].cpu()) for i, n in enumerate(header["adapter"])}
                path = self.adapter_dirs.write(adapter, *self.lora)
                moved = self.rollout.load_adapter(path, self.adapter_dirs.version)  # > 0: fully_async's samples
                extra["rollout/lora_adapter_version"] = float(self.adapter_dirs.version)
                extra["async/recomputed_samples"] = float(moved)  # in flight, re-prefilled under the new adapter
                continue
            self.rollout.load_weights(list(zip(header["names"], tensors)), reset_prefix_cache=False)
        self.rollout.reset_prefix_cache()  # REQUIRED: cached KV blocks were computed with the old weights
        if refused:
            raise WeightSyncError(refused)
        expected = {k: tuple(v) for k, v in header["fingerprints"].items()}
        bad = compare(expected, self.rollout.fingerprint(), tolerance_for(self.rollout.weights_dtype))
        if bad:
            raise WeightSyncError(f"rollout worker: weights held by vLLM differ from the trainer's after the "
                                  f"sync ({len(bad)} tensor(s)): " + "; ".join(bad[:5]))
        return {"timing/weight_receive_s": time.perf_counter() - t0, "rollout/weights_fingerprint_ok": 1.0,
                "rollout/weight_sync_bytes_received": float(received), **extra}
