"""bench/gpu_check.py and bench/trtllm_check.py on a CPU machine: they refuse cleanly (exit 2, a
JSON last line) where their hardware or TensorRT-LLM is missing; gpu_check's --dry-run runs its
whole code path (search naive vs cached, full search, prefill, decode) at tiny shapes."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(script: str, *args: str) -> tuple[int, dict, str]:
    r = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without a GPU")
def test_gpu_check_refuses_without_gpu():
    code, out, err = _run("gpu_check.py")
    assert code == 2 and out["status"] == "refused" and "needs a CUDA GPU" in err and "--dry-run" in out["reason"]


@pytest.mark.slow
def test_gpu_check_dry_run_covers_every_stage():
    code, out, _ = _run("gpu_check.py", "--dry-run")
    assert code == 0 and out["status"] == "ok" and out["skipped"] == []
    nc = out["naive_vs_cached"]
    assert nc["identical_alphas"] and nc["ppl_rel_diff"] < 1e-6 and nc["naive_s"] > 0 and nc["cached_s"] > 0
    s = out["alpha_search"]
    assert len(s["grid"]) == 11 and len(s["alphas"]) == len(s["layers"]) == 2
    assert s["ppl_searched"] <= s["ppl_alpha1"] * (1 + 1e-6)  # candidates run batched: rounding differs
    assert set(out["prefill"]) == {"16", "32"} and set(out["prefill"]["16"]) == {"dense", "harp"}
    assert out["decode"]["kv_bytes_per_token"]["harp"] < out["decode"]["kv_bytes_per_token"]["dense"]
    rec = out["recovery"]  # calibrate --recover maps at these shapes: the steps ran, the figures are there
    assert rec["steps"] == 4 and rec["tokens_per_step"] == 16 and rec["seconds_per_step"] > 0 and rec["model_bytes"] > 0
    assert rec["select_kl_best"] <= rec["select_kl_start"] and rec["peak_gpu_bytes"] is None
    # the real shape, built on the meta device: Llama-3.1-8B's 8,030,261,248 parameters, less the
    # q/k projections of 8 layers (2 x 4096 x (4096 + 1024) each)
    shape = out["shape_check"]
    assert shape["params"] == 8_030_261_248 and shape["params"] - shape["harp_params"] == 8 * 4096 * 5120


@pytest.mark.slow
def test_gpu_check_dry_run_on_llamacpp():
    """--engine llamacpp: the search in PyTorch, then prefill and decode in llama.cpp (its CPU build
    in a dry run; every layer offloaded on a GPU host) from the GGUFs the pipeline writes."""
    code, out, _ = _run("gpu_check.py", "--dry-run", "--engine", "llamacpp")
    assert code == 0 and out["status"] == "ok" and out["engine"] == "llamacpp"
    assert out["runtime"]["runtime"] == "llama-cpp-python" and out["decode"]["batch"] == {"dense": 1, "harp": 1}
    assert set(out["prefill"]) == {"16", "32"} and len(out["alpha_search"]["alphas"]) == 2
    # f16 KV as llama.cpp allocates it: 4 layers x 2 (K, V) x 2 kv heads x 16 x 2 bytes; HARP keeps 2 of 4
    assert out["decode"]["kv_bytes_per_token"] == {"dense": 512, "harp": 256}


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="checks the refusal without TRT-LLM")
def test_trtllm_check_refuses_without_tensorrt_llm(tmp_path):
    code, out, err = _run("trtllm_check.py", "--artifact", str(tmp_path))
    assert code == 2 and "not a trtllm artifact" in out["reason"]
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "build_engine.sh").write_text("")
    code, out, err = _run("trtllm_check.py", "--artifact", str(tmp_path))
    assert code == 2 and "tensorrt_llm does not import here" in out["reason"]
