"""Move an engine's parameters, gradients and optimizer states to host memory between its phases,
and back, IN PLACE: every tensor object (megatron's DDP parameter views into its contiguous buffer,
`main_grad` views, the distributed optimizer's shard views, Adam's states) stays the same object,
only the bytes under it leave the device. This is verl's approach for colocated Megatron roles
(resize the storage to 0, keep a host copy, resize back and copy in), done here at the storage
level so aliases are handled once:

    off = HostOffload()
    off.offload(keep=[params, optimizer states...], discard=[grad buffers])   # device storages -> 0 bytes
    ...                                                                       # another role uses the GPU
    off.reload()                                                              # same tensors, same values

- keep: their values are copied to host (pinned on CUDA) and copied back on reload.
- discard: their values are dropped (gradient buffers: zeroed at the start of every step anyway) and
  come back zero-filled.
A storage reachable from both lists is kept. Storages are deduplicated by address, so a buffer with
many views is copied once.
"""

from __future__ import annotations

from typing import Iterable

import torch


def _as_bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (tensor copies work across devices)."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    out = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.nbytes() > 0:
            out.setdefault(s.data_ptr(), s)
    return out


class HostOffload:
    def __init__(self):
        self._held: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []  # (storage, nbytes, host)
        # host buffers by storage identity, reused from one offload to the next (pinned allocations
        # are slow; the storages are the same objects every time, only resized)
        self._host_bufs: dict[int, torch.Tensor] = {}
        self.offloaded = False
        self.device_bytes_freed = 0

    def offload(self, keep: Iterable[torch.Tensor], discard: Iterable[torch.Tensor] = ()) -> int:
        """Free the device storages of `keep` (values saved to host) and `discard` (values dropped).
        Returns the bytes freed."""
        if self.offloaded:
            raise RuntimeError("HostOffload.offload() called twice without a reload()")
        kept = _storages(keep)
        dropped = {k: s for k, s in _storages(discard).items() if k not in kept}
        live = {s._cdata for s in kept.values()}  # forget buffers of storages that are gone (e.g. a reloaded optimizer)
        self._host_bufs = {k: v for k, v in self._host_bufs.items() if k in live}
        freed = 0
        for ptr, s in list(kept.items()) + list(dropped.items()):
            n = s.nbytes()
            host = None
            if ptr in kept:
                host = self._host_bufs.get(s._cdata)
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=s.device.type == "cuda")
                    self._host_bufs[s._cdata] = host
                host.copy_(_as_bytes(s))
            s.resize_(0)
            self._held.append((s, n, host))
            freed += n
        self.offloaded = True
        self.device_bytes_freed = freed
        return freed

    @property
    def host_bytes(self) -> int:
        """Bytes now held in host copies (0 when nothing is offloaded)."""
        return sum(n for _, n, host in self._held if host is not None)

    def reload(self) -> int:
        """Re-allocate every freed storage in place and restore its values (or zeros)."""
        if not self.offloaded:
            return 0
        restored = 0
        for s, n, host in self._held:
            s.resize_(n)
            if host is not None:
                _as_bytes(s).copy_(host)
            else:
                _as_bytes(s).zero_()
            restored += n
        if any(s.device.type == "cuda" for s, _, _ in self._held):
            torch.cuda.synchronize()
        self._held = []
        self.offloaded = False
        return restored
