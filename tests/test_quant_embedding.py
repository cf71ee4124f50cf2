"""``builders/ort/quant_embedding.py`` (``--quant-embedding``): the embedding Gather of a quantized
engine as com.microsoft GatherBlockQuantized (onnxruntime-genai's int4 embedding). ORT's kernel
returns exactly the rows the rule's quantization dequantizes to, and the engine is verified against
its own graph like every quantized build."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from _exported import exported
from harp_trt.builders.ort.builder import OrtBuilder
from harp_trt.builders.ort.config import OrtBuildConfig
from harp_trt.builders.ort.quant_embedding import quantize_rows


@pytest.mark.parametrize("bits", [4, 8])
def test_gather_block_quantized_returns_the_dequantized_rows(bits):
    """ORT's GatherBlockQuantized on the rule's layout equals numpy's dequantization (max |diff| 0:
    the same products of a small integer and an fp32 scale); each value is within half a step of
    the original (round to nearest, no clipping: the scale maps max|block| to the top level)."""
    from onnx import TensorProto, helper, numpy_helper

    import onnxruntime as ort

    rng = np.random.default_rng(0)
    table = rng.standard_normal((10, 64)).astype(np.float32)
    data, scale, zp = quantize_rows(table, bits, 32)
    q = np.stack([data & 15, data >> 4], -1).reshape(10, 64) if bits == 4 else data
    deq = ((q.reshape(10, 2, 32).astype(np.float32) - 2 ** (bits - 1)) * scale[..., None]).reshape(10, 64)
    assert np.abs(deq - table).max() <= 0.5 * scale.max() * (1 + 1e-6)
    node = helper.make_node("GatherBlockQuantized", ["d", "ids", "s", "z"], ["y"], domain="com.microsoft",
                            bits=bits, block_size=32, gather_axis=0, quantize_axis=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, n) for a, n in ((data, "d"), (scale, "s"), (zp, "z"))])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 7, 0, 9]])
    np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0], deq[ids])


def test_int4_engine_with_quantized_embedding(tmp_path):
    spec = OrtBuilder().build(exported("llama"), tmp_path, OrtBuildConfig(quant="int4", quant_embedding=True))
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "model.onnx")).graph.node)
    assert ops["GatherBlockQuantized"] == 1
    emb = spec["quant"]["embedding"]
    assert len(emb["tables"]) == 1 and emb["bits"] == 4 and emb["skipped"] == {}
    # [128, 64] fp32 -> 4 bits + one fp32 scale and a zero-point nibble per 32 values
    assert emb["bytes_fp32"] == 128 * 64 * 4 and emb["bytes_quantized"] == 128 * (32 + 2 * 4 + 1)
    assert spec["verify"]["logits_max_abs_diff"] <= spec["verify"]["tolerance"]
    init = {i.name for i in onnx.load(str(tmp_path / "model.onnx")).graph.initializer}
    # the fp32 table is gone (the untied LM head has its own weight)
    assert emb["tables"] == ["model.model.embed_tokens.weight"] and emb["tables"][0] not in init
