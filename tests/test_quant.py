"""Weight-only int4 / int8 ORT engines (``builders/ort/quant.py``, ONNX Runtime's MatMulNBits
quantizer): every weight MatMul (the folded V.O GEMMs and the tied LM head included) is quantized,
GroupQueryAttention and the fp32 KV cache are kept, the build is verified against its own quantized
graph, int8 stays close to fp32, and bad input exits 2."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest

from _exported import engine, exported
from harp_trt.builders.ort.builder import OrtBuilder
from harp_trt.builders.ort.config import OrtBuildConfig
from harp_trt.builders.ort.config import QuantSpec
from harp_trt.cli import main
from harp_trt.errors import ConfigError, GraphError
from harp_trt.ort_session import OrtCausalLM

IDS = np.array([[5, 9, 40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55, 56, 57]])
MASK = np.ones_like(IDS)
POS = np.tile(np.arange(IDS.shape[1]), (2, 1))


def _ops(folder) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node)


def _weight_matmuls(onnx_path) -> int:
    m = onnx.load(str(onnx_path))
    consts = {i.name for i in m.graph.initializer}
    producers = {o: n for n in m.graph.node for o in n.output}
    n = 0
    for node in m.graph.node:
        if node.op_type == "MatMul":
            b = node.input[1]
            src = producers.get(b)
            if b in consts or (src is not None and src.op_type == "Transpose" and src.input[0] in consts):
                n += 1
    return n


def test_int8_harp_engine_quantizes_every_weight_and_stays_close(tmp_path):
    family = "llama"  # GroupQueryAttention layers; gemma2's fusion skips are covered by test_ort_engine
    src = exported(family, harp=True)
    spec = OrtBuilder().build(src, tmp_path, OrtBuildConfig(quant="int8", quant_accuracy_level=0, intra_op_threads=2))
    ops = _ops(tmp_path)
    expected = _weight_matmuls(src)  # q/k/v/o of kept layers, the folded V.O GEMMs, the MLPs, the head
    assert ops["MatMulNBits"] == expected == spec["quant"]["matmuls"]
    assert spec["quant"]["weight_bytes_quantized"] < 0.35 * spec["quant"]["weight_bytes_fp32"]
    fp32 = engine(family, harp=True)
    fp32_spec = json.loads((fp32 / "engine.json").read_text())
    assert spec["attention"] == fp32_spec["attention"]  # the same GroupQueryAttention fusion
    assert OrtCausalLM(fp32).kv_layers == OrtCausalLM(tmp_path).kv_layers == [0, 2]  # pruned layers: no KV
    assert spec["kv"]["dtype"] == "float32"
    # the build itself: engine == its quantized graph before ORT optimizations (fp32 rounding only)
    assert spec["verify"]["logits_max_abs_diff"] <= spec["verify"]["tolerance"]
    assert spec["verify"]["reference"].startswith("quantized graph")
    # int8 blocks of 32 with fp32 activations: logits within 3 % of the logit scale of the fp32 engine
    a, _ = OrtCausalLM(fp32).forward(IDS, MASK, POS)
    b, _ = OrtCausalLM(tmp_path).forward(IDS, MASK, POS)
    scale = max(1.0, float(np.abs(a).max()))
    assert 0 < float(np.abs(a - b).max()) <= 0.03 * scale


def test_int4_engine_is_smaller_and_generates(tmp_path):
    spec = OrtBuilder().build(exported("qwen2", harp=True), tmp_path, OrtBuildConfig(quant="int4"))
    q = spec["quant"]
    assert (q["bits"], q["block_size"], q["symmetric"], q["accuracy_level"]) == (4, 32, True, 4)
    assert q["weight_bytes_quantized"] < 0.2 * q["weight_bytes_fp32"]
    assert spec["verify"]["vs_fp32_source"]["logits_max_abs_diff"] > 0  # it is quantized
    lm = OrtCausalLM(tmp_path)
    out = lm.generate(IDS[:1], max_new_tokens=6)
    assert out.shape == (1, IDS.shape[1] + 6)
    assert lm.kv_bytes_per_token() == OrtCausalLM(engine("qwen2", harp=True)).kv_bytes_per_token()


def test_bad_quant_settings_are_typed_errors(tmp_path):
    with pytest.raises(ConfigError, match="--quant must be one of none, int4, int8"):
        OrtBuildConfig(quant="int3")
    with pytest.raises(ConfigError, match="power of two"):
        OrtBuildConfig(quant="int4", quant_block_size=24)
    with pytest.raises(ConfigError, match=r"does not divide K = \[64"):  # tiny models: hidden 64
        OrtBuilder().build(exported("llama"), tmp_path / "a", OrtBuildConfig(quant="int4", quant_block_size=128))
    foreign = onnx.load(str(exported("llama")))
    del foreign.metadata_props[:]
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    with pytest.raises(GraphError, match="not a harp-trt export"):
        OrtBuilder().build(tmp_path / "foreign.onnx", tmp_path / "b", OrtBuildConfig(quant="int8"))
    assert QuantSpec("none").bits == 0


@pytest.mark.parametrize("argv, message", [
    (["--quant", "int3"], "--quant must be one of"),
    (["--quant", "int4", "--quant-block-size", "48"], "power of two"),
    (["--quant", "int4", "--backend", "trtllm"], "--quant applies to the ORT engine"),
])
def test_build_cli_rejects_bad_quant(argv, message, tmp_path, capsys):
    rc = main(["build", "--model", str(tmp_path / "absent"), "--workdir", str(tmp_path), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_build_cli_quant_defaults_are_the_config_defaults():
    """The parser keeps torch out of `--help`, so it states the defaults itself: keep them equal."""
    import argparse

    from harp_trt.cli.build import _ort_config, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "x"])
    assert _ort_config(args) == OrtBuildConfig()
