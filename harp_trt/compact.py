"""Compact (lossless half-width) storage of an fp32 graph's weights, for the quantized large-model path.

A graph that will end as an int4/int8 engine does not need 4 bytes per weight on disk in between:
a weight read from bf16 (fp16) safetensors is exactly representable in bf16 (fp16). ``compact``
stores every such weight as a bf16 (fp16) initializer read through ``Cast(to=FLOAT)``, so the file
is a valid ONNX graph that ONNX Runtime runs as is and that computes exactly the fp32 graph (the
cast is exact), at half the bytes. ``expand`` undoes it on loading: each ``Cast`` of a half-width
initializer becomes an fp32 initializer again, bound lazily (the half-width data stays
memory-mapped; one weight is widened at a time, when a saver or quantizer reads it), so passes see
the graph they always saw.

Which weights may be stored narrow is known from where they came from, never guessed: the export
marks the initializers it streams from half-width safetensors (``mark``), ``expand`` marks the
ones it widens, a transpose of a marked weight stays marked, and anything computed (HARP's folded
GEMMs, rotary tables) is not marked and stays fp32. A marked weight that is not exact raises
``GraphError`` while saving rather than losing bits."""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import onnx_ir as ir

from .errors import GraphError

__all__ = ["STORAGE", "NARROW", "mark", "storage_of", "compact", "expand", "narrow_bytes"]

log = logging.getLogger(__name__)

STORAGE = "harp_trt.storage"   # ``Value.meta`` key: the narrow dtype a fp32 weight is exact in
SOURCE = "harp_trt.narrow"     # ``Value.meta`` key: () -> the narrow tensor itself, where it is at hand
_WIDE = "harp_trt.wide"        # the fp32 tensor ``SOURCE`` stands for: a replaced value drops its source
NARROW = {"bfloat16": ir.DataType.BFLOAT16, "float16": ir.DataType.FLOAT16}


def mark(value: ir.Value, dtype: str | None, source: Callable[[], ir.TensorProtocol] | None = None) -> None:
    """Record that ``value`` (an fp32 initializer) is exact in ``dtype`` (bfloat16 | float16);
    ``source`` returns its narrow data directly (the checkpoint's tensor), so saving it compactly
    never widens it (a 7B embedding is 2.2 GB at fp32)."""
    if dtype in NARROW:
        value.meta[STORAGE] = dtype
        if source is not None:
            value.meta[SOURCE], value.meta[_WIDE] = source, value.const_value


def storage_of(value: ir.Value) -> str | None:
    return value.meta.get(STORAGE)


def _narrowed(src: ir.TensorProtocol, dtype: str, name: str) -> ir.Tensor:
    import ml_dtypes

    wide = src.numpy()
    narrow = wide.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    if not np.array_equal(narrow.astype(np.float32), wide, equal_nan=True):
        raise GraphError("export", f"weight {name} was marked exact in {dtype} but is not",
                         "report this: a computed weight was marked as read from the checkpoint")
    return ir.Tensor(narrow, name=name)


def compact(model: ir.Model) -> int:
    """Store every marked fp32 initializer as its narrow twin behind ``Cast(to=FLOAT)`` (lazily:
    nothing is read until the graph is saved). Returns how many were compacted."""
    graph = model.graph
    first = next(iter(graph), None)
    done = 0
    for name, value in list(graph.initializers.items()):
        dtype = storage_of(value)
        t = value.const_value
        if dtype is None or t is None or t.dtype != ir.DataType.FLOAT:
            continue
        narrow_name = f"{name}.{dtype}"
        source = value.meta.get(SOURCE) if value.meta.get(_WIDE) is t else None
        if source is not None:
            lazy = ir.LazyTensor(lambda f=source, n=narrow_name: _copied(f(), n), dtype=NARROW[dtype], shape=t.shape,
                                 name=narrow_name)
        else:
            lazy = ir.LazyTensor(lambda s=t, d=dtype, n=narrow_name: _narrowed(s, d, n), dtype=NARROW[dtype],
                                 shape=t.shape, name=narrow_name)
        narrow = ir.Value(name=narrow_name, shape=t.shape, type=ir.TensorType(NARROW[dtype]), const_value=lazy)
        cast = ir.node("Cast", [narrow], {"to": ir.DataType.FLOAT}, name=f"harp.storage/{name}")
        out = cast.outputs[0]
        out.shape, out.type = t.shape, ir.TensorType(ir.DataType.FLOAT)
        value.replace_all_uses_with(out, replace_graph_outputs=True)
        del graph.initializers[name]
        out.name = name
        graph.initializers.add(narrow)
        if first is None:
            graph.append(cast)
        else:
            graph.insert_before(first, cast)
        done += 1
    return done


def _copied(src: ir.TensorProtocol, name: str) -> ir.Tensor:
    out = ir.Tensor(np.array(src.numpy()), name=name)
    if isinstance(src, ir.ExternalTensor):
        src.release()
    return out


def _widened(src: ir.TensorProtocol, name: str) -> ir.Tensor:
    out = ir.Tensor(np.asarray(src.numpy(), dtype=np.float32), name=name)
    if isinstance(src, ir.ExternalTensor):  # unmap: mapped pages would stay resident, weight after weight
        src.release()
    return out


def expand(model: ir.Model) -> int:
    """Turn every ``Cast(to=FLOAT)`` of a bf16/fp16 initializer back into a marked fp32
    initializer bound lazily to the narrow data. Returns how many were expanded."""
    graph = model.graph
    by_dtype = {v: k for k, v in NARROW.items()}
    done = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            continue
        src, out = node.inputs[0], node.outputs[0]
        to = node.attributes.get("to")
        t = src.const_value if src is not None and src.is_initializer() else None
        if t is None or to is None or to.as_int() != ir.DataType.FLOAT or t.dtype not in by_dtype or \
                len({id(u.node) for u in src.uses()}) != 1 or src.is_graph_output():
            continue
        name = out.name
        lazy = ir.LazyTensor(lambda s=t, n=name: _widened(s, n), dtype=ir.DataType.FLOAT, shape=t.shape, name=name)
        wide = ir.Value(name=f"{name}.widened", shape=t.shape, type=ir.TensorType(ir.DataType.FLOAT),
                        const_value=lazy)
        out.replace_all_uses_with(wide, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        del graph.initializers[src.name]
        wide.name = name
        graph.initializers.add(wide)
        mark(wide, by_dtype[t.dtype], lambda s=t: s)  # saved compactly again: the narrow bytes as they are
        done += 1
    return done


def narrow_bytes(model: ir.Model) -> int:
    """Bytes the initializers take once compacted (marked ones at 2 bytes a value)."""
    total = 0
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is None:
            continue
        total += t.nbytes // 2 if storage_of(v) and t.dtype == ir.DataType.FLOAT else t.nbytes
    return total
