"""DataProto: the batch container passed between the driver and the workers (verl-style).

A DataProto holds
- `batch`: named torch tensors that all share dim 0 (the batch dim);
- `non_tensor_batch`: named numpy arrays (dtype object allowed: strings, dicts, ...) of the same length;
- `meta_info`: free-form metadata, never split: every chunk / slice gets a (shallow) copy.

Every operation returns a new DataProto (only `pop` also changes `self`) and every result is
validated: a tensor or array whose length differs from the others raises a one-line ValueError
naming the key and both sizes. Tensors are not copied unless the operation has to (slicing gives
views, as torch does). It is a plain picklable object, so it travels through Ray as is, and only
with CPU tensors: pickling one that holds a device tensor raises (workers hand the driver CPU copies;
a CUDA tensor would otherwise be unpickled onto a GPU the receiver may not have).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["DataProto"]

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]


def _to_object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array with one element per item (lists of lists stay one row per item)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _values_equal(a: Any, b: Any) -> bool:
    """Equality for tensors (shape, dtype, values; NaN == NaN), numpy arrays and plain values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.to(a.device)
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return False
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel().tolist(), b.ravel().tolist()))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - uncomparable values are simply "not equal"
        return False


def _as_list(keys: str | Iterable[str] | None) -> list[str] | None:
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    return list(keys)


@dataclass(eq=False)
class DataProto:
    """Named tensors + non-tensor arrays sharing the batch dim, plus unsplit `meta_info`."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction / checks
    def __post_init__(self) -> None:
        self.batch = dict(self.batch or {})
        self.non_tensor_batch = {
            k: _to_object_array(v) if isinstance(v, (list, tuple)) else v
            for k, v in dict(self.non_tensor_batch or {}).items()
        }
        self.meta_info = dict(self.meta_info or {})
        self.check()

    def __getstate__(self) -> dict:
        off = [f"{k} ({v.device})" for k, v in self.batch.items() if v.device.type != "cpu"]
        if off:
            raise ValueError(f"DataProto leaving this process holds device tensors: {', '.join(off)}; move them to "
                             "the CPU first (`.cpu()`): the driver and Ray's object store take CPU tensors only")
        state = self.__dict__.copy()
        # a pickled view carries its whole storage: a chunk of a batch would send every row to every worker
        state["batch"] = {k: v.clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size() else v
                          for k, v in self.batch.items()}
        return state

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> "DataProto":
        """Build from plain dicts; lists in `non_tensors` become 1-D object arrays."""
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta_info or {}))

    def check(self) -> int:
        """Validate types and that all tensors/arrays share dim 0; return that size (0 when empty)."""
        size: int | None = None
        first = ""
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"DataProto.batch[{key!r}] must be a torch.Tensor, got {type(value).__name__} "
                    "(put numpy/python values in non_tensor_batch)"
                )
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"DataProto.non_tensor_batch[{key!r}] must be a numpy array (or a list on construction), "
                    f"got {type(value).__name__}"
                )
        for kind, data in (("batch", self.batch), ("non_tensor_batch", self.non_tensor_batch)):
            for key, value in data.items():
                if value.ndim == 0:
                    raise ValueError(f"DataProto: {kind}[{key!r}] is 0-dim; it needs a batch dim 0")
                n = int(value.shape[0])
                if size is None:
                    size, first = n, key
                elif n != size:
                    raise ValueError(
                        f"DataProto: {kind}[{key!r}] has {n} rows but {first!r} has {size} "
                        "(all tensors and non-tensor arrays must share dim 0)"
                    )
        return size or 0

    def __len__(self) -> int:
        return self.check()

    def _new(self, batch: dict, non_tensor: dict, meta_info: dict | None = None) -> "DataProto":
        return DataProto(batch, non_tensor, dict(self.meta_info if meta_info is None else meta_info))

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.batch.items())
        arrays = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.non_tensor_batch.items())
        return (
            f"DataProto(len={len(self)}, batch={{{tensors}}}, non_tensor_batch={{{arrays}}}, "
            f"meta_info_keys={sorted(map(str, self.meta_info))})"
        )

    # ------------------------------------------------------------------ indexing
    def _index_arrays(self, index: Any) -> tuple[torch.Tensor, np.ndarray]:
        """Normalise an index tensor / array / list into (torch long, numpy int64) row indices."""
        if isinstance(index, torch.Tensor):
            index = index.detach().cpu().numpy()
        idx = np.asarray(index)
        if idx.ndim != 1:
            raise IndexError(f"DataProto index must be 1-D, got shape {idx.shape}")
        if idx.dtype == bool:
            if idx.shape[0] != len(self):
                raise IndexError(f"DataProto boolean mask has {idx.shape[0]} entries but the batch has {len(self)} rows")
            idx = np.nonzero(idx)[0]
        elif idx.size == 0:
            idx = idx.astype(np.int64)
        elif not np.issubdtype(idx.dtype, np.integer):
            raise IndexError(f"DataProto index must hold integers or booleans, got dtype {idx.dtype}")
        idx = idx.astype(np.int64)
        n = len(self)
        if idx.size and (idx.max() >= n or idx.min() < -n):
            raise IndexError(f"DataProto index out of range for a batch of {n} rows")
        return torch.from_numpy(idx), idx

    def __getitem__(self, item: Index | str) -> "DataProto | torch.Tensor | np.ndarray":
        """Rows or a column.

        - str: the tensor / array stored under that key;
        - int: a DataProto of length 1 (negative ints count from the end);
        - slice: a DataProto of views;
        - index tensor / numpy array / list (ints or a bool mask): a DataProto of the selected rows.
        """
        if isinstance(item, str):
            if item in self.batch:
                return self.batch[item]
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            raise KeyError(f"{item!r} is not in this DataProto (keys: {self._all_keys()})")
        n = len(self)  # validates first: slicing a ragged batch would hide the mismatch
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(item)
            if not -n <= i < n:
                raise IndexError(f"DataProto index {i} out of range for a batch of {n} rows")
            i %= n
            item = slice(i, i + 1)
        if isinstance(item, slice) and (item.step or 1) < 0:  # torch has no negative-step slicing
            item = np.arange(n)[item]
        if isinstance(item, slice):
            return self._new(
                {k: v[item] for k, v in self.batch.items()},
                {k: v[item] for k, v in self.non_tensor_batch.items()},
            )
        t_idx, np_idx = self._index_arrays(item)
        return self._new(
            {k: v[t_idx.to(v.device)] for k, v in self.batch.items()},
            {k: v[np_idx] for k, v in self.non_tensor_batch.items()},
        )

    def _all_keys(self) -> list[str]:
        return list(self.batch) + list(self.non_tensor_batch)

    # ------------------------------------------------------------------ key operations
    def select(
        self,
        batch_keys: str | Iterable[str] | None = None,
        non_tensor_keys: str | Iterable[str] | None = None,
        meta_info_keys: str | Iterable[str] | None = None,
    ) -> "DataProto":
        """Keep only the named keys; `None` for a group keeps all of that group."""
        self.check()

        def pick(src: dict, keys: list[str] | None, what: str) -> dict:
            if keys is None:
                return dict(src)
            missing = [k for k in keys if k not in src]
            if missing:
                raise KeyError(f"DataProto.select: {what} keys {missing} not found (have {list(src)})")
            return {k: src[k] for k in keys}

        return self._new(
            pick(self.batch, _as_list(batch_keys), "batch"),
            pick(self.non_tensor_batch, _as_list(non_tensor_keys), "non_tensor"),
            pick(self.meta_info, _as_list(meta_info_keys), "meta_info"),
        )

    def pop(
        self,
        batch_keys: str | Iterable[str] | None = None,
        non_tensor_keys: str | Iterable[str] | None = None,
        meta_info_keys: str | Iterable[str] | None = None,
    ) -> "DataProto":
        """Remove the named keys from `self` and return them as a new DataProto (`None` = none)."""
        self.check()
        groups = (
            (self.batch, _as_list(batch_keys) or [], "batch"),
            (self.non_tensor_batch, _as_list(non_tensor_keys) or [], "non_tensor"),
            (self.meta_info, _as_list(meta_info_keys) or [], "meta_info"),
        )
        for src, keys, what in groups:  # check everything first: a failed pop changes nothing
            missing = [k for k in keys if k not in src]
            if missing:
                raise KeyError(f"DataProto.pop: {what} keys {missing} not found (have {list(src)})")
        out = [{k: src.pop(k) for k in keys} for src, keys, _ in groups]
        return DataProto(*out)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> "DataProto":
        """Rename batch / non-tensor keys (`old_keys[i]` -> `new_keys[i]`)."""
        old, new = _as_list(old_keys) or [], _as_list(new_keys) or []
        if len(old) != len(new):
            raise ValueError(f"DataProto.rename: {len(old)} old keys but {len(new)} new keys")
        mapping = dict(zip(old, new))
        all_keys = self._all_keys()
        missing = [k for k in old if k not in all_keys]
        if missing:
            raise KeyError(f"DataProto.rename: keys {missing} not found (have {all_keys})")
        renamed = [mapping.get(k, k) for k in all_keys]
        dupes = sorted({k for k in renamed if renamed.count(k) > 1})
        if dupes:
            raise ValueError(f"DataProto.rename: would produce duplicate keys {dupes}")
        return self._new(
            {mapping.get(k, k): v for k, v in self.batch.items()},
            {mapping.get(k, k): v for k, v in self.non_tensor_batch.items()},
        )

    def union(self, other: "DataProto") -> "DataProto":
        """Merge the keys of both; a key present in both must hold equal values."""
        n_self, n_other = len(self), len(other)
        if self._all_keys() and other._all_keys() and n_self != n_other:
            raise ValueError(f"DataProto.union: batch sizes differ ({n_self} vs {n_other})")
        merged = []
        for what, a, b in (
            ("batch", self.batch, other.batch),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ):
            out = dict(a)
            for key, value in b.items():
                if key in out and not _values_equal(out[key], value):
                    raise ValueError(f"DataProto.union: {what}[{key!r}] differs between the two DataProtos")
                out.setdefault(key, value)
            merged.append(out)
        return DataProto(*merged)

    # ------------------------------------------------------------------ splitting / joining
    def chunk(self, n: int) -> list["DataProto"]:
        """Split into `n` equal chunks (len must be divisible by `n`)."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"DataProto.chunk: n must be a positive int, got {n!r}")
        size = len(self)
        if size % n:
            raise ValueError(
                f"DataProto.chunk: {size} rows are not divisible into {n} chunks; "
                f"call pad_to_divisor({n}) first (and unpad the results)"
            )
        step = size // n
        return [self[i * step:(i + 1) * step] for i in range(n)]

    def split(self, size: int) -> list["DataProto"]:
        """Chunks of `size` rows each (the last may be smaller)."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"DataProto.split: size must be a positive int, got {size!r}")
        return [self[i:i + size] for i in range(0, len(self), size)]

    @staticmethod
    def concat(items: Sequence["DataProto"]) -> "DataProto":
        """Concatenate along the batch dim; meta_info comes from the first item."""
        items = list(items)
        if not items:
            raise ValueError("DataProto.concat: need at least one DataProto")
        first = items[0]
        for i, d in enumerate(items[1:], start=1):
            d.check()
            if set(d.batch) != set(first.batch) or set(d.non_tensor_batch) != set(first.non_tensor_batch):
                raise ValueError(
                    f"DataProto.concat: item {i} has keys {sorted(d._all_keys())} "
                    f"but item 0 has {sorted(first._all_keys())}"
                )
        first.check()
        batch = {}
        for k in first.batch:
            try:
                batch[k] = torch.cat([d.batch[k] for d in items], dim=0)
            except RuntimeError as e:
                shapes = [tuple(d.batch[k].shape) for d in items]
                raise ValueError(f"DataProto.concat: cannot concatenate batch[{k!r}] with shapes {shapes}") from e
        non_tensor = {}
        for k in first.non_tensor_batch:
            try:
                non_tensor[k] = np.concatenate([d.non_tensor_batch[k] for d in items], axis=0)
            except ValueError as e:
                shapes = [d.non_tensor_batch[k].shape for d in items]
                raise ValueError(f"DataProto.concat: cannot concatenate non_tensor_batch[{k!r}] with shapes {shapes}") from e
        return DataProto(batch, non_tensor, dict(first.meta_info))

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Pad (repeating rows from the start, wrapping if needed) so len % divisor == 0.

        Returns (padded, pad_size); `padded.unpad(pad_size)` gives the original rows back."""
        if not isinstance(divisor, int) or divisor <= 0:
            raise ValueError(f"DataProto.pad_to_divisor: divisor must be a positive int, got {divisor!r}")
        n = len(self)
        pad_size = (-n) % divisor
        if pad_size == 0:
            return self[:], 0
        if n == 0:
            raise ValueError("DataProto.pad_to_divisor: cannot pad an empty DataProto")
        return DataProto.concat([self, self[np.arange(pad_size) % n]]), pad_size

    def unpad(self, pad_size: int) -> "DataProto":
        """Drop the last `pad_size` rows (the inverse of `pad_to_divisor`)."""
        n = len(self)
        if not isinstance(pad_size, int) or not 0 <= pad_size <= n:
            raise ValueError(f"DataProto.unpad: pad_size must be an int in [0, {n}], got {pad_size!r}")
        return self[: n - pad_size]

    def repeat(self, n: int, interleave: bool = True) -> "DataProto":
        """Repeat rows `n` times: interleave -> [r0,r0,r1,r1] (n samples per prompt); else the batch tiled."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"DataProto.repeat: n must be a positive int, got {n!r}")
        self.check()
        if interleave:
            batch = {k: v.repeat_interleave(n, dim=0) for k, v in self.batch.items()}
            non_tensor = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(n, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            non_tensor = {k: np.tile(v, (n,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()}
        return self._new(batch, non_tensor)

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> "DataProto":
        """Rows permuted by `indices` (must be a permutation of range(len))."""
        _, idx = self._index_arrays(indices)
        n = len(self)
        if idx.shape[0] != n or not np.array_equal(np.sort(idx % max(n, 1)), np.arange(n)):
            raise ValueError(f"DataProto.reorder: indices must be a permutation of range({n})")
        return self[idx]

    def to(self, device: str | torch.device) -> "DataProto":
        """Tensors moved to `device` (non-tensor arrays unchanged)."""
        self.check()
        return self._new({k: v.to(device) for k, v in self.batch.items()}, dict(self.non_tensor_batch))
