"""bench/gpu_prefill.py on CPU: it refuses without a GPU (exit 2, JSON last line), parses and checks
its arguments, and its --dry-run runs the real code path at tiny shapes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_prefill.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without a GPU")
def test_refuses_without_gpu(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["status"] == "refused" and "--dry-run" in last["reason"]
    assert not list(tmp_path.iterdir())  # nothing written


def test_argument_parsing():
    from harp_trt.bench.gpu_prefill import DEFAULT_SEQ_LENS, SHAPES, parse_args

    a = parse_args(["--out", "x"])
    assert a.seq_lens == DEFAULT_SEQ_LENS == (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    assert (a.model, a.layers, a.repeats, a.shape) == ("llama3.1-8b", 8, 10, "llama3.1-8b")
    a = parse_args(["--out", "x", "--model", "qwen2-7b", "--seq-lens", "1024,4096", "--layers", "4"])
    assert a.seq_lens == (1024, 4096) and a.shape == "qwen2-7b"
    assert SHAPES["llama3.1-8b"]["num_hidden_layers"] == 32 and SHAPES["qwen2-7b"]["hidden_size"] == 3584
    from harp_trt.bench._gpu_engines import disk_needed, shape_params

    # --engine's disk estimate: Llama-3.1-8B's 8,030,261,248 parameters (bf16 folder + two f16 GGUFs)
    assert shape_params("llama3.1-8b") == 8_030_261_248 and disk_needed("llamacpp", "llama3.1-8b") == 6 * 8_030_261_248
    for bad in (["--layers", "32"], ["--seq-lens", "1024,abc"], ["--seq-lens", "262144"], ["--repeats", "1"],
                ["--model", "gpt2"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["--out", "x", *bad])
        assert e.value.code == 2


def test_ci95_student_t():
    from harp_trt.bench._gpu_common import ci95

    mean, half, med = ci95([1.0, 2.0, 3.0])
    # sd = 1, n = 3, t(0.975, 2) = (2p - 1) / sqrt(2p(1 - p)) = 4.3026527 (the old table said 4.303)
    assert mean == 2.0 and med == 2.0 and half == pytest.approx(4.3026527 / 3 ** 0.5, rel=1e-7)


def test_dry_run_same_code_path(tmp_path):
    from harp_trt.bench.gpu_prefill import main

    rc = main(["--dry-run", "--out", str(tmp_path), "--seq-lens", "8,16", "--repeats", "2", "--warmup", "0",
               "--decode-steps", "2"])
    assert rc == 0
    for f in ("gpu_prefill.csv", "gpu_decode.csv", "gpu_prefill.png"):
        assert (tmp_path / f).stat().st_size > 0
    rows = (tmp_path / "gpu_prefill.csv").read_text().splitlines()
    assert rows[0].startswith("variant,seq_len,mean_s,ci95_s") and len(rows) == 1 + 2 * 2
    dec = (tmp_path / "gpu_decode.csv").read_text()
    # tiny llama: 4 layers, top 2 pruned -> HARP's KV per token is half the dense one
    lines = [l.split(",") for l in dec.splitlines()[1:]]
    kv = {l[0]: int(l[-1]) for l in lines}
    assert kv["dense"] == 2 * kv["harp"] == 4 * 2 * 2 * 16 * 4


@pytest.mark.slow
def test_dry_run_on_genai(tmp_path):
    """--engine genai: the same CSV/PNG/JSON from onnxruntime-genai (the CUDA provider on a GPU
    host; the CPU build in a dry run) on the folders the pipeline builds, KV bytes as genai holds them."""
    from harp_trt.bench.gpu_prefill import main

    rc = main(["--dry-run", "--engine", "genai", "--out", str(tmp_path), "--seq-lens", "8,16", "--repeats", "2",
               "--warmup", "0", "--decode-steps", "2"])
    assert rc == 0
    rows = (tmp_path / "gpu_prefill.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 and (tmp_path / "gpu_prefill.png").stat().st_size > 0
    kv = {l.split(",")[0]: int(l.split(",")[-1]) for l in (tmp_path / "gpu_decode.csv").read_text().splitlines()[1:]}
    assert kv == {"dense": 4 * 2 * 2 * 16 * 4, "harp": 2 * 2 * 2 * 16 * 4}  # fp32 KV, HARP keeps 2 of 4 layers


@pytest.mark.parametrize("engine,module", [("genai", "onnxruntime_genai"), ("llamacpp", "llama_cpp")])
def test_engine_refusals(engine, module, tmp_path):
    """Where the runtime does not import (the GPU host has neither), --engine refuses: exit 2, one
    line naming the package to install, a JSON last line, nothing written. Without --dry-run the
    CPU builds here are refused too (no CUDA support)."""
    from harp_trt.bench._gpu_common import Refused
    from harp_trt.bench._gpu_engines import probe

    code = ("import sys; sys.modules[%r] = None; sys.argv = %r; import runpy; "
            "runpy.run_path(%r, run_name='__main__')" % (module, ["gpu_prefill.py", "--dry-run", "--engine", engine,
                                                                  "--out", str(tmp_path / "o")], str(SCRIPT)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 2 and last["status"] == "refused" and "does not import here" in last["reason"]
    assert len(r.stderr.strip().splitlines()) == 1 and "pip install" in r.stderr and not (tmp_path / "o").exists()
    with pytest.raises(Refused, match="no CUDA support"):
        probe(engine, "gpu_prefill.py", dry_run=False)
    # the 8B artifacts against the disk (genai's 135 GiB do not fit this machine's; a larger one runs)
    import shutil

    from harp_trt.bench._gpu_engines import disk_needed

    if disk_needed(engine, "llama3.1-8b") > shutil.disk_usage(tmp_path).free:
        with pytest.raises(Refused, match="GiB free: pass --workdir on a larger disk"):
            probe(engine, "gpu_prefill.py", True, "llama3.1-8b", str(tmp_path / "work"))
    assert probe(engine, "gpu_prefill.py", True, "tiny-gpu", str(tmp_path / "work"))["gpu"] is False
