"""Graph rule: a ``logits_to_keep`` input that cuts the LM head to the last positions a caller reads.

The export computes every position's logits (``[B, S, V]``): teacher-forced scoring (perplexity,
lm-eval) needs them all. A generator reads only the last position's, so at a long prompt the rest is
waste: SmolLM2-135M's LM head is 28 M of its 135 M GEMM weights (a fifth of a prefill's FLOPs), and
8192 positions of a 49152-word vocabulary are 1.6 GB of fp32 logits. Transformers' models take the
same cut as a forward argument (``logits_to_keep``: 0 = every position, k = the last k);
onnxruntime-genai's model builder bakes it into the graph (``prune_lm_head``; our genai folders'
``--last-logits``, ``builders/genai/last_logits.py``). Here it is an input::

    logits = LMHead(hidden)
        ->  logits = LMHead(Slice(hidden, starts=-logits_to_keep, ends=INT64_MAX, axes=[1]))

``logits_to_keep`` is a required int64 ``[1]`` input. 0 keeps every position (``Slice`` from -0 is
the whole axis). ``LOGITS_KEEP_NONE`` (-2^62) keeps none: the Slice starts past the end, so a chunked
prefill's chunks before the last skip the head, which at Qwen2-7B's width re-read 2.2 GB of fp32
weights per chunk; engines declare that value in their ``harp_trt.logits_to_keep`` metadata.
Required, not an initializer-backed default: ONNX Runtime's IO binding, through which a chunked
prefill writes the KV cache in place, binds graph inputs only (an overridable initializer is "not
in the def list"). So every consumer of an ORT engine feeds it: ``OrtCausalLM`` (0 in ``forward``
unless asked; in ``prefill``, 1 for the last chunk and the keep-none value before it), the Triton
ORT client (``ort_client.py``), and a genai folder pins it to a constant
(``builders/genai/stage.py``: 1 with ``--last-logits``, else 0).
Each position's logits depend on its own hidden state only, so the kept rows are the same numbers
(tests/test_ort_prefill.py).

One rule of the house protocol (``harp_trt/graph_rules.py``), run by ``LogitsToKeepPass`` (``passes.py``)
before quantization, so the LM head it finds is still a plain ``MatMul``/``Gemm``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from harp_trt.graph_rules import GraphRule, MatchResult, RuleReport
from harp_trt.onnx_io import (LM_HEAD_MAX_WALK, LOGITS, LOGITS_KEEP_NONE, LOGITS_TO_KEEP, LOGITS_TO_KEEP_META_KEY,
                               walk_to_lm_head)

__all__ = ["LOGITS_TO_KEEP", "LOGITS_KEEP_NONE", "LogitsToKeep", "LmHead"]

_HEAD_OPS = frozenset({"MatMul", "Gemm"})   # before quantization: a plain GEMM of the default domain


@dataclass
class LmHead:
    head: ir.Node            # the GEMM whose rows become logits
    chain: list[ir.Node]     # the element-wise nodes from the head to ``logits``
    logits: ir.Value         # the graph output


def _data_inputs(node: ir.Node) -> list[ir.Value]:
    return [v for v in node.inputs if v is not None and v.const_value is None and not v.is_initializer()]


class LogitsToKeep(GraphRule[LmHead]):
    """``pattern``: the ``logits`` graph output; ``check``: it comes out of a MatMul/Gemm through
    element-wise ops only and the graph has no ``logits_to_keep`` yet; ``rewrite``: the input and a
    ``Slice`` of the hidden states in front of the head."""

    name = "LogitsToKeep"
    description = "logits_to_keep input (0 = all): the LM head over the last positions only"
    key = "logits_to_keep"
    first_only = True

    def describe(self, m: LmHead, added: Any) -> str:
        return m.head.name

    def finish(self, model: ir.Model, report: RuleReport) -> None:
        """Declare the keep-none value in the model's metadata (``OrtCausalLM.keeps_none`` reads it)."""
        if report.matched:
            model.metadata_props[LOGITS_TO_KEEP_META_KEY] = json.dumps({"keep_none": LOGITS_KEEP_NONE})

    def summary(self, report: RuleReport) -> dict[str, Any]:
        """Which head it cut, or why it left the graph alone."""
        why = "" if report.matched else next(iter(report.skipped.values()), f"the graph has no {LOGITS} output")
        return {"rule": self.name, "lm_head": report.matched[0] if report.matched else None, "skipped": why}

    def pattern(self, graph: ir.Graph) -> list[ir.Value]:
        return [v for v in graph.outputs if v.name == LOGITS]

    def check(self, graph: ir.Graph, logits: ir.Value) -> MatchResult[LmHead]:
        if any(v.name == LOGITS_TO_KEEP for v in graph.inputs):
            return MatchResult.fail(f"the graph already takes {LOGITS_TO_KEEP}")
        walk = walk_to_lm_head(logits, lambda v: v.producer(), _data_inputs, _HEAD_OPS, default_domain_only=True)
        node = walk.head
        if node is not None:
            if node.op_type == "Gemm" and node.attributes.get("transA") is not None and node.attributes["transA"].value:
                return MatchResult.fail("the LM head Gemm transposes its activations")
            return MatchResult(LmHead(node, walk.chain, logits))
        if walk.blocker is not None:
            node = walk.blocker
            return MatchResult.fail(f"{LOGITS} comes out of {node.op_type} ({node.name}) with {walk.data_inputs} data "
                                    "inputs, not out of an LM-head GEMM and element-wise ops")
        return MatchResult.fail(f"no LM-head GEMM within {LM_HEAD_MAX_WALK} nodes before {LOGITS}")

    def rewrite(self, graph: ir.Graph, m: LmHead) -> ir.Node:
        def const(name: str, array: np.ndarray) -> ir.Value:
            t = ir.tensor(array, name=name)
            v = ir.Value(name=name, const_value=t, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype))
            graph.register_initializer(v)
            return v

        keep = ir.Value(name=LOGITS_TO_KEEP, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
        graph.inputs.append(keep)
        hidden = m.head.inputs[0]
        neg = ir.node("Neg", [keep], name=f"{LOGITS_TO_KEEP}/Neg")
        last = ir.node("Slice", [hidden, neg.outputs[0], const(f"{LOGITS_TO_KEEP}/ends", np.array([2**63 - 1], np.int64)),
                                 const(f"{LOGITS_TO_KEEP}/axes", np.array([1], np.int64))],
                       name=f"{LOGITS_TO_KEEP}/Slice")
        graph.insert_before(m.head, [neg, last])
        m.head.replace_input_with(0, last.outputs[0])
        last.outputs[0].name = f"{hidden.name}/kept"
        last.outputs[0].type = hidden.type
        # the tensors from the Slice to ``logits`` hold the kept positions: their sequence dim is "kept"
        for v in (last.outputs[0], *m.head.outputs, *(o for n in m.chain for o in n.outputs)):
            if v.shape is not None and len(v.shape) == 3:
                v.shape = ir.Shape([v.shape[0], "kept", v.shape[2]])
        return last
