"""Move an engine's parameters, gradients and optimizer states to host memory between its phases,
and back, IN PLACE: every tensor object (megatron's DDP parameter views into its contiguous buffer,
`main_grad` views, the distributed optimizer's shard views, Adam's states) stays the same object,
only the bytes under it leave the device. This is verl's approach for colocated Megatron roles
(resize the storage to 0, keep a host copy, resize back and copy in), done here at the storage
level so aliases are handled once:

    off = HostOffload()
    off.offload({"params": (params, True), "optimizer": (states, True), "grads": (grad_buffers, False)})
    ...                                           # device storages -> 0 bytes; another role uses the GPU
    off.reload(["params"])                        # only the weights come back (e.g. for a weight sync)
    off.reload()                                  # everything: same tensors, same values

- keep=True: their values are copied to host (pinned on CUDA) and copied back on reload.
- keep=False: their values are dropped (gradient buffers: zeroed at the start of every step anyway)
  and come back zero-filled.
A storage reachable from several groups is kept (by the first group that keeps it). Storages are
deduplicated by address, so a buffer with many views is copied once. On CUDA an offload ends with
`torch.cuda.empty_cache()`, so the freed bytes return to the device, not just to PyTorch's cache.
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
        # (storage, nbytes, host copy or None, part) of every storage now off the device
        self._held: list[tuple[torch.UntypedStorage, int, torch.Tensor | None, str]] = []
        # host buffers by storage identity, reused from one offload to the next (pinned allocations
        # are slow; the storages are the same objects every time, only resized)
        self._host_bufs: dict[int, torch.Tensor] = {}
        self.device_bytes_freed = 0

    @property
    def offloaded(self) -> bool:
        """Something is off the device (after a partial reload, the other parts still are)."""
        return bool(self._held)

    def offload(self, groups: dict[str, tuple[Iterable[torch.Tensor], bool]]) -> int:
        """Free the device storages of every group {part: (tensors, keep)} still on the device: keep=True
        saves their values to host, keep=False drops them. A storage in several groups belongs to the
        first that keeps it. Returns the bytes freed."""
        storages: dict[int, tuple[torch.UntypedStorage, bool, str]] = {}
        for keep in (True, False):  # kept groups claim shared storages first
            for part, (tensors, k) in groups.items():
                if k == keep:
                    for ptr, st in _storages(tensors).items():
                        storages.setdefault(ptr, (st, keep, part))
        live = {st._cdata for st, keep, _ in storages.values() if keep} | \
            {st._cdata for st, _, host, _ in self._held if host is not None}
        self._host_bufs = {k: v for k, v in self._host_bufs.items() if k in live}  # e.g. a reloaded optimizer
        freed = 0
        for st, keep, part in storages.values():
            n = st.nbytes()
            host = None
            if keep:
                host = self._host_bufs.get(st._cdata)
                if host is None or host.numel() != n:
                    host = torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=st.device.type == "cuda")
                    self._host_bufs[st._cdata] = host
                host.copy_(_as_bytes(st))
            st.resize_(0)
            self._held.append((st, n, host, part))
            freed += n
        if any(st.device.type == "cuda" for st, _, _ in storages.values()):
            torch.cuda.synchronize()
            # resize_(0) frees into PyTorch's caching allocator only: give the memory back to the device,
            # so another process on the GPU (vLLM, a colocated role) can use it
            torch.cuda.empty_cache()
        self.device_bytes_freed = freed
        return freed

    @property
    def host_bytes(self) -> int:
        """Bytes now held in host copies (0 when nothing is offloaded)."""
        return sum(n for _, n, host, _ in self._held if host is not None)

    def reload(self, parts: Iterable[str] | None = None) -> int:
        """Re-allocate the freed storages of `parts` (None: all) in place and restore their values (or
        zeros for dropped ones); the other parts stay off the device."""
        wanted = None if parts is None else set(parts)
        restored, still = 0, []
        for st, n, host, part in self._held:
            if wanted is not None and part not in wanted:
                still.append((st, n, host, part))
                continue
            st.resize_(n)
            if host is not None:
                _as_bytes(st).copy_(host)
            else:
                _as_bytes(st).zero_()
            restored += n
        if any(st.device.type == "cuda" for st, _, _, _ in self._held):
            torch.cuda.synchronize()
        self._held = still
        return restored
