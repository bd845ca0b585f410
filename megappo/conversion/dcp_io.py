"""megatron-core dist_checkpointing (torch_dist backend) written and read one tensor at a time from a
single process, with torch.distributed.checkpoint's public planner API. No process group, no
megatron model, no T*P processes.

A torch_dist checkpoint is a torch DCP checkpoint (`.metadata` + `__*_*.distcp`) of GLOBAL tensors
keyed by megatron's sharded keys, plus megatron's `metadata.json` and `common.pt`. Pipeline-stacked
layer parameters are one key `decoder.layers.<suffix>` of global shape [num_layers, ...] whose chunks
are the single layers (exactly how megatron's TransformerBlock declares them), so every rank of every
TP/PP/VPP layout reads its shard out of them.

Writing: `save_lazy(dir, items, produce)`: `produce(item)` builds one chunk when the writer asks for
it; the previously produced tensor's storage is released right then (torch's writer keeps references
to every tensor it wrote until the file is closed), so resident memory stays ~ one chunk in flight.
Reading: `CheckpointReader.read(key, offsets, sizes)` -> one region (any chunking on disk, e.g. the
per-TP-rank chunks of a training checkpoint), assembled by DCP's own resharding helper.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megappo.conversion.errors import ConvertError, read_json

# megatron's dist_checkpointing config file (megatron.core.dist_checkpointing.core.CheckpointingConfig)
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


@dataclass(frozen=True)
class Item:
    """One chunk to write: a whole tensor (layer None) or layer `layer` of a stacked [L, ...] key,
    or (shape None) an empty `_extra_state` ShardedObject."""

    key: str
    shape: Optional[tuple]  # chunk shape without the layer axis
    dtype: Optional[torch.dtype]
    layer: Optional[int] = None
    num_layers: int = 0
    payload: object = None  # the producer's handle (e.g. the megatron parameter name)

    @property
    def fqn(self) -> str:
        if self.shape is None:  # megatron ShardedObject unique key: {key}/shard_{offset}_{global shape}
            return f"{self.key}/shard_{self.layer}_{self.num_layers}"
        return self.key

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            return 0
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def write_item(self) -> WriteItem:
        if self.shape is None:
            return WriteItem(index=MetadataIndex(self.fqn), type=WriteItemType.BYTE_IO)
        if self.layer is None:
            offsets, sizes, glob = (0,) * len(self.shape), self.shape, self.shape
            wtype = WriteItemType.TENSOR
        else:
            offsets = (self.layer,) + (0,) * len(self.shape)
            sizes = (1,) + tuple(self.shape)
            glob = (self.num_layers,) + tuple(self.shape)
            wtype = WriteItemType.SHARD
        return WriteItem(
            index=MetadataIndex(self.key, torch.Size(offsets)),
            type=wtype,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=self.dtype),
                size=torch.Size(glob),
            ),
        )


def _empty_extra_state() -> io.BytesIO:
    """What megatron stores for a ShardedObject holding None (local-spec layers' `_extra_state`)."""
    buf = io.BytesIO()
    torch.save([None], buf)
    buf.seek(0)
    return buf


class _LazySavePlanner(DefaultSavePlanner):
    def __init__(self, items: list[Item], produce: Callable[[Item], torch.Tensor], on_done: Callable[[Item], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = {}
        for it in items:
            self._items[(it.fqn, tuple(it.write_item().index.offset or ()))] = it
        self._produce = produce
        self._on_done = on_done
        self._last: Optional[torch.Tensor] = None
        self._last_item: Optional[Item] = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([it.write_item() for it in self._items.values()])
        return self.plan

    def _release_previous(self) -> None:
        if self._last is not None:
            try:
                self._last.untyped_storage().resize_(0)
            except RuntimeError:
                pass  # not resizable (cannot happen for tensors we allocate); freed by refcount later
            self._last = None
        if self._last_item is not None:
            self._on_done(self._last_item)
            self._last_item = None

    def resolve_data(self, write_item: WriteItem):
        self._release_previous()
        it = self._items[(write_item.index.fqn, tuple(write_item.index.offset or ()))]
        if it.shape is None:
            self._on_done(it)
            return _empty_extra_state()
        t = self._produce(it)
        if tuple(t.shape) != tuple(it.shape) or t.dtype != it.dtype:
            raise ConvertError(f"shape mismatch for {it.payload}: built {list(t.shape)} {t.dtype}, expected {list(it.shape)} {it.dtype}")
        t = t.contiguous()
        if it.layer is not None:
            t = t.unsqueeze(0)
        self._last, self._last_item = t, it
        return t

    def finish(self) -> None:
        self._release_previous()


def save_lazy(out_dir, items: list[Item], produce: Callable[[Item], torch.Tensor],
              on_done: Callable[[Item], None] = lambda it: None) -> None:
    """Write a megatron torch_dist checkpoint of `items` into out_dir (which must exist)."""
    from torch.distributed.checkpoint import FileSystemWriter

    out = Path(out_dir)
    planner = _LazySavePlanner(items, produce, on_done)
    writer = FileSystemWriter(str(out), single_file_per_rank=True, sync_files=False, thread_count=1)
    with warnings.catch_warnings():  # "torch.distributed ... uninitialized ... single process": that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    planner.finish()
    torch.save({}, out / "common.pt")  # megatron's non-sharded ("common") state: nothing for model weights
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


# ---- reading ------------------------------------------------------------------------------------


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class _RegionLoadPlanner(LoadPlanner):
    def __init__(self, key: str, md: TensorStorageMetadata, offsets, sizes, target: torch.Tensor):
        self.key, self.md, self.target = key, md, target
        self.chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        self.covered = 0

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.md, [self.chunk]))

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise ConvertError(f"{self.key} is an object in the checkpoint, not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return _narrow(self.target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        n = 1
        for s in read_item.lengths:
            n *= s
        self.covered += n


class CheckpointReader:
    """Random access to the tensors of a megatron torch_dist checkpoint dir."""

    def __init__(self, ckpt_dir):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = Path(ckpt_dir)
        cfg = read_json(self.dir / "metadata.json",
                        f"{self.dir} is not a megatron dist checkpoint (no metadata.json)")
        if cfg.get("sharded_backend") != "torch_dist":
            raise ConvertError(f"{self.dir}: sharded_backend {cfg.get('sharded_backend')!r} is not supported (only torch_dist)")

        class _Cached(FileSystemReader):
            _md = None

            def read_metadata(self, *a, **k):
                if self._md is None:
                    self._md = super().read_metadata(*a, **k)
                return self._md

        self._reader = _Cached(str(self.dir))
        try:
            self.metadata = self._reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling / IO problem: one line
            raise ConvertError(f"corrupt checkpoint {self.dir}: cannot read .metadata ({e.__class__.__name__}: {e})") from None
        sizes = {}
        for idx, info in self.metadata.storage_data.items():
            f = self.dir / info.relative_path
            if info.relative_path not in sizes:
                sizes[info.relative_path] = f.stat().st_size if f.exists() else -1
            if sizes[info.relative_path] < 0:
                raise ConvertError(f"corrupt checkpoint {self.dir}: data file {info.relative_path} is missing")
            if info.offset + info.length > sizes[info.relative_path]:
                raise ConvertError(f"corrupt checkpoint {self.dir}: {info.relative_path} is truncated "
                                   f"({sizes[info.relative_path]} bytes, {idx.fqn} ends at {info.offset + info.length})")

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        return {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def objects(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]

    def read(self, key: str, offsets=None, sizes=None) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of global tensor `key` (default: all of it)."""
        md = self.tensors()[key]
        offsets = tuple(offsets) if offsets is not None else (0,) * len(md.size)
        sizes = tuple(sizes) if sizes is not None else tuple(md.size)
        target = torch.empty(sizes, dtype=md.properties.dtype)
        planner = _RegionLoadPlanner(key, md, offsets, sizes, target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        if planner.covered != target.numel():
            raise ConvertError(f"corrupt checkpoint {self.dir}: {key} region {list(offsets)}+{list(sizes)} is only "
                               f"partly stored ({planner.covered}/{target.numel()} elements)")
        return target
