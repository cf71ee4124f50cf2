"""AIPerf (``aiperf`` on PyPI, NVIDIA's LLM load generator that replaces genai-perf) against a Triton
model with the vLLM backend's I/O, for ``bench/serve_load.py`` and the suite.

AIPerf lives in a tool venv of its own, pinned by ``bench/aiperf-constraints.txt``: it requires
``huggingface-hub<2``, which the project's transformers-5 set (``constraints.txt``, hub 2.4) cannot
share, so it cannot be a pip extra of harp-trt; users run it the same way (``pipx install aiperf``).
``tool_venv`` makes it once (installed beside, then renamed: never half a venv) and says with one
line and exit code 2 where pip cannot reach it.

The load goes through Triton's HTTP ``generate_stream`` endpoint (server-sent events) with AIPerf's
``template`` endpoint type: ``TEMPLATE`` renders the request body Triton's vLLM-style model takes
(``text_input``, ``stream``, ``exclude_input_in_output``, ``sampling_parameters`` as a JSON string
with AIPerf's ``max_tokens`` and ``ignore_eos``: every request produces exactly ``--osl`` tokens),
and ``text_output`` is the field AIPerf reads each streamed piece from (aiperf
``endpoints/template_endpoint.py``: ``TemplateEndpoint``). Figures are read from AIPerf's own export
(``profile_export_aiperf.json``), never recomputed here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from harp_trt.errors import HarpError

__all__ = ["AIPERF", "CONSTRAINTS", "TEMPLATE", "AiperfMissing", "tool_venv", "profile", "figures", "in_flight",
           "triton_endpoint", "openai_completions"]

AIPERF = "aiperf==0.13.0"
CONSTRAINTS = Path(__file__).with_name("aiperf-constraints.txt")
TEMPLATE = ('{"text_input": {{ text|tojson }}, "stream": {{ stream|tojson }}, "exclude_input_in_output": true, '
            '"sampling_parameters": {{ {"max_tokens": max_tokens, "ignore_eos": true}|tojson|tojson }}}')
REFILL_RATE = 20  # requests/s AIPerf may start at most: paces its loop (see profile)
# AIPerf's metric tags -> our names; the unit is AIPerf's (ms, tokens/s, requests/s)
METRICS = {"request_throughput": "requests_per_s", "output_token_throughput": "output_tokens_per_s",
           "time_to_first_token": "ttft_ms", "inter_token_latency": "itl_ms", "request_latency": "latency_ms",
           "output_sequence_length": "output_tokens", "input_sequence_length": "input_tokens"}


class AiperfMissing(HarpError):
    """AIPerf is not installed and pip could not install it (exit code 2)."""

    exit_code = 2


def tool_venv(root: Path) -> Path:
    """The ``aiperf`` executable of the pinned tool venv under ``root``, made on first use. A venv
    cannot be renamed (its scripts name their interpreter by path), so it is built in place and
    counts only once its ``.complete`` marker is written; a half-built one is removed and rebuilt."""
    home = root / f"{AIPERF.replace('==', '-')}-py{sys.version_info[0]}.{sys.version_info[1]}"
    exe, done = home / "bin" / "aiperf", home / ".complete"
    if done.is_file() and exe.is_file():
        return exe
    shutil.rmtree(home, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
    pip = [str(home / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    res = subprocess.run(pip + ["-c", str(CONSTRAINTS), AIPERF], capture_output=True, text=True)
    if res.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        raise AiperfMissing(f"cannot install {AIPERF} into {home}: pip says {res.stderr.strip()[-400:]}",
                            f"run where pip reaches PyPI: python -m venv {home} && {home}/bin/pip install "
                            f"-c {CONSTRAINTS} {AIPERF}")
    done.write_text(AIPERF + "\n")
    return exe


def triton_endpoint(model: str, out: Path) -> list[str]:
    """AIPerf's arguments for Triton's ``generate_stream`` of ``model``: the template endpoint with
    ``TEMPLATE`` (written under ``out``) and ``text_output`` as the streamed text."""
    template = out / "triton_generate_stream.jinja"
    template.write_text(TEMPLATE)
    return ["--endpoint-type", "template", "--custom-endpoint", f"/v2/models/{model}/generate_stream",
            "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output"]


def openai_completions(extra: dict[str, Any]) -> list[str]:
    """AIPerf's own OpenAI ``completions`` endpoint (``/v1/completions``), with ``extra`` merged into
    every request body (AIPerf parses an ``--extra-inputs`` value that starts with ``{`` as JSON)."""
    return ["--endpoint-type", "completions", "--extra-inputs", json.dumps(extra)]


def profile(aiperf: Path, url: str, model: str, tokenizer: Path, isl: int, osl: int, concurrency: int,
            requests: int, out: Path, seed: int = 0, warmup: int = 0, duration_s: float = 0.0,
            timeout_s: float = 7200.0, rate: float = REFILL_RATE, endpoint: list[str] | None = None) -> dict[str, Any]:
    """One AIPerf run at a fixed concurrency, streaming: ``requests`` requests, or as many as
    ``duration_s`` seconds take (those in flight then complete); returns ``figures`` of its export
    and ``in_flight`` of its per-request records. ``endpoint``: AIPerf's endpoint arguments
    (default: Triton's ``generate_stream``, ``triton_endpoint``)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(aiperf), "profile", "--url", url, "--model", model, *(endpoint or triton_endpoint(model, out)),
           "--streaming", "--tokenizer", str(tokenizer), "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl),
           "--osl-stddev", "0", "--concurrency", str(concurrency), "--random-seed", str(seed),
           # a request rate beside the concurrency: with none, AIPerf's timing manager polls for a free slot
           # without sleeping (one core at 100 %, half of this machine); at 20/s a freed slot waits <= 50 ms
           "--request-rate", str(rate),
           "--output-artifact-dir", str(out), "--ui-type", "none",
           # one worker and one record processor (asyncio holds every in-flight request), no GPU telemetry
           # and no /metrics scraping: the load generator shares this machine's cores with the server
           "--workers-max", "1", "--record-processors", "1", "--no-gpu-telemetry", "--no-server-metrics"]
    cmd += (["--benchmark-duration", str(duration_s), "--benchmark-grace-period", str(timeout_s)] if duration_s
            else ["--request-count", str(requests)])
    if warmup:
        cmd += ["--warmup-request-count", str(warmup)]
    # without HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: under them AIPerf looks a local tokenizer folder up as a
    # hub snapshot and fails (aiperf common/tokenizer.py: Tokenizer._from_pretrained_local); a folder path
    # needs no network
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV")) and k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    (out / "aiperf.log").write_text(res.stdout + res.stderr)
    export = next(iter(sorted(out.rglob("profile_export_aiperf.json"))), None)
    if res.returncode != 0 or export is None:
        raise HarpError(f"aiperf exited {res.returncode} without an export in {out}: {(res.stdout + res.stderr)[-1500:]}")
    records = export.with_name("profile_export.jsonl")
    flight = in_flight(records.read_text().splitlines()) if records.is_file() else None
    return {"command": cmd, **figures(json.loads(export.read_text())), "streams_in_flight": flight,
            "export": str(export)}


def figures(export: dict[str, Any]) -> dict[str, Any]:
    """Our names for AIPerf's figures: throughputs, TTFT / ITL / latency p50 and p99, errors."""
    out: dict[str, Any] = {}
    records = export.get("records", export)
    for tag, name in METRICS.items():
        m = records.get(tag) if isinstance(records, dict) else None
        if not isinstance(m, dict):
            continue
        out[name] = {k: m.get(k) for k in ("avg", "p50", "p99", "min", "max") if m.get(k) is not None}
        out[name]["unit"] = m.get("unit")
    errors = export.get("error_summary") or []
    out["errors"] = int(sum(int(e.get("count", 0)) for e in errors)) if isinstance(errors, list) else errors
    out["requests"] = (records.get("request_count") or {}).get("avg") if isinstance(records, dict) else None
    return out


def in_flight(lines: list[str]) -> dict[str, float] | None:
    """How many responses streamed at once, from AIPerf's per-request records: each request streams
    from its first token (start + TTFT) to its end; ``max`` is the most streams at one instant,
    ``mean`` their summed streaming time over the span from the first first-token to the last end.
    A server that serves one request at a time shows max 1 whatever AIPerf's concurrency."""
    spans = []
    for line in lines:
        r = json.loads(line) if line.strip() else {}
        meta, m = r.get("metadata") or {}, r.get("metrics") or {}
        ttft = (m.get("time_to_first_token") or {}).get("value")
        if r.get("error") or ttft is None or meta.get("benchmark_phase") != "profiling":
            continue
        start = meta["request_start_ns"] + ttft * 1e6
        spans.append((start, max(start, float(meta["request_end_ns"]))))
    if not spans:
        return None
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    now = most = 0
    for _, step in edges:   # at equal times an end (-1) counts before a start: touching spans do not overlap
        now += step
        most = max(most, now)
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    return {"max": most, "mean": sum(b - a for a, b in spans) / span if span > 0 else 1.0, "requests": len(spans)}
