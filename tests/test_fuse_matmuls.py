"""``builders/ort/fuse_matmuls.py``: MatMuls of one activation (q/k/v, gate/up) become one MatMul and
a Split in the ORT engine (onnxruntime-genai's fused QKV), fp32 and int4 alike, with the logits of
the engine built without it."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest

from _exported import exported
from harp_trt.builders.ort.builder import OrtBuilder
from harp_trt.builders.ort.config import OrtBuildConfig
from harp_trt.ort_session import OrtCausalLM

IDS = np.array([[5, 9, 40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55, 56, 57]])
MASK = np.ones_like(IDS)
POS = np.tile(np.arange(IDS.shape[1]), (2, 1))


def _siblings(folder) -> int:
    """Activations read by two or more weight MatMuls (MatMul or MatMulNBits) in an engine."""
    g = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    consts = {i.name for i in g.initializer}
    reads = Counter(n.input[0] for n in g.node if n.op_type in ("MatMul", "MatMulNBits") and n.input[1] in consts)
    return sum(1 for c in reads.values() if c > 1)


def _logits(folder) -> np.ndarray:
    lm = OrtCausalLM(folder, intra_op_threads=2)
    a, past = lm.forward(IDS, MASK, POS)
    b, _ = lm.forward(a[:, -1].argmax(-1)[:, None], np.ones((2, 9), np.int64), np.full((2, 1), 8), past)
    return np.concatenate([a, b], axis=1)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_fused_engine_equals_unfused(tmp_path, quant):
    """llama, HARP with layers 1 and 3 pruned: kept layers fuse q/k/v and gate/up (2 groups each),
    pruned ones gate/up only (their folded V.O GEMM reads the norm alone). Logits within 1e-5 of the
    logit scale of the unfused engine's (fp32 rounding of a wider GEMM; int4 blocks run along K, so
    each column is quantized as before)."""
    src = exported("llama", harp=True)
    on, off = tmp_path / "on", tmp_path / "off"
    spec = OrtBuilder().build(src, on, OrtBuildConfig(quant=quant, intra_op_threads=2))
    OrtBuilder().build(src, off, OrtBuildConfig(quant=quant, fuse_matmuls=False, intra_op_threads=2))
    f = spec["fused_matmuls"]
    assert f["groups"] == 6 and f["matmuls"] == 2 * 5 + 2 * 2 and f["skipped"] == {}
    assert sorted(len(g["widths"]) for g in f["fused"]) == [2, 2, 2, 2, 3, 3]
    assert _siblings(on) == 0 and _siblings(off) == 6
    assert json.loads((off / "engine.json").read_text())["fused_matmuls"] is None
    if quant != "none":
        assert spec["quant"]["matmuls"] == json.loads((off / "engine.json").read_text())["quant"]["matmuls"] - 8
    assert spec["verify"]["logits_max_abs_diff"] <= spec["verify"]["tolerance"]
    a, b = _logits(on), _logits(off)
    assert float(np.abs(a - b).max()) <= 1e-5 * max(1.0, float(np.abs(b).max()))
