"""The result tables in README.md and docs/*.md that come from committed JSON equal their rendering
(``bench/render_results.py``): a figure typed by hand, or a JSON changed without its table, fails."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "render_results.py"


def _run(*args: str) -> tuple[int, dict, str]:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_every_rendered_block_equals_its_json():
    rc, out, err = _run("--check")
    assert rc == 0 and out["differ"] == [], err
    # the blocks the docs hold today: the README's headline (accuracy and speed), the GPU check, the
    # newest-releases check, the long-context runs per runtime and their headline
    lc = [f"long_context_smollm2_{rt}.json" for rt in ("ort", "llamacpp", "genai")]
    assert any(b.startswith("README.md: headline replacement_smollm2_acc.json,recover_smollm2_p8") for b in out["blocks"])
    assert any(b.startswith("results-accuracy.md: recovery ") for b in out["blocks"])
    assert {"results-scale.md: gpu_check gpu_check_h200.json",
            "results.md: deps_newest deps-newest.json", "results-accuracy.md: calibration replacement_smollm2.json",
            *(f"results-speed.md: long_context {f}" for f in [*lc, "long_context_smollm2_ort_written.json"]),
            f"results-speed.md: long_context_headline {','.join(lc)}"} <= set(out["blocks"])


def test_a_hand_edited_figure_is_caught(tmp_path):
    page = (ROOT / "docs" / "results-scale.md").read_text()
    assert "| 17.7 s (target <= 120 s) |" in page  # the alpha search's seconds, rendered
    edited = tmp_path / "results-scale.md"
    edited.write_text(page.replace("| 17.7 s (target <= 120 s) |", "| 7.7 s (target <= 120 s) |"))
    rc, out, err = _run("--check", str(edited))
    assert rc == 1 and out["differ"] == ["results-scale.md"] and "results-scale.md: differs from its JSON" in err
    rc, out, _ = _run(str(edited))  # rendering restores it
    assert rc == 0 and edited.read_text() == page


def _long_context_json(speedups: list[tuple[float, float, float]]) -> dict:
    """A ``bench/long_context.py --runs N`` JSON of one decode point, its summary made by the bench's own
    ``summarize``, the runs' rows as the bench writes them (the fields the summary and the table read)."""
    from harp_trt.bench._long_context_runs import summarize

    runs = []
    for k, (s, lo, hi) in enumerate(speedups):
        row = {"context": 8192, "batch": 4, "speedup": {"speedup": s, "speedup_ci95_low": lo, "speedup_ci95_high": hi},
               "ideal": {"ideal": 1.346, "pruned_form": "vo"}, "ceiling": 30 / 22, "above_ceiling": lo > 30 / 22,
               "per_engine": {v: {"tokens_per_s": t, "itl": {"p50": 1e3 / t}} for v, t in (("dense", 25.0),
                                                                                           ("harp", 25.0 * s))}}
        runs.append({"model": "/cache/smollm2-135m", "plan": {"pruned": 8, "num_layers": 30, "layers": list(range(22, 30))},
                     "settings": {"quant": "int4", "kv_type": "f16", "threads": 2},
                     "machine": {"cpu": "a CPU", "load_avg_start": [0.2 + k, 0, 0], "load_avg_end": [2.0, 0, 0]},
                     "runtimes": {"ort": {"decode": [row], "prefill": [], "weight_bytes_per_param": 0.5,
                                           "kv_bytes_per_element": 4}}})
    return {"provenance": {"commit": "abc", "date": "2026-12-05", "command": "python bench/long_context.py --runs 3"},
            "runs": runs, "summary": summarize(runs)}


def test_long_context_table_flags_a_run_above_the_ceiling():
    """The ceiling L/(L-P) = 1.364 is beside every row; a run whose interval lies wholly above it is named
    in the row, and a claim ("low > 1", ">= 90 % of ideal") is "yes" only if every run meets it."""
    sys.path.insert(0, str(ROOT / "bench"))
    from render_results import long_context

    ok = long_context(_long_context_json([(1.30, 1.27, 1.33), (1.29, 1.25, 1.32), (1.31, 1.28, 1.34)]))
    row = next(line for line in ok.splitlines() if line.startswith("| ort | decode 8192 x 4"))
    assert "1.300 (range 1.290-1.310; 95 % across runs 1.275-1.325)" in row and "| 1.364 |" in row
    assert "ABOVE" not in row
    assert row.endswith("| yes, yes |") and "[1.270, 1.330], [1.250, 1.320], [1.280, 1.340]" in row
    assert "Load average before -> after each run: 0.20 -> 2.00; 1.20 -> 2.00; 2.20 -> 2.00" in ok
    bad = long_context(_long_context_json([(1.30, 1.27, 1.33), (1.45, 1.40, 1.50), (1.10, 0.95, 1.2)]))
    row = next(line for line in bad.splitlines() if line.startswith("| ort | decode 8192 x 4"))
    assert "**ABOVE CEILING (run 2)**" in row and row.endswith("| **no**, **no** |")


def test_long_context_headline_is_the_largest_point_of_each_json():
    sys.path.insert(0, str(ROOT / "bench"))
    from render_results import long_context_headline

    d = _long_context_json([(1.30, 1.27, 1.33), (1.45, 1.40, 1.50), (1.10, 0.95, 1.2)])
    text = long_context_headline([d, d])
    rows = [line for line in text.splitlines() if line.startswith("| ort, 8192 x 4 |")]
    assert len(rows) == 2 and "**ABOVE CEILING (run 2)**" in rows[0]
    assert rows[0].endswith("| **no**, **no** | not measured (no capped probe) |")


def test_headline_puts_one_plans_speed_and_accuracy_side_by_side():
    """The README's table: per P the searched plan's decode speed-up (median with the range of the runs,
    named as such) beside its ceiling, held-out perplexity and lm-eval mean from the same committed JSON;
    a P no speed run measured says so, and a run above its ceiling is flagged in the row."""
    from harp_trt.bench._render_headline import headline

    acc = json.loads((ROOT / "docs" / "results" / "replacement_smollm2_acc.json").read_text())
    fast = _long_context_json([(1.30, 1.27, 1.33), (1.29, 1.25, 1.32), (1.31, 1.28, 1.34)])
    text = headline([acc, fast])
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    p8 = rows["| P = 8: HARP, searched alphas"]
    assert "ort (0.5 bytes per weight) 1.30x (range of 3 runs 1.29-1.31; 95 % across them 1.28-1.33), 8192 x 4" in p8
    assert "| 1.364 |" in p8
    harp8 = next(r for r in acc["rows"] if r["P"] == 8 and r["replacement"] == "harp")
    assert f"| {harp8['heldout_searched']:.2f} / {harp8['other']['searched']:.2f} |" in p8
    accs = [r["value"] for r in acc["lm_eval"] if r["variant"] == "harp P=8" and r["metric"] == "acc"]
    assert p8.endswith(f"| {sum(accs) / len(accs) * 100:.1f} % |") and len(accs) == 5
    assert rows["| P = 4: HARP, searched alphas"].split(" | ")[1] == "not measured"
    assert "ABOVE" not in text
    high = headline([acc, _long_context_json([(1.30, 1.27, 1.33), (1.45, 1.40, 1.50), (1.10, 0.95, 1.2)])])
    assert "**ABOVE CEILING**" in next(line for line in high.splitlines() if line.startswith("| P = 8: HARP,"))
