"""Weight-only int4 / int8 quantization of an engine graph with ONNX Runtime's own quantizer, and
W8A8 (``--quant w8a8``: int8 weights and per-token int8 activations, ``quant_w8a8.py``).

Every ``MatMul`` whose right-hand side is a constant weight (the q/k/v/o projections, the MLP, the
LM head and HARP's folded V.O GEMMs alike) becomes ``com.microsoft::MatMulNBits``: weights stored
in ``bits`` per value, blocked along K in blocks of ``block_size`` with one fp32 scale per block
(and a zero point unless symmetric). Activations, the embedding table and the KV cache stay fp32.
The packing is ONNX Runtime's own: the C++ kernels (``quantize_matmul_4bits`` / ``_8bits``) that
``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`` calls with its
round-to-nearest ``DefaultWeightOnlyQuantConfig`` (the kernel family onnxruntime-genai's model
builder writes), called here one weight at a time instead of on a serialized whole model, with the
quantizer's names and attributes: the bytes are the quantizer's (tested); nothing quantizes by hand.

``accuracy_level`` is MatMulNBits' compute type: 0 = fp32 activations (dequantize, then GEMM),
4 = activations quantized to int8 per block for an int8 GEMM (onnxruntime-genai's CPU default,
the fastest on CPU; it adds a small error of its own)."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import onnx_ir as ir

from harp_trt.errors import ConfigError, GraphError

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
        t_src, name = src.const_value, f"{src.name}_transposed"
        shape = ir.Shape([t_src.shape[1], t_src.shape[0]])
        lazy = ir.LazyTensor(lambda t=t_src, n=name: ir.Tensor(np.ascontiguousarray(np.asarray(t.numpy(), np.float32).T),
                                                               name=n), dtype=t_src.dtype, shape=shape, name=name)
        w = ir.Value(name=name, shape=shape, type=ir.TensorType(t_src.dtype), const_value=lazy)
        model.graph.register_initializer(w)
        node.replace_input_with(1, w)
        if not t.outputs[0].uses() and not t.outputs[0].is_graph_output():
            model.graph.remove(t, safe=True)
        folded += 1
    return folded


def _packed(w: np.ndarray, bits: int, block_size: int, symmetric: bool) -> tuple[np.ndarray, ...]:
    """(packed, scales, zero points) of one [K, N] fp32 weight, by the C++ kernels
    ``DefaultWeightOnlyQuantizer.qbits_block_quant`` calls (same buffers, same arguments)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rows, cols = w.shape
    kpack = 8 // bits
    k_blocks = (rows + block_size - 1) // block_size
    packed = np.zeros((cols, k_blocks, (block_size + kpack - 1) // kpack), dtype="uint8")
    zero_point = np.zeros((cols, (k_blocks + kpack - 1) // kpack), dtype="uint8")
    scales = np.zeros((cols, k_blocks), dtype=w.dtype)
    kernel = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    kernel(packed, np.ascontiguousarray(w), scales, zero_point, block_size, cols, rows, symmetric)
    return packed, scales, zero_point


class _Quantized:
    """One weight's packed tensors, computed when the saver first asks for one of them and
    dropped once all were taken: one weight (and its packed form) resident at a time."""

    def __init__(self, weight: ir.TensorProtocol, spec: QuantSpec, parts: int):
        self.weight, self.spec, self.parts, self.result = weight, spec, parts, None
        self.taken = 0

    def part(self, i: int, name: str) -> ir.Tensor:
        if self.result is None:
            w = np.asarray(self.weight.numpy(), dtype=np.float32)
            self.result = _packed(w, self.spec.bits, self.spec.block_size, self.spec.symmetric)
        out = ir.Tensor(self.result[i], name=name)
        self.taken += 1
        if self.taken >= self.parts:
            self.result, self.taken = None, 0
        return out


def _quantize_node(graph: ir.Graph, node: ir.Node, k: int, n: int, spec: QuantSpec) -> int:
    """Replace one weight MatMul by MatMulNBits with lazily packed weights, named and attributed
    as ``MatMulNBitsQuantizer`` (QOperator format) names them. Returns the packed bytes."""
    bits, block = spec.bits, spec.block_size
    kpack, k_blocks = 8 // bits, (k + block - 1) // block
    w = node.inputs[1]
    shapes = [(n, k_blocks, (block + kpack - 1) // kpack), (n, k_blocks), (n, (k_blocks + kpack - 1) // kpack)]
    dtypes = [ir.DataType.UINT8, ir.DataType.FLOAT, ir.DataType.UINT8]
    names = [f"{w.name}_Q{bits}", f"{w.name}_scales", f"{w.name}_zero_points"]
    parts = 2 if spec.symmetric else 3
    job = _Quantized(w.const_value, spec, parts)
    inputs = [node.inputs[0]]
    for i in range(parts):
        lazy = ir.LazyTensor(lambda i=i, nm=names[i]: job.part(i, nm), dtype=dtypes[i], shape=ir.Shape(shapes[i]),
                             name=names[i])
        v = ir.Value(name=names[i], shape=ir.Shape(shapes[i]), type=ir.TensorType(dtypes[i]), const_value=lazy)
        graph.register_initializer(v)
        inputs.append(v)
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    if spec.accuracy_level:
        attrs["accuracy_level"] = spec.accuracy_level
    new = ir.node("MatMulNBits", inputs, attrs, domain="com.microsoft",
                  name=f"{node.name}_Q{bits}" if node.name else "")
    out = node.outputs[0]
    new.outputs[0].shape, new.outputs[0].type = out.shape, out.type
    graph.insert_before(node, new)
    out.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    name = out.name
    graph.remove(node, safe=True)
    new.outputs[0].name = name
    if not w.uses() and not w.is_graph_output() and w.name in graph.initializers:
        del graph.initializers[w.name]
    return sum(int(np.prod(s)) * (4 if d == ir.DataType.FLOAT else 1) for s, d in zip(shapes[:parts], dtypes))


def quantize_weights(model: ir.Model, spec: QuantSpec, stage: str = "build-ort") -> tuple[ir.Model, dict[str, Any]]:
    """The graph with every constant-weight MatMul as MatMulNBits, and a report of what changed.
    Weight by weight, lazily: each is read, packed and written when the graph is saved, so the
    model is never held whole (a 7B graph). The bytes equal ``MatMulNBitsQuantizer``'s
    (``tests/test_scale_path.py``). Raises ConfigError when ``block_size`` does not divide a
    weight's K (the hidden or MLP size)."""
    spec.validate()
    _fold_transposed_weights(model)
    found = _weight_matmuls(model)
    if not found:
        raise GraphError(stage, "no MatMul with a constant weight to quantize",
                         "quantize an export or rewrite artifact of harp-trt")
    weight_bytes = sum(k * n * 4 for _, (k, n) in found)
    if spec.mode == "w8a8":   # int8 x int8 GEMMs (quant_w8a8.py): no blocks along K
        from .quant_w8a8 import quantize_node_w8a8

        q_bytes = sum(quantize_node_w8a8(model.graph, node, k, n) for node, (k, n) in found)
        op, quantizer = "MatMulIntegerToFloat", "per-channel symmetric int8 weights, per-token int8 activations"
    else:
        ks = sorted({k for _, (k, _) in found})
        bad = [k for k in ks if k % spec.block_size]
        if bad:
            fits = [b for b in (256, 128, 64, 32, 16) if all(k % b == 0 for k in ks)]
            hint = (f"use --quant-block-size {fits[0]} (the largest of 16..256 that divides every K)" if fits
                    else "no block size of 16..256 divides every K; use --quant int8 or w8a8")
            raise ConfigError(f"--quant-block-size {spec.block_size} does not divide K = {bad} of the model's "
                              f"weights (K sizes: {ks})", hint)
        q_bytes = sum(_quantize_node(model.graph, node, k, n, spec) for node, (k, n) in found)
        op, quantizer = "MatMulNBits", "onnxruntime quantize_matmul_{4,8}bits per weight (MatMulNBitsQuantizer's kernels)"
    model.opset_imports.setdefault("com.microsoft", 1)
    ops = Counter(n.op_type for n in model.graph)
    if ops.get(op, 0) != len(found) or _weight_matmuls(model):
        raise GraphError(stage, f"the quantizer converted {ops.get(op, 0)} of {len(found)} weight MatMuls",
                         "report this with the graph")
    w8a8 = spec.mode == "w8a8"
    report = {"mode": spec.mode, "bits": spec.bits, "block_size": None if w8a8 else spec.block_size,
              "symmetric": True if w8a8 else spec.symmetric, "accuracy_level": None if w8a8 else spec.accuracy_level,
              "activations": "int8 per token" if w8a8 else ("int8 per block" if spec.accuracy_level else "fp32"),
              "matmuls": len(found), "weight_bytes_fp32": weight_bytes, "weight_bytes_quantized": int(q_bytes),
              "quantizer": quantizer}
    log.info("quantized %d MatMuls to %s (block %d): %.1f MB -> %.1f MB", len(found), spec.mode, spec.block_size,
             weight_bytes / 1e6, q_bytes / 1e6)
    return model, report
