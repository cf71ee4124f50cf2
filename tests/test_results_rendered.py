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
    # the blocks the docs hold today: the GPU check twice, the newest-releases check once
    assert {"README.md: gpu_check gpu_check_h200.json", "results.md: gpu_check gpu_check_h200.json",
            "results.md: deps_newest deps-newest.json"} <= set(out["blocks"])


def test_a_hand_edited_figure_is_caught(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "| 17.7 s (target <= 120 s) |" in readme  # the alpha search's seconds, rendered
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace("| 17.7 s (target <= 120 s) |", "| 7.7 s (target <= 120 s) |"))
    rc, out, err = _run("--check", str(edited))
    assert rc == 1 and out["differ"] == ["README.md"] and "README.md: differs from its JSON" in err
    rc, out, _ = _run(str(edited))  # rendering restores it
    assert rc == 0 and edited.read_text() == readme
