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
    for bad in (["--layers", "32"], ["--seq-lens", "1024,abc"], ["--seq-lens", "262144"], ["--repeats", "1"],
                ["--model", "gpt2"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["--out", "x", *bad])
        assert e.value.code == 2


def test_ci95_student_t():
    from harp_trt.bench.gpu_prefill import ci95

    mean, half, med = ci95([1.0, 2.0, 3.0])
    # sd = 1, n = 3, t(0.975, 2) = 4.303
    assert mean == 2.0 and med == 2.0 and half == pytest.approx(4.303 / 3 ** 0.5)


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
