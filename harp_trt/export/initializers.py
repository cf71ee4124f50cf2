"""The export's initializers: bound lazily to the real weights (one resident at a time while the
graph is saved), each linear weight folded into the transposed layout its MatMul reads, and saved
once: no weight beside its transposed copy, no initializer the graph does not read."""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..compact import SOURCE, STORAGE, mark
from ..errors import GraphError

__all__ = ["bind_lazily", "fold_weight_transposes", "optimize", "drop_dead_initializers"]


def _ir_tensor(t: torch.Tensor, name: str):
    import onnx_ir as ir

    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return ir.Tensor(t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16), name=name)
    return ir.Tensor(t.numpy(), name=name)


def bind_lazily(program, fetch, shapes: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Give every initializer of a fake-traced program a lazy value: ``fetch(name)`` returns the
    tensor when the saver asks for it, so one initializer is resident at a time."""
    import onnx_ir as ir

    for name, value in program.model.graph.initializers.items():
        if name not in shapes:
            raise GraphError("export", f"traced graph has an initializer {name!r} that no weight or buffer "
                             "provides", "report this with the model type")
        dtype, shape = shapes[name]
        ir_dtype = ir.DataType.BFLOAT16 if dtype == torch.bfloat16 else ir.DataType.from_numpy(
            torch.empty((), dtype=dtype).numpy().dtype)
        value.const_value = ir.LazyTensor(lambda n=name: _ir_tensor(fetch(n), n), dtype=ir_dtype,
                                          shape=ir.Shape(shape), name=name)


def fold_weight_transposes(model) -> int:
    """Replace ``Transpose(W)`` of a lazily bound 2-D weight by a lazy initializer holding ``W.T``,
    and drop ``W``: each weight is stored once, transposed.

    The exporter writes ``linear`` as ``MatMul(x, Transpose(W))``; the optimizer would fold each
    Transpose into a new initializer *in memory* (every weight matrix of the model at once). Doing
    the fold here, lazily, gives the optimizer the graph it would have produced, with nothing
    materialised. A weight the Transpose shares with another reader (a tied LM head reads the
    embedding that the Gather reads) keeps its Transpose: folding it would store the embedding
    twice, and ONNX Runtime folds it in memory when it loads the graph. Returns how many were
    folded."""
    import onnx_ir as ir

    graph = model.graph
    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            continue
        src, out = node.inputs[0], node.outputs[0]
        tensor = src.const_value if src is not None else None
        perm = node.attributes.get("perm")
        if not isinstance(tensor, ir.LazyTensor) or len(tensor.shape) != 2 or out.is_graph_output() or \
                (perm is not None and list(perm.as_ints()) != [1, 0]) or _shared(src):
            continue
        name = out.name
        shape = ir.Shape([tensor.shape[1], tensor.shape[0]])
        lazy = ir.LazyTensor(lambda t=tensor, n=name: _transposed(t, n), dtype=tensor.dtype, shape=shape, name=name)
        new = ir.Value(name=name, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
        if STORAGE in src.meta:  # a transpose is as exact in bf16 as its source, its data the source's transposed
            f = src.meta.get(SOURCE)
            mark(new, src.meta[STORAGE], (lambda f=f, n=name: _transposed(f(), n)) if f is not None else None)
        out.replace_all_uses_with(new)
        graph.remove(node, safe=True)  # safe: detaches the node from W, so W has no use left
        graph.initializers.add(new)
        if not src.uses() and not src.is_graph_output() and src.name in graph.initializers:
            del graph.initializers[src.name]
        folded += 1
    return folded


def _shared(value) -> bool:
    """Whether more than one node reads ``value`` (a tied embedding: the Gather and the head)."""
    return len({id(use.node) for use in value.uses()}) > 1


def _keep_shared_transposes(node) -> bool | None:
    """The optimizer's ``should_fold``: never fold ``Transpose`` of a shared initializer (a tied
    embedding), which its size rule allows for small models; ``None`` leaves the rest to it."""
    if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and node.inputs and \
            node.inputs[0] is not None and node.inputs[0].is_initializer() and _shared(node.inputs[0]):
        return False
    return None


def optimize(model) -> None:
    """What ``ONNXProgram.optimize`` runs (onnxscript's optimizer, then its ONNX fusions), with
    the tied-embedding rule of ``_keep_shared_transposes``."""
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions

    onnxscript.optimizer.optimize_ir(model, should_fold=_keep_shared_transposes)
    onnxscript.rewriter.onnx_fusions.fuse(model)


def drop_dead_initializers(model) -> list[str]:
    """Remove initializers no node, subgraph or graph output reads (the exporter's leftovers):
    the saved export holds only weights the graph computes with. Returns their names."""
    graph = model.graph
    dead = [name for name, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]
    for name in dead:
        del graph.initializers[name]
    return dead


def _transposed(tensor, name: str):
    import onnx_ir as ir

    return ir.Tensor(np.ascontiguousarray(tensor.numpy().T), name=name)
