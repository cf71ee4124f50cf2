"""bench/int4_kernels.py: every kernel it names is timed on the same GEMM, each speed-up is paired
against fp32 MatMul with its interval and ceiling, the int4 settings it reports are the ones it ran,
and the last stdout line is the JSON object."""
from __future__ import annotations

import json

from harp_trt.bench.int4_kernels import kernels, main


def test_sweep_reports_every_kernel_paired_against_fp32(capsys):
    out = main(["--shapes", "64x128", "--m", "1,16", "--blocks", "32,64", "--levels", "0,4", "--repeats", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    names = set(kernels([32, 64], [0, 4]))
    assert names == {"fp32", "w8a8", "int4_b32_acc0", "int4_b32_acc4", "int4_b64_acc0", "int4_b64_acc4"}
    assert [(g["k"], g["n"], g["m"]) for g in out["gemms"]] == [(64, 128, 1), (64, 128, 16)]
    for g in out["gemms"]:
        rows = g["kernels"]
        assert set(rows) == names and rows["fp32"]["speedup_vs_fp32"] == 1.0
        for r in rows.values():
            lo, hi = r["ci95"]
            assert r["seconds"] > 0 and lo <= r["speedup_vs_fp32"] <= hi and r["ceiling"] >= 1.0
        best = g["best_int4"]
        assert best["speedup_vs_fp32"] == max(r["speedup_vs_fp32"] for n, r in rows.items() if n.startswith("int4"))
        assert rows[f"int4_b{best['block']}_acc{best['accuracy_level']}"]["speedup_vs_fp32"] == best["speedup_vs_fp32"]
    assert isinstance(out["machine"]["cpu_features"], list) and out["machine"]["threads"] == 2
    assert out["peak_rss_gb"] > 0 and out["provenance"]["command"]
