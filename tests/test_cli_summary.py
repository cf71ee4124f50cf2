"""What ``harp-trt build`` prints for a person, run as the Quick start runs it (no ``plots`` extra)
in an 80-column terminal: no path cut, the next command with the real engine path, a summary table
(perplexities to 2 decimals, sizes in GB, stage times, the alpha search as text), logs without a
source column and without torch's torchvision lines; ``--json`` keeps its keys."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_tiny
from harp_trt.cli._summary import SPARK, sparkline
from test_calibrate_cli import write_corpus

# the Quick start installs '.[cpu]', without matplotlib: the process runs with it hidden (an import
# of it fails, harp_trt.extras.available says no), everything else real
WITHOUT_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from harp_trt.cli import main; sys.exit(main())"
GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
# the keys `build --json` printed before the summary changed: machine readers depend on them
JSON_KEYS = {"model", "backend", "layers", "alphas", "ppl", "stages", "all_cached", "seconds", "notes", "preflight",
             "engine", "kv_bytes_per_token"}
STAGE_KEYS = {"artifact", "cached", "seconds", "peak_rss_so_far"}


def _harp(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env.update(COLUMNS="80", NO_COLOR="1", PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, *argv], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(human stdout, stderr, the same build's --json result) of a fresh build of a tiny llama."""
    d = tmp_path_factory.mktemp("summary")
    model = save_tiny("llama", d / "tiny")
    corpus = write_corpus(d / "corpus.txt")
    # a cache folder deep enough that every artifact path is wider than the summary's value column
    cache = d / "a-cache-folder-with-a-long-name-so-that-every-artifact-path-passes-80-columns" / "harp-trt"
    args = ["build", "--model", str(model), "--layers", "2", "--tokens", "256", "--seq-len", "64", "--corpus",
            str(corpus), "--alpha-grid", ",".join(map(str, GRID)), "--workdir", str(cache)]
    human = _harp(*args)
    assert human.returncode == 0, human.stderr
    again = _harp(*args, "--json")  # every stage a cache hit: the same artifacts
    assert again.returncode == 0, again.stderr
    return human.stdout, human.stderr, json.loads(again.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_json_keeps_its_keys(built):
    _, _, res = built
    assert set(res) == JSON_KEYS and res["all_cached"]
    assert all(set(s) == STAGE_KEYS for s in res["stages"].values())


@pytest.mark.slow
def test_no_path_is_cut_and_the_next_command_has_the_engine_path(built):
    out, _, res = built
    engine = res["engine"]
    assert len(engine) > 80  # the test's point: a path wider than the terminal
    assert "…" not in out and "..." not in out
    # a path wider than its column folds: its lines joined give it back whole
    assert engine in "".join(line.strip() for line in out.splitlines())
    for stage in res["stages"].values():
        assert Path(stage["artifact"]).parent == Path(engine).parent
    flat = "".join(line.strip() for line in out.splitlines())
    assert re.search(rf"cache\s+{re.escape(str(Path(engine).parent))}", flat)  # the folder once, artifacts by key
    # the next command, on one line of its own with the real path, never wrapped
    assert f'next: harp-trt generate --artifact {engine} --prompt "The capital of France is"' in out.splitlines()


@pytest.mark.slow
def test_summary_is_a_table_a_person_reads(built):
    out, _, res = built
    lines = out.splitlines()
    words = " ".join(line.strip() for line in lines)
    # perplexities to 2 decimals in a calibration / held-out table, no dict repr, no 15 digits
    assert not re.search(r"\d\.\d{5,}", out) and "{'" not in out and "notes" not in out
    p = res["ppl"]
    assert re.search(rf"calibration\s+{p['dense']:.2f}\s+{p['alpha1']:.2f}\s+–\s+{p['searched']:.2f}", out)
    assert re.search(rf"held-out\s+{p['heldout_dense']:.2f}\s+{p['heldout_alpha1']:.2f}\s+"
                     rf"{p['heldout_alpha0']:.2f}\s+{p['heldout_searched']:.2f}", out)
    # preflight in GB
    pre = res["preflight"]
    assert (f"peak memory ~{pre['peak_rss'] / 1e9:.2f} GB of " in words
            and f"peak disk ~{pre['peak_disk'] / 1e9:.2f} GB of " in words), words
    # one row per stage: built, its time in seconds, the peak RSS in GB, its artifact key
    for name, st in res["stages"].items():
        assert re.search(rf"^\s*{re.escape(name)}\s+built\s+\d+\.\d\d\s+\d+\.\d\d GB\s+"
                         rf"{re.escape(Path(st['artifact']).name)}\s*$", out, re.M), (name, out)
    assert re.search(r"^\s*\d+\.\d\d s in all, built what was not cached", out, re.M)
    kv = res["kv_bytes_per_token"]
    assert re.search(rf"KV cache\s+{kv['harp']:,} B per token \(dense {kv['dense']:,}: 2\.00x smaller\)", out)


@pytest.mark.slow
def test_alpha_search_printed_as_text_without_matplotlib(built):
    import polars as pl

    out, _, res = built
    calib = Path(res["stages"]["calibrate"]["artifact"])
    assert not (calib / "alpha_search.png").exists()
    assert "alpha_search.png not written (matplotlib is not installed: pip install -e '.[plots]')" in " ".join(out.split())
    trace = pl.read_parquet(calib / "search_trace.parquet")
    for layer, alpha in zip(res["layers"], res["alphas"]):
        ppl = trace.filter(pl.col("layer") == layer).sort("alpha")["ppl"].to_list()
        m = re.search(rf"^\s*{layer}\s+{alpha:.2f}\s+([{SPARK}]+)\s+{min(ppl):.2f}\s+{max(ppl):.2f}\s*$", out, re.M)
        assert m, (layer, out)
        spark = m.group(1)
        assert len(spark) == len(GRID)  # one character per candidate alpha, lowest perplexity lowest
        assert spark[ppl.index(min(ppl))] == SPARK[0] and spark[ppl.index(max(ppl))] == SPARK[-1]


@pytest.mark.slow
def test_logs_have_no_source_column_nor_torchvision_lines(built):
    _, err, _ = built
    assert "export ..." in err and "alpha search over layers" in err  # the phases are logged, and export ran
    assert not re.search(r"\S+\.py:\d+\s*$", err, re.M), err  # no "_common.py:153" ending each line
    # torch's ONNX exporter logs "torchvision is not installed. Skipping torchvision::nms" (x4)
    assert "torchvision" not in err, err


def test_noise_filter_drops_only_the_torchvision_lines():
    """The filter main() puts on torch's exporter logger drops its torchvision lines, not its other warnings."""
    import logging

    from harp_trt.cli import NOISE, _drop_noise

    name, _ = NOISE[0]
    logger, seen = logging.getLogger(name), []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        _drop_noise()
        _drop_noise()  # idempotent: one filter
        logger.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
        logger.warning("some other exporter warning")
    finally:
        logger.removeHandler(handler)
    assert seen == ["some other exporter warning"]
    assert len(logger.filters) == 1


def test_sparkline_bins_and_scales():
    assert sparkline([1.0, 10.0, 100.0]) == SPARK[0] + SPARK[4] + SPARK[-1]  # log scale: 10 halfway
    assert sparkline([5.0] * 3) == SPARK[0] * 3
    wide = sparkline([float(i) for i in range(1, 101)], width=40)
    assert len(wide) == 40 and wide[0] == SPARK[0] and wide[-1] == SPARK[-1]
