"""Weight-only int4 / int8 quantization of an engine graph with ONNX Runtime's own quantizer.

Every ``MatMul`` whose right-hand side is a constant weight (the q/k/v/o projections, the MLP, the
LM head and HARP's folded V.O GEMMs alike) becomes ``com.microsoft::MatMulNBits``: weights stored
in ``bits`` per value, blocked along K in blocks of ``block_size`` with one fp32 scale per block
(and a zero point unless symmetric). Activations, the embedding table and the KV cache stay fp32.
The quantizer is ``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`` with its
round-to-nearest ``DefaultWeightOnlyQuantConfig`` (the same kernel family onnxruntime-genai's model
builder writes); nothing here quantizes by hand.

``accuracy_level`` is MatMulNBits' compute type: 0 = fp32 activations (dequantize, then GEMM),
4 = activations quantized to int8 per block for an int8 GEMM (onnxruntime-genai's CPU default,
the fastest on CPU; it adds a small error of its own)."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import onnx_ir as ir

from harp_trt.errors import ConfigError, GraphError
from harp_trt.extras import require

from .config import QUANT_MODES, QuantSpec

__all__ = ["QUANT_MODES", "QuantSpec", "quantize_weights"]

log = logging.getLogger(__name__)

def _weight_matmuls(model: ir.Model) -> list[tuple[ir.Node, tuple[int, ...]]]:
    out = []
    for node in model.graph:
        if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2:
            w = node.inputs[1]
            if w is not None and w.const_value is not None and len(w.const_value.shape) == 2:
                out.append((node, tuple(int(d) for d in w.const_value.shape)))
    return out


def _fold_transposed_weights(model: ir.Model) -> int:
    """A tied LM head reads ``Transpose(embedding)``: give that MatMul its own [K, N] weight so it
    is quantized too (the fp32 embedding stays for the Gather). Returns how many were folded."""
    import numpy as np

    folded = 0
    for node in list(model.graph):
        if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
            continue
        t = node.inputs[1].producer() if node.inputs[1] is not None else None
        if t is None or t.op_type != "Transpose" or t.domain != "":
            continue
        src = t.inputs[0]
        perm = t.attributes.get("perm")
        if src is None or src.const_value is None or len(src.const_value.shape) != 2 or \
                (perm is not None and list(perm.value) != [1, 0]):
            continue
        w = ir.Value(name=f"{src.name}_transposed", const_value=ir.tensor(np.ascontiguousarray(src.const_value.numpy().T)))
        model.graph.register_initializer(w)
        node.replace_input_with(1, w)
        if not t.outputs[0].uses() and not t.outputs[0].is_graph_output():
            model.graph.remove(t, safe=True)
        folded += 1
    return folded


def quantize_weights(model: ir.Model, spec: QuantSpec, stage: str = "build-ort") -> tuple[ir.Model, dict[str, Any]]:
    """The graph with every constant-weight MatMul as MatMulNBits, and a report of what changed.
    Raises ConfigError when ``block_size`` does not divide a weight's K (the hidden or MLP size)."""
    MatMulNBitsQuantizer = require("onnxruntime.quantization.matmul_nbits_quantizer",
                                   "int4 weights need it").MatMulNBitsQuantizer

    spec.validate()
    _fold_transposed_weights(model)
    found = _weight_matmuls(model)
    if not found:
        raise GraphError(stage, "no MatMul with a constant weight to quantize",
                         "quantize an export or rewrite artifact of harp-trt")
    ks = sorted({k for _, (k, _) in found})
    bad = [k for k in ks if k % spec.block_size]
    if bad:
        raise ConfigError(f"--quant-block-size {spec.block_size} does not divide K = {bad} of the model's "
                          f"weights (K sizes: {ks})", f"use a power of two that divides {min(ks)}, e.g. 32")
    weight_bytes = sum(k * n * 4 for _, (k, n) in found)
    proto = ir.serde.serialize_model(model)
    del model
    quantizer = MatMulNBitsQuantizer(proto, bits=spec.bits, block_size=spec.block_size,
                                     is_symmetric=spec.symmetric, accuracy_level=spec.accuracy_level)
    qlog = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = qlog.level
    qlog.setLevel(logging.WARNING)  # it logs every node at INFO
    try:
        quantizer.process()
    finally:
        qlog.setLevel(level)
    out = ir.serde.deserialize_model(quantizer.model.model)
    ops = Counter(n.op_type for n in out.graph)
    left = len(_weight_matmuls(out))
    if ops.get("MatMulNBits", 0) != len(found) or left:
        raise GraphError(stage, f"the quantizer converted {ops.get('MatMulNBits', 0)} of {len(found)} weight MatMuls",
                         "report this with the graph")
    q_bytes = sum(v.const_value.nbytes for n in out.graph if n.op_type == "MatMulNBits"
                  for v in n.inputs[1:] if v is not None and v.const_value is not None)
    report = {"mode": spec.mode, "bits": spec.bits, "block_size": spec.block_size, "symmetric": spec.symmetric,
              "accuracy_level": spec.accuracy_level, "matmuls": len(found),
              "weight_bytes_fp32": weight_bytes, "weight_bytes_quantized": int(q_bytes),
              "quantizer": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer"}
    log.info("quantized %d MatMuls to %s (block %d): %.1f MB -> %.1f MB", len(found), spec.mode, spec.block_size,
             weight_bytes / 1e6, q_bytes / 1e6)
    return out, report
