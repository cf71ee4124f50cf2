"""Safetensors read and written one tensor at a time, so that no stage holds a whole model.

``WeightReader`` opens a Hugging Face folder (one ``*.safetensors`` file or a sharded set with
``model.safetensors.index.json``) and reads single tensors, or a row range of one, with plain
``readinto`` calls: no memory map stays resident, so the process holds exactly the tensors it
keeps. ``meta(name)`` returns a shape-only tensor for dry runs.

``SafetensorsWriter`` writes a file whose layout (names, dtypes, shapes) is planned first, then
accepts the tensors in any order: a converter can run once on meta tensors to plan every output
file and once on real tensors to fill them, holding one layer at a time. The files are standard
safetensors (8-byte little-endian header length, JSON header, packed data) and are read back by the
``safetensors`` library in the tests."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from .errors import CorruptWeightsError

__all__ = ["WeightReader", "SafetensorsWriter", "TensorSpec", "ST_DTYPES", "dtype_code", "read_header", "hf_config"]

# safetensors dtype codes <-> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CODES = {v: k for k, v in ST_DTYPES.items()}


def hf_config(folder: str | Path):
    """The Hugging Face config of a checkpoint folder (never runs remote code)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _CODES[dtype]
    except KeyError:
        raise CorruptWeightsError(f"dtype {dtype} has no safetensors code") from None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int   # absolute byte offset in the file
    end: int


def read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header length beyond end of file")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptWeightsError(f"{path} is not a safetensors file ({e})") from None
    return header, 8 + n


class WeightReader:
    """Tensors of a safetensors folder (or file), read on demand. Never memory-maps."""

    def __init__(self, source: str | os.PathLike | Iterable[str | os.PathLike]):
        if isinstance(source, (str, os.PathLike)):
            p = Path(source)
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        else:
            files = [Path(f) for f in source]
        if not files:
            raise CorruptWeightsError(f"no *.safetensors files in {source}",
                                      "harp-trt loads safetensors only (never pickles)")
        self.files = files
        self.entries: dict[str, _Entry] = {}
        for f in files:
            header, data_start = read_header(f)
            for name, v in header.items():
                if name == "__metadata__":
                    continue
                try:
                    dt = ST_DTYPES[v["dtype"]]
                except KeyError:
                    raise CorruptWeightsError(f"{f}: tensor {name} has unsupported dtype {v.get('dtype')}") from None
                b, e = v["data_offsets"]
                self.entries[name] = _Entry(f, dt, tuple(v["shape"]), data_start + b, data_start + e)

    # ---- what is there ---------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def spec(self, name: str) -> TensorSpec:
        e = self._entry(name)
        return TensorSpec(name, e.dtype, e.shape)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of every tensor, at its stored dtype or cast to ``dtype`` (floating tensors only)."""
        total = 0
        for name, e in self.entries.items():
            dt = dtype if dtype is not None and e.dtype.is_floating_point else e.dtype
            total += TensorSpec(name, dt, e.shape).nbytes
        return total

    def _entry(self, name: str) -> _Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise CorruptWeightsError(f"tensor {name!r} is not in {self.files[0].parent}",
                                      "the checkpoint does not match its config.json") from None

    # ---- reading ---------------------------------------------------------------------------
    def meta(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        e = self._entry(name)
        return torch.empty(e.shape, dtype=dtype or e.dtype, device="meta")

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
            rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read one tensor (or rows ``[start, stop)`` of its first axis), cast to ``dtype``."""
        e = self._entry(name)
        shape = list(e.shape)
        begin, end = e.begin, e.end
        if rows is not None:
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"rows {rows} out of range for {name} {tuple(shape)}")
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + start * row_bytes, begin + stop * row_bytes
            shape[0] = stop - start
        t = torch.empty(shape, dtype=e.dtype)
        if end > begin:
            buf = t.reshape(-1).view(torch.uint8).numpy()
            with open(e.file, "rb") as f:
                f.seek(begin)
                got = f.readinto(memoryview(buf))
            if got != end - begin:
                raise CorruptWeightsError(f"{e.file}: tensor {name} is truncated ({got} of {end - begin} bytes)",
                                          "the download or copy was probably cut short; fetch it again")
        if dtype is not None and dtype != t.dtype:
            t = t.to(dtype)
        return t if str(device) == "cpu" else t.to(device)


class SafetensorsWriter:
    """A safetensors file laid out from ``specs`` up front; ``write`` fills one tensor at a time.

    ``close()`` (or leaving the ``with`` block) checks that every planned tensor was written."""

    def __init__(self, path: str | os.PathLike, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs: dict[str, TensorSpec] = {}
        for s in specs:
            if s.name in self.specs:
                raise ValueError(f"tensor {s.name!r} planned twice for {self.path.name}")
            self.specs[s.name] = s
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._offsets: dict[str, int] = {}
        for name, s in self.specs.items():
            header[name] = {"dtype": dtype_code(s.dtype), "shape": list(s.shape),
                            "data_offsets": [offset, offset + s.nbytes]}
            self._offsets[name] = offset
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
        self._data_start = 8 + len(raw)
        self._written: set[str] = set()
        self._f = open(self.path, "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        self._f.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        s = self.specs.get(name)
        if s is None:
            raise ValueError(f"{self.path.name}: tensor {name!r} was not planned")
        if name in self._written:
            raise ValueError(f"{self.path.name}: tensor {name!r} written twice")
        if tensor.dtype != s.dtype or tuple(tensor.shape) != s.shape:
            raise ValueError(f"{self.path.name}: {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"planned {s.dtype} {s.shape}")
        t = tensor.detach().to("cpu").contiguous()
        self._f.seek(self._data_start + self._offsets[name])
        if t.numel():
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._written.add(name)

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        missing = sorted(set(self.specs) - self._written)
        if missing:
            raise ValueError(f"{self.path.name}: {len(missing)} planned tensors never written, e.g. {missing[:3]}")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._f.close()
            return
        self.close()
