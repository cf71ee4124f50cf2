"""One weight GEMM, ``[m, k] x [k, n]``, timed in ONNX Runtime with each weight kernel our engines use:
the rate a prefill's weight GEMMs cannot beat (``prefill_profile``'s ceilings, ``int4_kernels``' sweep)."""
from __future__ import annotations

import time

import numpy as np

__all__ = ["gemm_peak", "gemm_session", "best_seconds"]


def gemm_session(m: int, k: int, n: int, quant: str, threads: int, block: int = 32, accuracy_level: int = 4):
    """(an ORT session of the GEMM, its input feed). ``quant``: ``none`` = fp32 MatMul; ``int4`` /
    ``int8`` = MatMulNBits with ``block`` weights per scale (symmetric) and ``accuracy_level`` (0: fp32
    activations, dequantize then GEMM; 4: int8 activations per block); ``w8a8`` = the integer GEMM
    alone (MatMulIntegerToFloat on uint8 activations, without their quantization)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a_type, a = TensorProto.FLOAT, rng.standard_normal((m, k)).astype(np.float32)
    if quant == "none":
        node = helper.make_node("MatMul", ["A", "W"], ["Y"])
        inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")]
    elif quant == "w8a8":
        a_type, a = TensorProto.UINT8, rng.integers(0, 255, (m, k), dtype=np.uint8)
        inits = [numpy_helper.from_array(rng.integers(-127, 127, (k, n), dtype=np.int8), "W"),
                 numpy_helper.from_array(np.array(0.01, np.float32), "sa"),
                 numpy_helper.from_array((rng.random(n) * 0.01).astype(np.float32), "sw"),
                 numpy_helper.from_array(np.array(128, np.uint8), "zp")]
        node = helper.make_node("MatMulIntegerToFloat", ["A", "W", "sa", "sw", "zp"], ["Y"], domain="com.microsoft")
    else:
        bits = 4 if quant == "int4" else 8
        nb = (k + block - 1) // block
        inits = [numpy_helper.from_array(rng.integers(0, 255, (n, nb, block * bits // 8), dtype=np.uint8), "W"),
                 numpy_helper.from_array((rng.random(n * nb) * 0.01).astype(np.float32), "S")]
        node = helper.make_node("MatMulNBits", ["A", "W", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=block, accuracy_level=accuracy_level)
    g = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("A", a_type, [m, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sess.run(None, {"A": a})
    return sess, {"A": a}


def best_seconds(sess, feed, calls: int = 3) -> float:
    """The fastest of ``calls`` calls."""
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        sess.run(None, feed)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_peak(m: int, k: int, n: int, quant: str, threads: int, block: int = 32) -> float:
    """FLOP/s of the best of 3 calls, at our engines' settings (block 32, accuracy level 4)."""
    sess, feed = gemm_session(m, k, n, quant, threads, block)
    return 2 * m * k * n / best_seconds(sess, feed)
