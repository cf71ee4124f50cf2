"""Before any work: will the run fit? An estimate of peak memory and peak cache disk from the
model's shapes (the safetensors headers, nothing loaded), checked against what the machine has.

``estimate_onnx_build`` models the ORT path (``harp-trt build --backend ort``): export and rewrite
(fp32 weights, or the checkpoint's width for a compact run: ``harp_trt.compact``), the staged graph
and the engine, with intermediates a later stage consumed dropped unless they are kept. Its
factors were fitted on the runs in docs/results-scale.md ("Large models"): the estimate is meant to be
a little above what was measured, not exact (Qwen2-1.5B int4: 4.0 GB RSS and 8.2 GB disk estimated,
3.6 and 7.6 measured; Qwen2-7B: 13.9 GB and 40.5 GB estimated, 12.2 and 37.3 measured)."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .device import available_memory
from .errors import ResourceError

__all__ = ["Shapes", "Estimate", "read_shapes", "estimate_onnx_build", "free_resources", "free_disk", "check_fits"]

_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
GB = 1e9


@dataclass(frozen=True)
class Shapes:
    params: int          # every tensor's values
    stored_bytes: int    # at the checkpoint's dtypes
    matrix_params: int   # values of 2-D tensors (the MatMul weights and the embedding)
    embed_params: int    # the embedding table (vocab x hidden), kept fp32 for the Gather
    tied: bool           # the LM head reads the embedding
    half: bool           # every floating tensor is bf16/fp16 (a compact run stores it so)
    num_layers: int = 1


def read_shapes(folder: str | os.PathLike) -> Shapes:
    """The figures an estimate needs, from the safetensors headers and config.json."""
    from .weights import read_header

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    params = stored = matrix = 0
    half = True
    for f in sorted(folder.glob("*.safetensors")):
        for name, v in read_header(f)[0].items():
            if name == "__metadata__":
                continue
            n = 1
            for d in v["shape"]:
                n *= int(d)
            params += n
            stored += n * _BYTES.get(v["dtype"], 4)
            matrix += n if len(v["shape"]) == 2 else 0
            half &= v["dtype"] in ("BF16", "F16") or not v["dtype"].startswith(("F", "BF"))
    embed = int(cfg.get("vocab_size", 0)) * int(cfg.get("hidden_size", 0))
    return Shapes(params, stored, matrix, embed, bool(cfg.get("tie_word_embeddings", False)), half,
                  max(1, int(cfg.get("num_hidden_layers", 1))))


@dataclass(frozen=True)
class Estimate:
    peak_rss: int
    peak_disk: int
    path: str

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_onnx_build(s: Shapes, bits: int, block_size: int, compact: bool, keep_intermediates: bool) -> Estimate:
    """Peak RSS and peak cache disk of export -> rewrite -> ORT build (calibration apart: it picks
    its own placement). ``bits`` 0 = an fp32 engine."""
    graph = 2 * s.params if compact and s.half else 4 * s.params           # export and rewrite, each
    head = s.embed_params if s.tied else 0                                  # a tied head's own copy
    if bits:
        weights = (s.matrix_params - s.embed_params + head) * (bits / 8 + 4 / block_size)
        engine = weights + 4 * s.embed_params + 4 * (s.params - s.matrix_params)
    else:
        engine = 4 * (s.params + head)
    # the export is dropped once the rewrite has read it (unless kept); the engine is written
    # twice (the staged graph, then ORT's optimized one)
    # a compact run's probe (~5 layers): its checkpoint folder, its export and the rewritten copy
    probe = 3 * graph * min(1.0, 5 / s.num_layers) if compact else 0
    disk = max(2 * graph + probe, graph + 2 * engine) if not keep_intermediates else 2 * graph + probe + 2 * engine
    if compact:  # the engine's ORT sessions, or (7B, measured 12.2 GB) the run's other steps
        rss = max(1.6 * engine, 0.85 * s.stored_bytes) + 1.0 * GB
    else:        # one ORT session of the whole fp32 graph verifies the rewrite
        rss = 1.2 * 4 * s.params + 1.0 * GB
    return Estimate(int(rss), int(disk * 1.05), "compact" if compact else "fp32")


def free_disk(path: str | os.PathLike) -> int:
    """Free bytes on the file system ``path`` will be on (its nearest existing parent's)."""
    p = Path(path)
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def free_resources(cache: str | os.PathLike) -> tuple[int, int]:
    """(available memory, free disk under ``cache``) in bytes."""
    return available_memory("cpu"), free_disk(cache)


def _size(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def check_fits(est: Estimate, cache: str | os.PathLike, what: str) -> dict:
    """Raise ResourceError (exit 2) when ``est`` exceeds the available memory or free disk."""
    mem, disk = free_resources(cache)
    other = "" if est.path == "compact" else ", or use --quant int4 (compact intermediates, the streamed path)"
    if est.peak_disk > disk:
        raise ResourceError(f"{what} needs ~{_size(est.peak_disk)} of disk under {cache} at its peak "
                            f"({est.path} path), {_size(disk)} are free",
                            f"free disk or pass --workdir on a larger disk{other}")
    if est.peak_rss > mem:
        raise ResourceError(f"{what} needs ~{_size(est.peak_rss)} of memory at its peak ({est.path} path), "
                            f"{_size(mem)} are available", f"stop other jobs{other}")
    return {**est.to_dict(), "free_memory": mem, "free_disk": disk}
