"""Last-position logits: the graph variant a genai folder serves with ``--last-logits``.

Our engines compute every position's logits (``[B, S, V]``): teacher-forced scoring (perplexity,
lm-eval) needs them. A generator reads only the last position's, so at a long prompt the rest is
waste: 4 x 8192 tokens of SmolLM2's 49152-word vocabulary is 6.4 GB of fp32 logits and the LM head's
GEMM over every position. onnxruntime-genai's model builder offers the same cut (its ``prune_lm_head``
extra option: a ``Gather`` of the last position before the LM head, logits ``[B, 1, V]``), and its
runtime (0.18) takes such a graph: it keeps the last row of whatever the graph returns.

``last_position_logits`` edits the graph proto only (weights stay in their external file, which the
folder hard-links): one ``Slice`` of the last position along the sequence axis in front of the LM
head, the GEMM that ends the chain of element-wise ops (Gemma2's soft-capping, casts) feeding
``logits``. Each position's logits depend on its own hidden state only, so the last row is unchanged
(tests/test_genai_deploy.py checks it against the all-position graph)."""
from __future__ import annotations

from typing import Any

from harp_trt.errors import GraphError
from harp_trt.onnx_io import LOGITS, LOGITS_TO_KEEP, walk_to_lm_head

__all__ = ["LM_HEAD_OPS", "lm_head_node", "last_position_logits", "LOGITS", "has_logits_to_keep",
           "pin_logits_to_keep"]

# a built engine's LM head: plain, weight-only quantized or fused by ORT's optimizer
LM_HEAD_OPS = frozenset({"MatMul", "MatMulNBits", "Gemm", "FusedMatMul"})


def lm_head_node(graph: Any) -> tuple[Any, list[Any]]:
    """(the LM-head node, the element-wise nodes between it and ``logits``): the node whose output
    reaches ``logits`` through element-wise ops only and that multiplies by a weight
    (``LM_HEAD_OPS``; the walk is ``harp_trt.onnx_io.walk_to_lm_head``); ``GraphError`` where the
    chain is anything else."""
    producer = {o: n for n in graph.node for o in n.output}
    consts = {i.name for i in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    walk = walk_to_lm_head(LOGITS, producer.get, lambda n: [i for i in n.input if i and i not in consts], LM_HEAD_OPS)
    if walk.head is not None:
        return walk.head, walk.chain
    if walk.blocker is not None:
        node = walk.blocker
        raise GraphError("genai", f"the {LOGITS} output comes out of a {node.op_type} ({node.name}) with "
                         f"{walk.data_inputs} data inputs, not out of an LM-head GEMM and element-wise ops",
                         "deploy this engine with every position's logits (no --last-logits)")
    raise GraphError("genai", f"no LM-head GEMM ({', '.join(sorted(LM_HEAD_OPS))}) found before the graph's "
                     f"{LOGITS} output")


def last_position_logits(model: Any) -> Any:
    """Edit ``model`` (an ``onnx.ModelProto`` loaded without its external data) in place so that
    ``logits`` is ``[B, 1, V]``: the last position's row of the all-position graph. Returns it."""
    from onnx import TensorProto, helper

    graph = model.graph
    out = next((o for o in graph.output if o.name == LOGITS), None)
    if out is None:
        raise GraphError("genai", f"the graph has no {LOGITS!r} output")
    head, chain = lm_head_node(graph)
    hidden = head.input[0]
    last = f"{hidden}/last_position"
    bounds = {"starts": -1, "ends": 2**63 - 1, "axes": 1}   # x[:, -1:]
    names = {k: f"{last}/{k}" for k in bounds}
    graph.initializer.extend(helper.make_tensor(names[k], TensorProto.INT64, [1], [v]) for k, v in bounds.items())
    graph.node.insert(list(graph.node).index(head),
                      helper.make_node("Slice", [hidden, *names.values()], [last], name=f"{last}/Slice"))
    head.input[0] = last
    # the tensors from the head to ``logits`` now hold one position: drop their recorded shapes
    changed = {o for n in (head, *chain) for o in n.output}
    keep = [v for v in graph.value_info if v.name not in changed]
    del graph.value_info[:]
    graph.value_info.extend(keep)
    dims = out.type.tensor_type.shape.dim
    if len(dims) == 3:
        dims[1].Clear()
        dims[1].dim_value = 1
    return model


def has_logits_to_keep(model: Any) -> bool:
    """Whether the graph takes the ORT engine's ``logits_to_keep`` input (builders/ort/logits_to_keep.py)."""
    return any(i.name == LOGITS_TO_KEEP for i in model.graph.input)


def pin_logits_to_keep(model: Any, keep: int) -> Any:
    """Edit ``model`` in place so that ``logits_to_keep`` is a constant ``[keep]`` (an initializer, no
    longer an input: genai feeds only the inputs its config names). 1: ``logits`` is ``[B, 1, V]``,
    the last position's; 0: every position's. Returns it."""
    from onnx import TensorProto, helper

    graph = model.graph
    kept = [i for i in graph.input if i.name != LOGITS_TO_KEEP]
    if len(kept) == len(graph.input):
        raise GraphError("genai", f"the graph has no {LOGITS_TO_KEEP!r} input")
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.append(helper.make_tensor(LOGITS_TO_KEEP, TensorProto.INT64, [1], [int(keep)]))
    # genai sizes its logits buffer from the output's shape: 1 position, or the prompt's (input_ids' dim)
    out = next((o for o in graph.output if o.name == LOGITS), None)
    ids = next((i for i in graph.input if i.name == "input_ids"), None)
    if out is not None and len(out.type.tensor_type.shape.dim) == 3:
        dim = out.type.tensor_type.shape.dim[1]
        dim.Clear()
        if keep == 1:
            dim.dim_value = 1
        elif ids is not None and len(ids.type.tensor_type.shape.dim) == 2:
            dim.CopyFrom(ids.type.tensor_type.shape.dim[1])
    return model
