"""Small structural helpers over ``onnx_ir`` graphs: constants, bounded back/forward traces,
dead-code removal (onnx-ir's own pass) with accounting, and loading/saving with external data."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from ..errors import GraphError
from ..onnx_io import EXTERNAL_DATA_SUFFIX, EXTERNAL_DATA_THRESHOLD

__all__ = ["const_array", "const_ndim", "is_const", "consumers", "only_consumer", "ancestors",
           "name_hint_matches", "remove_dead", "DeadCode", "check_onnx", "fix_constant_shapes", "load_graph", "save_graph",
           "total_initializer_bytes", "ORT_ONNX_DOMAIN_OPS", "STAGE"]

log = logging.getLogger(__name__)
STAGE = "rewrite"
SCOPE_KEY = "pkg.torch.onnx.name_scopes"


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents (initializer or ``Constant`` node), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        attr = node.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
    return None


def const_ndim(value: ir.Value | None) -> int | None:
    """Rank of a constant value without reading its data (large weights stay on disk)."""
    if value is None:
        return None
    if value.const_value is not None and value.const_value.shape is not None:
        return len(value.const_value.shape)
    arr = const_array(value)
    return None if arr is None else arr.ndim


def is_const(value: ir.Value | None) -> bool:
    if value is None:
        return False
    if value.const_value is not None:
        return True
    node = value.producer()
    return node is not None and node.op_type == "Constant"


def consumers(value: ir.Value) -> list[ir.Node]:
    seen, out = set(), []
    for node in value.consumers():
        if id(node) not in seen:
            seen.add(id(node))
            out.append(node)
    return out


def only_consumer(value: ir.Value) -> ir.Node | None:
    cons = consumers(value)
    if len(cons) != 1 or value.is_graph_output():
        return None
    return cons[0]


def ancestors(value: ir.Value, limit: int = 64) -> set[int]:
    """ids of values reachable backwards from ``value`` (including it), visiting <= limit nodes."""
    seen_vals: set[int] = {id(value)}
    stack = [value]
    visited = 0
    while stack and visited < limit:
        v = stack.pop()
        node = v.producer()
        if node is None:
            continue
        visited += 1
        for inp in node.inputs:
            if inp is not None and id(inp) not in seen_vals:
                seen_vals.add(id(inp))
                stack.append(inp)
    return seen_vals


def _layer_regex(layer: int) -> re.Pattern[str]:
    return re.compile(rf"(?:^|[./_'\s])(?:layers?|h|blocks?)[._/]{layer}(?:[./_'\s]|$)")


def name_hint_matches(node: ir.Node, layer: int) -> bool:
    """Whether the node's name or torch name-scope metadata says it belongs to ``layer``.
    A hint only: the rules check structure before they use a node found this way."""
    rx = _layer_regex(layer)
    if node.name and rx.search(node.name):
        return True
    scopes = node.metadata_props.get(SCOPE_KEY)
    if scopes:
        # the innermost module scope decides ("m.model.layers.3.self_attn" -> layer 3)
        mods = re.findall(r"'([^']*)'", scopes)
        mods = [m for m in mods if "layers" in m or "blocks" in m]
        if mods and rx.search(mods[-1]):
            return True
    return False


@dataclass
class DeadCode:
    nodes: list[str] = field(default_factory=list)
    node_ops: dict[str, int] = field(default_factory=dict)
    initializers: list[str] = field(default_factory=list)
    params: int = 0
    bytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)  # params per removed initializer

    def extend(self, other: "DeadCode") -> None:
        self.nodes += other.nodes
        self.initializers += other.initializers
        self.params += other.params
        self.bytes += other.bytes
        self.sizes.update(other.sizes)
        for op, c in other.node_ops.items():
            self.node_ops[op] = self.node_ops.get(op, 0) + c


def remove_dead(model: ir.Model) -> DeadCode:
    """onnx-ir's ``RemoveUnusedNodesPass`` (nodes none of whose outputs is used or a graph output,
    then initializers nothing uses that are not graph inputs or outputs), with an account of what
    went: removed nodes in the pass's order (last first) and the initializers' sizes."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    nodes = list(graph)
    tensors = {name: v.const_value for name, v in graph.initializers.items()}
    RemoveUnusedNodesPass()(model)
    out = DeadCode()
    for node in reversed(nodes):
        if node.graph is not None:
            continue
        out.nodes.append(node.name or f"<{node.op_type}>")
        out.node_ops[node.op_type] = out.node_ops.get(node.op_type, 0) + 1
    for name, tensor in tensors.items():
        if name in graph.initializers:
            continue
        if tensor is not None:
            n = int(np.prod(tensor.shape.numpy())) if tensor.shape is not None else 0
            out.params += n
            out.sizes[name] = n
            out.bytes += tensor.nbytes
        out.initializers.append(name)
    return out


def fix_constant_shapes(graph: ir.Graph) -> list[str]:
    """Make the declared shape of every ``Constant`` output equal its tensor's shape; returns the
    values corrected. (onnxruntime-genai 0.18 declares its shared ``[1]`` constant as a scalar,
    which strict shape inference and ``onnx.checker``'s full check refuse.)"""
    fixed = []
    for node in graph:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.outputs:
            continue
        attr = node.attributes.get("value")
        out = node.outputs[0]
        if attr is None or out.shape is None:
            continue
        shape = tuple(attr.as_tensor().shape.numpy())
        if tuple(out.shape.numpy() if out.shape.is_static() else ()) != shape or len(out.shape) != len(shape):
            out.shape = ir.Shape(shape)
            fixed.append(out.name)
    return fixed


def total_initializer_bytes(graph: ir.Graph) -> int:
    return sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)


# ops onnxruntime registers in the ONNX domain that onnx's own schemas lack; the onnxruntime-genai
# model builder writes them (its final/first RMSNorm). The checker sees them as com.microsoft ops.
ORT_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def check_onnx(path: str | os.PathLike, full_check: bool = False, strict_shapes: bool = False) -> None:
    """``onnx.checker`` (and, with ``strict_shapes``, strict shape inference) on the file at
    ``path``, external data included. Nodes of ``ORT_ONNX_DOMAIN_OPS`` are checked as if they were
    in the ``com.microsoft`` domain (a checked copy sits beside the file while it runs, so external
    data paths stay valid); everything else is checked as is. Raises onnx's errors."""
    import onnx

    p = Path(path)
    proto = onnx.load(str(p), load_external_data=False)
    foreign = [n for n in proto.graph.node if n.domain in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_OPS]
    target = p
    if foreign:
        for n in foreign:
            n.domain = "com.microsoft"
        if not any(o.domain == "com.microsoft" for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
        target = p.with_name(f".{p.stem}.check{p.suffix}")
        onnx.save(proto, str(target))
    del proto
    try:
        onnx.checker.check_model(str(target), full_check=full_check)
        if strict_shapes:
            onnx.shape_inference.infer_shapes_path(str(target), str(target) + ".shapes", strict_mode=True)
    finally:
        Path(str(target) + ".shapes").unlink(missing_ok=True)
        if target != p:
            target.unlink(missing_ok=True)


def load_graph(path: str | os.PathLike) -> ir.Model:
    """Load an ONNX model with its external data (tensors stay memory-mapped), checking it first
    so a truncated or corrupt file gives a typed error instead of a protobuf traceback."""
    import onnx

    p = Path(path)
    if not p.is_file():
        raise GraphError(STAGE, f"no ONNX file at {p}")
    try:
        check_onnx(p, full_check=False)
    except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.checker.ValidationError) as e:
        raise GraphError(STAGE, f"{p} fails the ONNX checker: {str(e).splitlines()[0][:300]}",
                         "re-export the model; the file may be truncated") from None
    except Exception as e:  # protobuf DecodeError and friends: the file is not a model at all
        raise GraphError(STAGE, f"{p} is not a readable ONNX model ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200] if str(e) else 'decode failed'})",
                         "re-export the model; the file may be truncated") from None
    try:
        return ir.load(str(p))
    except Exception as e:  # same: onnx/protobuf raise several unrelated types
        raise GraphError(STAGE, f"cannot load {p}: {type(e).__name__}: {e}") from None


def save_graph(model: ir.Model, path: Path, external_threshold_bytes: int = EXTERNAL_DATA_THRESHOLD) -> bool:
    """Save ``model`` to ``path``; initializers go to ``<name>.data`` beside it when their total
    size passes ``external_threshold_bytes`` (protobuf cannot hold a model >2 GB). Returns
    whether external data was used."""
    path = Path(path)
    big = total_initializer_bytes(model.graph) > external_threshold_bytes
    if big:
        ir.save(model, str(path), external_data=path.name + EXTERNAL_DATA_SUFFIX)
    else:
        # tensors still memory-mapped from the source's external data (onnxruntime-genai writes
        # model.onnx.data at any size) go inline: the source's data file does not travel
        if any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values()):
            model = ir.external_data.load_to_model(model)
        ir.save(model, str(path))
    return big
