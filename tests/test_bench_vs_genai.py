"""bench/vs_genai.py and bench/genai_engine.py without onnxruntime-genai: the decode byte ideal read
from two int4 engines, our engines' timings, and the staging of a config without architectures.
The genai model itself is exercised by the benchmark (pip install -e '.[genai]')."""
from __future__ import annotations

import json


from _exported import exported
from harp_trt.bench.genai_engine import stage_hf_folder
from harp_trt.bench.vs_genai import _byte_ideal, _graph_bytes, _Ours
from harp_trt.builders.ort.builder import OrtBuilder
from harp_trt.builders.ort.config import OrtBuildConfig
from conftest import save_tiny


def test_byte_ideal_of_two_int4_engines(tmp_path):
    q = OrtBuildConfig(quant="int4", intra_op_threads=2)
    dense, harp = tmp_path / "dense", tmp_path / "harp"
    OrtBuilder().build(exported("llama"), dense, q)
    OrtBuilder().build(exported("llama", harp=True), harp, q)
    # what MatMulNBits reads, from the graph: equal to the quantizer's own count
    assert _graph_bytes(dense) == json.loads((dense / "engine.json").read_text())["quant"]["weight_bytes_quantized"]
    ideal = _byte_ideal(dense, harp, context=100)
    d, h = ideal["dense"], ideal["harp"]
    assert h["weight_bytes"] < d["weight_bytes"]          # q/k of the pruned layers are gone
    assert h["kv_bytes"] * 2 == d["kv_bytes"]             # 2 of 4 layers keep KV
    assert ideal["ideal_speedup"] == round(d["bytes_per_step"] / h["bytes_per_step"], 4) > 1
    ours = _Ours(harp, threads=2)
    assert ours.prefill_seconds(list(range(5, 40))) > 0
    assert ours.decode_tokens_per_s(list(range(5, 40)), 4) > 0


def test_config_without_architectures_is_staged_with_them(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    staged, added = stage_hf_folder(folder, tmp_path / "staged")
    assert added == {"architectures": ["Qwen2ForCausalLM"]}
    assert json.loads((staged / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (staged / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
