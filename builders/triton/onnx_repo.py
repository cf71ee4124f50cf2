"""Triton model for an ONNX Runtime graph (export, rewrite or ORT-engine artifact).

Layout written under the repository::

    <name>/config.pbtxt        backend onnxruntime, tensors read from the graph
    <name>/1/model.onnx        (+ its external-data file(s), hard-linked when possible)
    <name>/tokenizer/          tokenizer files for client.py (Triton skips non-numeric folders)

Batching decision: ``max_batch_size: 0`` and every tensor lists its batch dimension explicitly
(``dims: [ -1, 2, -1, 16 ]`` for a KV input). With ``max_batch_size > 0`` Triton would batch
requests by concatenating them on dimension 0, which needs every other dimension to agree; here
``attention_mask`` is [B, past+seq] and the KV inputs are [B, kv_heads, past, head_dim], so two
requests batch only when their prompt and cache lengths coincide, and the cache is the client's
state anyway (the model is stateless: each call sends ``past_key_values.*`` and gets ``present.*``
back). So the client chooses B itself, and Triton passes the tensors through unchanged.

The tensors are exactly the graph's inputs and outputs: names, element types and ranks, with -1 for
every dimension the graph leaves symbolic (batch, seq, past, total). A HARP-rewritten graph has no
``past_key_values.{i}.*`` / ``present.{i}.*`` for its pruned layers, so neither has the config."""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harp_trt.errors import GraphError, PreconditionError
from harp_trt.onnx_io import EXPORT_META_KEY, MODEL_FILE, kv_layers_of_names

from .pbtxt import ONNX_TO_TRITON, STAGE, Enum, render_pbtxt

__all__ = ["TensorSpec", "onnx_io", "external_data_files", "onnx_model_config", "write_onnx_model", "place_file"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str          # Triton symbol, e.g. TYPE_FP32
    dims: tuple[int, ...]   # -1 for a symbolic / unknown dimension

    def to_pbtxt(self) -> dict[str, Any]:
        return {"name": self.name, "data_type": Enum(self.data_type), "dims": list(self.dims)}


def _load(path: Path):
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends: not a model at all
        raise GraphError(STAGE, f"{path} is not a readable ONNX model ({type(e).__name__})",
                         "re-run the stage that wrote it; the file may be truncated") from None


def _spec(value, where: str) -> TensorSpec:
    tt = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise GraphError(STAGE, f"{where} {value.name!r} is not a tensor; Triton's onnxruntime backend "
                         "serves tensor inputs and outputs only")
    if tt.elem_type not in ONNX_TO_TRITON:
        raise GraphError(STAGE, f"{where} {value.name!r} has ONNX element type {tt.elem_type}, which Triton "
                         f"cannot carry; supported: {sorted(ONNX_TO_TRITON)}")
    if not tt.HasField("shape"):
        raise GraphError(STAGE, f"{where} {value.name!r} has no shape (not even a rank) in the graph",
                         "run onnx shape inference on the graph, or export it with output shapes")
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tt.shape.dim)
    return TensorSpec(value.name, ONNX_TO_TRITON[tt.elem_type], dims)


def onnx_io(path: Path) -> tuple[list[TensorSpec], list[TensorSpec], dict[str, Any]]:
    """The graph's inputs and outputs as Triton tensors, plus its ``harp_trt.export`` metadata.
    Weights are not loaded. Outputs without a shape get one from ONNX shape inference."""
    import onnx

    model = _load(path)
    init = {i.name for i in model.graph.initializer}
    graph_inputs = [v for v in model.graph.input if v.name not in init]  # old IRs list weights as inputs
    if any(not o.type.tensor_type.HasField("shape") for o in model.graph.output):
        model = onnx.shape_inference.infer_shapes(model)
    inputs = [_spec(v, "input") for v in graph_inputs]
    outputs = [_spec(v, "output") for v in model.graph.output]
    meta = {}
    for p in model.metadata_props:
        if p.key == EXPORT_META_KEY:
            try:
                meta = json.loads(p.value)
            except ValueError:
                meta = {}
    return inputs, outputs, meta


def external_data_files(path: Path) -> list[str]:
    """Relative locations of the external-data files the graph's initializers point to."""
    from onnx.external_data_helper import uses_external_data

    def tensors(graph):
        yield from graph.initializer
        for node in graph.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from tensors(g)

    model = _load(path)
    locs = []
    for t in tensors(model.graph):
        if uses_external_data(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc and loc not in locs:
                locs.append(loc)
    return locs


def onnx_model_config(name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], kind: str,
                      instances: int, threads: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": name, "backend": "onnxruntime", "default_model_filename": "model.onnx",
        "#0": "0: the client sends the batch dimension itself (see dims); Triton does not batch requests",
        "max_batch_size": 0,
        "input": [s.to_pbtxt() for s in inputs],
        "output": [s.to_pbtxt() for s in outputs],
        "instance_group": [{"count": instances, "kind": Enum(kind)}],
    }
    if threads:
        cfg["parameters"] = [{"key": "intra_op_thread_count", "value": {"string_value": str(threads)}}]
    return cfg


def place_file(src: Path, dst: Path, link: bool) -> str:
    """Hard-link (artifacts are immutable) or copy ``src`` to ``dst``; returns how."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)
            return "link"
        except OSError:
            pass
    shutil.copy2(src, dst)
    return "copy"


def write_onnx_model(onnx_path: Path, repo: Path, name: str, kind: str, instances: int, threads: int,
                     link: bool, header: list[str]) -> dict[str, Any]:
    """Write ``<repo>/<name>/{config.pbtxt, 1/model.onnx[, external data]}``; returns a summary."""
    inputs, outputs, meta = onnx_io(onnx_path)
    names = [s.name for s in inputs]
    for required in ("input_ids", "attention_mask", "logits"):
        if required not in names + [s.name for s in outputs]:
            log.warning("graph %s has no %r tensor: client.py expects the harp_trt export I/O contract",
                        onnx_path, required)
    mdir = repo / name
    how = place_file(onnx_path, mdir / "1" / MODEL_FILE, link)
    files = [MODEL_FILE]
    for loc in external_data_files(onnx_path):
        src = onnx_path.parent / loc
        if not src.is_file():
            raise PreconditionError(STAGE, f"{onnx_path.name} keeps its weights in {loc!r}, which is not in "
                                    f"{onnx_path.parent}", "copy the external-data file next to model.onnx")
        place_file(src, mdir / "1" / loc, link)
        files.append(loc)
    cfg = onnx_model_config(name, inputs, outputs, kind, instances, threads)
    (mdir / "config.pbtxt").write_text(render_pbtxt(cfg, header))
    kv_layers = kv_layers_of_names(names)
    num_layers = meta.get("num_layers")
    log.info("wrote Triton ONNX model %s (%d inputs, %d outputs, %s weights)", name, len(inputs), len(outputs), how)
    return {"model": name, "files": files, "placed_by": how, "inputs": names,
            "outputs": [s.name for s in outputs], "kv_layers": kv_layers, "num_layers": num_layers,
            "pruned_layers": ([i for i in range(num_layers) if i not in kv_layers]
                              if isinstance(num_layers, int) and kv_layers else []),
            "harp_alphas": meta.get("harp_alphas") or {}}
