"""Streaming safetensors I/O without mmap: read one tensor at a time straight into a fresh tensor
(`os.pread`-style, so resident memory is exactly the tensors alive, never file pages of a mapped
shard), and write shards whose headers are planned up front, each tensor written at its own offset
as it arrives (any order). Format: 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from megappo.conversion.errors import ConvertError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 64 << 20  # bytes per read/write syscall


def _bytes_view(t: torch.Tensor):
    """A writable flat uint8 memoryview over a contiguous tensor's data (no copy)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple
    begin: int  # absolute file offset of the data
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, data start offset); ConvertError on anything malformed."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ConvertError(f"corrupt safetensors file {path}: {size} bytes, too short for a header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise ConvertError(f"corrupt safetensors file {path}: header length {n} exceeds the file ({size} bytes)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ConvertError(f"missing safetensors file {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"corrupt safetensors file {path}: header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"corrupt safetensors file {path}: header is not a JSON object")
    start = 8 + n
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = info["data_offsets"]
            dt = DTYPES[info["dtype"]]
            numel = math.prod(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"corrupt safetensors file {path}: bad header entry for {name!r}") from None
        if e - b != numel * torch.empty((), dtype=dt).element_size() or b < 0:
            raise ConvertError(f"corrupt safetensors file {path}: {name} spans {e - b} bytes for shape {info['shape']} {info['dtype']}")
        end = max(end, e)
    if start + end != size:
        raise ConvertError(f"corrupt safetensors file {path}: data section is {size - start} bytes, header says {end} (truncated?)")
    return header, start


class SafetensorsDir:
    """All tensors of a HF model dir (sharded with an index, or plain *.safetensors files), by name."""

    def __init__(self, model_dir):
        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        files: list[Path]
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConvertError(f"corrupt index {index}: no weight_map") from None
            files = sorted({d / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise ConvertError(f"missing safetensors file {f} (listed in {index.name})")
        else:
            files = sorted(d.glob("*.safetensors"))
            if not files:
                other = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
                hint = f" (found {', '.join(other[:3])}: only safetensors are read)" if other else ""
                raise ConvertError(f"no *.safetensors in {d}{hint}")
            weight_map = None
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            header, start = read_header(f)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if weight_map is not None and weight_map.get(name) != f.name:
                    continue
                b, e = info["data_offsets"]
                self.tensors[name] = TensorInfo(name, f, DTYPES[info["dtype"]], tuple(info["shape"]), start + b, e - b)
        if weight_map is not None:
            lost = [n for n in weight_map if n not in self.tensors]
            if lost:
                raise ConvertError(f"corrupt checkpoint {d}: {lost[0]} is listed in {index.name} but not in {weight_map[lost[0]]}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def get(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Read one tensor (into `out` if given: a contiguous tensor of that shape and dtype)."""
        ti = self.tensors[name]
        t = torch.empty(ti.shape, dtype=ti.dtype) if out is None else out
        if t.dtype != ti.dtype or tuple(t.shape) != ti.shape:
            raise ValueError(f"{name}: out is {tuple(t.shape)} {t.dtype}, file holds {ti.shape} {ti.dtype}")
        if ti.nbytes:
            buf = _bytes_view(t)
            with open(ti.file, "rb", buffering=0) as f:
                done = 0
                while done < ti.nbytes:
                    n = os.preadv(f.fileno(), [buf[done:done + _CHUNK]], ti.begin + done)
                    if n <= 0:
                        raise ConvertError(f"corrupt safetensors file {ti.file}: short read of {name}")
                    done += n
        return t


def parse_size(text: str) -> int:
    s = str(text).strip().upper()
    for unit, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


class ShardedWriter:
    """HF-style sharded safetensors (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`).
    The full tensor list (name, shape, dtype) is given up front; `write(name, tensor)` in any order."""

    def __init__(self, out_dir, specs: Iterable[tuple[str, tuple, torch.dtype]], max_shard_bytes: int,
                 metadata: Optional[dict] = None):
        self.dir = Path(out_dir)
        specs = list(specs)
        shards: list[list[tuple[str, tuple, torch.dtype, int]]] = [[]]
        size = 0
        for name, shape, dtype in specs:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        n = len(shards)
        self.where: dict[str, tuple[Path, int, int, tuple, torch.dtype]] = {}
        self.pending = set()
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header = {"__metadata__": {"format": "pt", **(metadata or {})}}
            off = 0
            for name, shape, dtype, nbytes in shard:
                header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
                off += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            path = self.dir / fname
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                f.truncate(8 + len(raw) + off)
            start = 8 + len(raw)
            for name, shape, dtype, nbytes in shard:
                b = header[name]["data_offsets"][0]
                self.where[name] = (path, start + b, nbytes, shape, dtype)
                self.pending.add(name)
                weight_map[name] = fname
            total += off
        self.index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        self.total_bytes = total

    def write(self, name: str, t: torch.Tensor) -> int:
        if name not in self.where:
            raise KeyError(f"{name} is not in the planned shards")
        path, begin, nbytes, shape, dtype = self.where[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ConvertError(f"shape mismatch for {name}: planned {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
        t = t.contiguous()
        buf = _bytes_view(t)
        with open(path, "r+b", buffering=0) as f:
            done = 0
            while done < nbytes:
                done += os.pwritev(f.fileno(), [buf[done:done + _CHUNK]], begin + done)
        self.pending.discard(name)
        return nbytes

    def finish(self) -> None:
        if self.pending:
            raise ConvertError(f"export incomplete: {len(self.pending)} tensors never written, e.g. {sorted(self.pending)[0]}")
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(self.index, indent=2, sort_keys=True) + "\n")
