"""W8A8: int8 weights per output channel and int8 activations per token, for the int8 matrix units.

``--quant w8a8`` makes every constant-weight ``MatMul`` (as ``quant.py`` finds them: projections, MLP,
the folded V.O GEMMs, the tied LM head) an integer GEMM that ONNX Runtime runs on its U8S8 QGEMM
kernels, the ones MLAS dispatches to AMX tiles on CPUs that have them (``MlasGemmU8S8DispatchAmx``,
onnxruntime ``core/mlas/lib/qgemm_kernel_amx.cpp``; VNNI or AVX2 elsewhere). Weight-only
``MatMulNBits`` (int4/int8) never reaches those units: its CompInt8 kernels are VNNI dot products
at block granularity, slower than fp32 SGEMM at prefill (bench/prefill_profile.py). Per GEMM ``Y = X W``::

    s   = max(|X|, over K) / 127                 one scale per token (row), [M, 1]
    Xq  = QuantizeLinear(X, s, zero point 128)   uint8, per row (axis 0)
    Y   = MatMulIntegerToFloat(Xq, Wq, 1, w_scale, 128) * s

with ``Wq = round(W / w_scale)``, ``w_scale = max(|W|, over K) / 127`` per column (symmetric, codes in
[-127, 127], as ONNX Runtime's ``quant_utils.compute_scale_zp`` with ``symmetric=True`` gives; the
test checks the codes against ``quant_utils.quantize_data`` column by column). The zero point 128
maps the symmetric int8 range onto uint8, the operand AMX's U8S8 kernel takes; it is exact (the
kernel subtracts it in int32). Per-token activation scales are LLM.int8's and SmoothQuant's
(arXiv 2208.07339, 2211.10438) minimum for transformer activations; nothing here migrates outliers.
Weights are quantized lazily, one at a time, when the graph is saved (as ``quant.py``)."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["per_channel_int8", "quantize_node_w8a8", "W8A8_OPS"]

W8A8_OPS = ("QuantizeLinear", "MatMulIntegerToFloat")
_ZERO_POINT = 128
_EPS = 1e-12     # an all-zero row gets a tiny scale instead of a division by zero


def per_channel_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [K, N], scales fp32 [N]) of a [K, N] weight: symmetric per column, round to nearest even."""
    absmax = np.abs(w).max(axis=0)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return codes, scale


class _Lazy:
    """One weight's codes and scales, computed when the saver first asks and dropped once both were taken."""

    def __init__(self, weight: ir.TensorProtocol):
        self.weight, self.result, self.taken = weight, None, 0

    def part(self, i: int, name: str) -> ir.Tensor:
        if self.result is None:
            self.result = per_channel_int8(np.asarray(self.weight.numpy(), dtype=np.float32))
        out = ir.Tensor(self.result[i], name=name)
        self.taken += 1
        if self.taken == 2:
            self.result, self.taken = None, 0
        return out


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    if name in graph.initializers:
        return graph.initializers[name]
    t = ir.tensor(np.asarray(array), name=name)
    v = ir.Value(name=name, const_value=t, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype))
    graph.register_initializer(v)
    return v


def quantize_node_w8a8(graph: ir.Graph, node: ir.Node, k: int, n: int) -> int:
    """Replace one weight MatMul by the W8A8 chain above; returns the bytes of its codes and scales."""
    x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
    base = node.name or w.name
    c = {name: _const(graph, f"w8a8/{name}", arr) for name, arr in (
        ("inv127", np.array(1 / 127, np.float32)), ("eps", np.array(_EPS, np.float32)),
        ("one", np.array(1.0, np.float32)), ("zp", np.array(_ZERO_POINT, np.uint8)),
        ("last", np.array([-1], np.int64)), ("flat", np.array([-1], np.int64)), ("zero", np.array([0], np.int64)))}
    rows = _const(graph, f"w8a8/rows_of_{k}", np.array([-1, k], np.int64))
    cols = _const(graph, f"w8a8/cols_{n}", np.array([n], np.int64))
    job = _Lazy(w.const_value)
    parts = []
    for i, (suffix, dtype, shape) in enumerate(((f"{w.name}_W8", ir.DataType.INT8, [k, n]),
                                                (f"{w.name}_w_scale", ir.DataType.FLOAT, [n]))):
        lazy = ir.LazyTensor(lambda i=i, nm=suffix: job.part(i, nm), dtype=dtype, shape=ir.Shape(shape), name=suffix)
        v = ir.Value(name=suffix, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=lazy)
        graph.register_initializer(v)
        parts.append(v)
    nodes: list[ir.Node] = []

    def add(op: str, inputs: list[Any], domain: str = "", **attrs: Any) -> ir.Value:
        nd = ir.node(op, inputs, attrs or None, domain=domain, name=f"{base}/w8a8/{op}_{len(nodes)}")
        nodes.append(nd)
        return nd.outputs[0]

    x2 = add("Reshape", [x, rows])                                            # [M, K]
    s = add("Max", [add("Mul", [add("ReduceMax", [add("Abs", [x2]), c["last"]], keepdims=1), c["inv127"]]),
                    c["eps"]])                                                # [M, 1]
    s1 = add("Reshape", [s, c["flat"]])                                       # [M]
    zps = add("Expand", [c["zp"], add("Shape", [s1])])                        # [M] of 128
    xq = add("QuantizeLinear", [x2, s1, zps], axis=0)                         # uint8 [M, K]
    acc = add("MatMulIntegerToFloat", [xq, parts[0], c["one"], parts[1], c["zp"]], domain="com.microsoft")
    y2 = add("Mul", [acc, s])                                                 # [M, N]
    lead = add("Slice", [add("Shape", [x]), c["zero"], c["last"]])            # X's leading dims
    # allowzero: an empty leading dim (logits_to_keep keeping no row) is 0, not "copy the input's"
    y = add("Reshape", [y2, add("Concat", [lead, cols], axis=0)], allowzero=1)
    y.shape, y.type = out.shape, out.type
    graph.insert_before(node, nodes)
    out.replace_all_uses_with(y, replace_graph_outputs=True)
    name = out.name
    graph.remove(node, safe=True)
    y.name = name
    if not w.uses() and not w.is_graph_output() and w.name in graph.initializers:
        del graph.initializers[w.name]
    return k * n + 4 * n
