"""Serving under load: the dense and the HARP engine of one plan behind one real
tritonserver, each driven by AIPerf at rising concurrency, with admission from one KV budget.

    python bench/serve_load.py --model smollm2-135m --prune-layers 22,23,24,25,26,27,28,29 --quant int4 \\
        --isl 4096 --osl 1024 --concurrency 1,2,4,8 --kv-budget 1GiB --runs 3 --soak-s 600

The engines are the pipeline's own (``bench/_pipeline_engines.py``, as ``long_context.py`` builds them:
cached in ``--workdir``), deployed by ``harp-trt deploy triton`` as the text-in/text-out
Python-backend model (``harp_trt/serving.py``) under the same ``--kv-budget``. The server is the
tritonserver of the nvidia-pytriton wheel (``harp_trt.triton_runtime``); AIPerf runs from its pinned
tool venv (``bench/_serve_aiperf.py``) through Triton's ``generate_stream`` endpoint. Per run, per
concurrency, dense and HARP alternate (the first one swaps each run). Figures are AIPerf's:
request and output-token throughput, TTFT and ITL p50/p99, errors.
AIPerf starts at most ``--request-rate`` requests/s (default 20): paced, its loop sleeps; without a
rate it polls for a free slot on a whole core, which on this 2-core machine halved the server.

Goodput: per model, the highest output tokens/s at a concurrency whose p99 ITL and p99 TTFT stay
under the SLO (``--slo-itl`` x and ``--slo-ttft`` x the dense model's p50 at concurrency 1). The
summary gives the median and the spread of ``--runs`` runs; beside HARP's serving gain stands
L/(L-P), its ceiling on KV-bound admission. Then: malformed requests mixed into the load
(``bench/_serve_checks.py``), a soak at the top concurrency (``--soak-s``; failures, RSS of the
server's processes after warm-up and at the end, greedy answers against ``harp-trt generate``), and
the server SIGKILLed mid-load and started again on the same repository. With
``--llamacpp-concurrency``, the same sweep against llama.cpp's own OpenAI-compatible server serving
the plan's deci GGUFs (``bench/_serve_llamacpp.py``: it serves one request at a time; ``--llamacpp-osl``
sets its requests' length, default ``--osl``). Writes ``serve_load.json``
and ``serve_load.png`` (matplotlib, if installed) under ``--out`` and ends stdout with the JSON."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harp_trt.config import parse_ints  # noqa: E402
from harp_trt.errors import ConfigError, HarpError  # noqa: E402

from harp_trt.bench._pipeline_engines import add_quant_argument  # noqa: E402

__all__ = ["main", "parse_args", "goodput", "summarize"]

log = logging.getLogger("serve_load")
ADMITS = re.compile(r"harp\[(\w+)\]: KV budget (\d+) B, (\d+) B of KV per token over (\d+) KV layers")
LARGEST = re.compile(r"harp\[(\w+)\]: largest decode batch so far: (\d+) sequences"
                     r"(?: \(\d+ queued, \d+ B of KV reserved, (\d+) B in KV buffers\))?")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model reference (preset, HF folder)")
    p.add_argument("--prune-layers", required=True, help="the layers HARP prunes, e.g. 22,23,...,29")
    p.add_argument("--alpha", type=float, default=0.5, help="alpha of every pruned layer (speed does not depend on it)")
    p.add_argument("--corpus", default="wiki", help="text the plan's perplexities are read on (default wiki)")
    p.add_argument("--calib-tokens", type=int, default=512, help="tokens of that text (default 512)")
    add_quant_argument(p, default="int4")
    p.add_argument("--isl", type=int, default=4096, help="prompt tokens (AIPerf's synthetic prompts)")
    p.add_argument("--osl", type=int, default=1024, help="output tokens of every request (ignore_eos)")
    p.add_argument("--concurrency", default="1,2,4,8", help="AIPerf concurrencies (default 1,2,4,8)")
    p.add_argument("--requests", default="", help="requests per concurrency, one number or one per --concurrency "
                                                  "(default 2 x concurrency, >= 4)")
    p.add_argument("--request-rate", type=float, default=20.0,
                   help="most requests/s AIPerf starts (paces its loop: without a rate it polls a core at 100 %%; "
                        "default 20)")
    p.add_argument("--kv-budget", default="1GiB", help="KV budget of both served models (default 1GiB)")
    p.add_argument("--runs", type=int, default=3, help="runs of the whole sweep (default 3)")
    p.add_argument("--slo-itl", type=float, default=3.0, help="SLO: p99 ITL under this x dense's p50 at concurrency 1")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: p99 TTFT under this x dense's p50 at concurrency 1")
    p.add_argument("--soak-s", type=float, default=600, help="soak seconds at the top concurrency, 0 = none")
    p.add_argument("--kill-after", type=float, default=20, help="seconds of load before the SIGKILL, 0 = no kill")
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads of each model (0: the engine's)")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "harp-trt"), help="artifact cache")
    p.add_argument("--tools", default="", help="where AIPerf's tool venv and the unzipped tritonserver live "
                                               "(default <workdir>/tools)")
    p.add_argument("--out", default="serve_load_out", help="folder for the JSON, the plot and AIPerf's exports")
    p.add_argument("--engine-json", default="", help="a bench/long_context.py JSON whose engine-level decode "
                                                     "speed-up is reported beside the server's")
    p.add_argument("--llamacpp-concurrency", default="",
                   help="AIPerf concurrencies against llama.cpp's own OpenAI-compatible server (llama_cpp.server, "
                        "the serve-llamacpp extra) serving the plan's deci GGUFs; empty (default): not run")
    p.add_argument("--llamacpp-osl", type=int, default=0,
                   help="output tokens per request against llama.cpp's server (default 0: --osl); it serves one "
                        "request at a time, so its sweep's time grows with OSL times the requests")
    p.add_argument("--gguf-type", default="none", help="those GGUFs' weights: none (f16) or q4_0 (default none)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.levels = parse_ints(a.concurrency, "--concurrency", positive=True)
    a.llamacpp_levels = (parse_ints(a.llamacpp_concurrency, "--llamacpp-concurrency", positive=True)
                         if a.llamacpp_concurrency else ())
    if a.llamacpp_levels:
        from harp_trt.bench._serve_llamacpp import available

        if (why := available()) is not None:
            raise ConfigError(why)
    counts = (parse_ints(a.requests, "--requests", positive=True) if a.requests.strip()
              else tuple(_default_requests(c) for c in a.levels))
    if len(counts) not in (1, len(a.levels)):
        raise ConfigError(f"--requests takes one count or one per concurrency ({len(a.levels)}), got {a.requests!r}")
    a.counts = dict(zip(a.levels, counts * len(a.levels) if len(counts) == 1 else counts))
    a.layers = parse_ints(a.prune_layers, "--prune-layers", positive=True)
    if min(a.isl, a.osl, a.runs, a.calib_tokens) < 1 or a.soak_s < 0 or a.kill_after < 0:
        raise ConfigError("--isl, --osl, --runs, --calib-tokens must be >= 1; --soak-s, --kill-after >= 0")
    from harp_trt.memory import kv_budget_bytes

    kv_budget_bytes(a.kv_budget)  # its form, before anything is built
    return a


def _default_requests(concurrency: int) -> int:
    return max(4, 2 * concurrency)


# ---- engines and repositories -------------------------------------------------------------------
def _built(args, runtime: str, **over) -> dict[str, Any]:
    """The dense and HARP artifacts of the plan for ``runtime`` (``bench/_pipeline_engines.py``,
    as ``long_context.py`` builds them: cached in ``--workdir``)."""
    from harp_trt.bench._pipeline_engines import build_sources, make_plan
    from harp_trt.store import ArtifactStore

    ns = SimpleNamespace(plan=None, shape=None, model=args.model, layers=args.layers, alpha=args.alpha,
                         corpus=args.corpus, calib_tokens=args.calib_tokens, quant=args.quant, gguf_type="none")
    vars(ns).update(over)
    store = ArtifactStore(Path(args.workdir))
    plan, resolved, calib = make_plan(ns, store)
    return build_sources(runtime, plan, resolved, calib, store, ns)


def engines(args) -> dict[str, Path]:
    """{"dense": folder, "harp": folder}: the pipeline's ORT engines of the plan."""
    return {v: Path(a.path) for v, a in _built(args, "ort").items()}


def gguf_files(args) -> dict[str, Path]:
    """{"dense": file, "harp": file}: the plan's deci GGUFs (``--gguf-type``)."""
    from harp_trt.bench.stage.engine_llamacpp import gguf_path

    return {v: gguf_path(a) for v, a in _built(args, "llamacpp", quant="none",
                                                           gguf_type=args.gguf_type).items()}


def deploy(engine_dirs: dict[str, Path], args, out: Path) -> Path:
    """One repository holding both models (``dense``, ``harp``), each written by ``deploy triton``."""
    from harp_trt.cli import main as cli

    repo = out / "repository"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    for name, folder in engine_dirs.items():
        one = out / f"deploy-{name}"
        argv = ["deploy", "triton", "--artifact", str(folder), "--out", str(one), "--model-name", name,
                "--kv-budget", args.kv_budget, "--prompt-limit", str(args.isl + 64),
                "--context-limit", str(args.isl + args.osl + 64), "--force"]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if cli(argv) != 0:
            raise HarpError(f"deploy triton failed for {folder}")
        shutil.move(str(one / name), str(repo / name))
    return repo


def admitted(log_text: str, tokens: int) -> dict[str, dict[str, Any]]:
    """Per model: the budget and KV bytes per token its log line states (``ort_llm_model.
    _log_admission``), the sequences of ``tokens`` tokens that admits (the server's own rule,
    ``harp_trt.memory.sequences_admitted``), and the largest decode batch it logged, which the load
    must not push past that, with the size of its in-place KV buffers then (never over the budget)."""
    from harp_trt.memory import sequences_admitted

    out: dict[str, dict[str, Any]] = {}
    for m in ADMITS.finditer(log_text):
        name, budget, per, layers = m.group(1), *map(int, m.groups()[1:])
        out[name] = {"kv_budget_bytes": budget, "kv_bytes_per_token": per, "kv_layers": layers,
                     "tokens": tokens, "admits": sequences_admitted(tokens, per, budget), "largest_batch_seen": 0,
                     "kv_buffer_bytes_seen": None}
    for m in LARGEST.finditer(log_text):
        if (row := out.get(m.group(1))) is not None:
            row["largest_batch_seen"] = max(row["largest_batch_seen"], int(m.group(2)))
            if m.group(3) is not None:   # the in-place KV buffers' size when that batch formed
                row["kv_buffer_bytes_seen"] = max(row["kv_buffer_bytes_seen"] or 0, int(m.group(3)))
    if "dense" in out and "harp" in out:
        out["harp_over_dense"] = out["harp"]["admits"] / max(1, out["dense"]["admits"])
        out["ceiling"] = out["dense"]["kv_layers"] / out["harp"]["kv_layers"]  # L / (L - P)
    return out


# ---- the sweep ----------------------------------------------------------------------------------
def sweep(aiperf: Path, servers: dict[str, Any], tokenizer: Path, args, out: Path, run: int,
          levels: tuple[int, ...] = (), endpoint: list[str] | None = None) -> list[dict[str, Any]]:
    """One run: at each concurrency, AIPerf on each model (``servers``: model -> its server) in turn."""
    rows = []
    order = ("dense", "harp") if run % 2 == 0 else ("harp", "dense")
    for c in levels or args.levels:
        n = args.counts.get(c) or _default_requests(c)
        for model in order:
            t0 = time.perf_counter()
            fig = _aiperf(aiperf, servers[model], tokenizer, args, model, c, n, out / f"aiperf-run{run}-{model}-c{c}",
                          seed=args.seed + run, endpoint=endpoint)
            rows.append({"run": run, "model": model, "concurrency": c, "requests": n,
                         "seconds": round(time.perf_counter() - t0, 1), **fig})
            log.info("run %d %s c=%d: %.1f output tok/s, ITL p99 %.1f ms, TTFT p99 %.0f ms, %s errors", run, model,
                     c, _get(rows[-1], "output_tokens_per_s", "avg"), _get(rows[-1], "itl_ms", "p99"),
                     _get(rows[-1], "ttft_ms", "p99"), rows[-1]["errors"])
    return rows


def _aiperf(aiperf: Path, server, tokenizer: Path, args, model: str, concurrency: int, requests: int, out: Path,
            **kw) -> dict[str, Any]:
    """One AIPerf run on ``model`` at the bench's lengths and request rate (``_serve_aiperf.profile``)."""
    from harp_trt.bench._serve_aiperf import profile

    return profile(aiperf, server.http, model, tokenizer, args.isl, args.osl, concurrency, requests, out,
                   rate=args.request_rate, **kw)


def _get(row: dict, metric: str, stat: str) -> float:
    v = (row.get(metric) or {}).get(stat)
    return float("nan") if v is None else float(v)


def goodput(rows: list[dict[str, Any]], args) -> dict[str, Any]:
    """SLO from dense's p50 at its lowest concurrency (this run); per model the highest output tokens/s at a
    concurrency whose p99 ITL and p99 TTFT meet it, and its saturation throughput."""
    dense = [r for r in rows if r["model"] == "dense"]
    if not dense:
        return {}
    base = min(dense, key=lambda r: r["concurrency"])
    slo = {"itl_ms": args.slo_itl * _get(base, "itl_ms", "p50"), "ttft_ms": args.slo_ttft * _get(base, "ttft_ms", "p50")}
    out: dict[str, Any] = {"slo": slo}
    for model in ("dense", "harp"):
        mine = [r for r in rows if r["model"] == model]
        ok = [r for r in mine if _get(r, "itl_ms", "p99") <= slo["itl_ms"] and _get(r, "ttft_ms", "p99") <= slo["ttft_ms"]
              and not r["errors"]]
        best = max(ok, key=lambda r: _get(r, "output_tokens_per_s", "avg"), default=None)
        sat = max(mine, key=lambda r: _get(r, "output_tokens_per_s", "avg"), default=None)
        out[model] = {"goodput_tokens_per_s": _get(best, "output_tokens_per_s", "avg") if best else 0.0,
                      "goodput_concurrency": best["concurrency"] if best else None,
                      "saturation_tokens_per_s": _get(sat, "output_tokens_per_s", "avg") if sat else 0.0,
                      "saturation_concurrency": sat["concurrency"] if sat else None}
    return out


def summarize(per_run: list[dict[str, Any]]) -> dict[str, Any]:
    """Median [min, max] over runs of each model's saturation and goodput, and HARP / dense."""
    def spread(vals):
        vals = [v for v in vals if v is not None]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": len(vals)} if vals else None

    out: dict[str, Any] = {}
    for key in ("saturation_tokens_per_s", "goodput_tokens_per_s"):
        out[key] = {m: spread([g[m][key] for g in per_run if g]) for m in ("dense", "harp")}
        out[key]["harp_over_dense"] = spread([g["harp"][key] / g["dense"][key] for g in per_run
                                              if g and g["dense"][key]])
    return out


# ---- beside the sweep: bad requests, soak, kill -------------------------------------------------
def bad_requests_under_load(aiperf: Path, server, tokenizer: Path, args, out: Path) -> dict[str, Any]:
    """Malformed requests to ``harp`` while AIPerf loads it: every one an error response, and
    AIPerf's requests around them without an error."""
    from harp_trt.bench import _serve_checks as checks

    c = max(args.levels)
    thread, box = checks.in_background(lambda: _aiperf(aiperf, server, tokenizer, args, "harp", c, max(4, c),
                                                       out / "aiperf-bad-requests", seed=args.seed))
    time.sleep(3)
    rows = checks.bad_requests(server.http, "harp")
    thread.join()
    load = box.get("result") or {"errors": box.get("error")}
    return {"rows": rows, "all_refused": all(r["ok"] for r in rows), "load_errors": load.get("errors"),
            "load_requests": load.get("requests")}


def soak(aiperf: Path, server, tokenizer: Path, dirs: dict[str, Path], args, out: Path) -> dict[str, Any]:
    """``--soak-s`` of AIPerf at the top concurrency on ``harp``; RSS of the server's processes
    sampled every 5 s (start: after the first tenth, the warm-up), then greedy answers checked."""
    from harp_trt.bench import _serve_checks as checks

    c = max(args.levels)
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    thread, box = checks.in_background(lambda: _aiperf(aiperf, server, tokenizer, args, "harp", c, 0,
                                                       out / "aiperf-soak", seed=args.seed, duration_s=args.soak_s))
    while thread.is_alive():
        samples.append((time.monotonic() - t0, checks.server_rss(server.proc.pid)))
        thread.join(timeout=5)
    load = box.get("result") or {"errors": box.get("error")}
    warm = [s for s in samples if s[0] >= args.soak_s / 10] or samples
    start, end = warm[0][1], samples[-1][1]
    prompts = ["The history of the city", "In mathematics, a group is", "The river flows"]
    greedy = {m: checks.greedy_matches(server.http, m, dirs[m], prompts, 16, Path(args.workdir)) for m in ("dense", "harp")}
    return {"seconds": args.soak_s, "concurrency": c, "requests": load.get("requests"), "failures": load.get("errors"),
            "output_tokens_per_s": load.get("output_tokens_per_s"), "rss_start_bytes": start, "rss_end_bytes": end,
            "rss_growth": (end / start - 1) if start else None, "greedy": greedy,
            "greedy_all_equal": all(r["equal"] for rows in greedy.values() for r in rows)}


def llamacpp_sweep(aiperf: Path, tokenizer: Path, args, out: Path) -> dict[str, Any]:
    """The same sweep against llama.cpp's own server (``bench/_serve_llamacpp.py``), one process per
    model, through AIPerf's OpenAI ``completions`` endpoint; ``serialises``: no run ever streamed two
    responses at once (``streams_in_flight``)."""
    from harp_trt.bench import _serve_llamacpp as lcs
    from harp_trt.bench._serve_aiperf import openai_completions

    ggufs = gguf_files(args)
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(**{**vars(args), "osl": args.llamacpp_osl or args.osl})
    servers = lcs.start_pair(ggufs, args.isl + args.osl + 64, args.threads or os.cpu_count() or 1, out,
                             quantized=args.gguf_type != "none")
    endpoint = openai_completions(lcs.extra_inputs(tokenizer))
    rows, per_run = [], []
    try:
        for run in range(args.runs):
            rows += (mine := sweep(aiperf, servers, tokenizer, args, out, run, args.llamacpp_levels, endpoint))
            per_run.append(goodput(mine, args))
    finally:
        for s in servers.values():
            s.stop()
    flights = [(r.get("streams_in_flight") or {}).get("max") for r in rows]
    return {"servers": lcs.describe(servers), "gguf": {k: str(v) for k, v in ggufs.items()},
            "gguf_type": args.gguf_type, "osl": args.osl, "points": rows, "goodput_per_run": per_run, "summary": summarize(per_run),
            "serialises": all(f == 1 for f in flights if f is not None) and any(f is not None for f in flights)}


def decode_speedup_beside(args) -> dict[str, Any] | None:
    """The engine-level decode speed-ups (HARP over dense, one process, no server) of a
    ``bench/long_context.py`` JSON (``--engine-json``) at the context nearest the serving one's
    middle (prompt + half the output), every batch it has: what the server's own overhead eats."""
    if not args.engine_json:
        return None
    path = Path(args.engine_json)
    data = json.loads(path.read_text())
    if "summary" not in data and "runtimes" in data:  # a --runs 1 JSON: summarised as --runs N summarises
        from harp_trt.bench._long_context_runs import summarize

        data = {**data, "summary": summarize([data])}
    rows = (((data.get("summary") or {}).get("runtimes") or {}).get("ort") or {}).get("decode") or []
    if not rows:
        raise ConfigError(f"{path}: no ORT decode figures (a bench/long_context.py --runtime ort JSON)")
    want = args.isl + args.osl // 2
    context = min({r["context"] for r in rows}, key=lambda c: abs(c - want))
    quant = re.search(r"--quant (\S+)", (data.get("provenance") or {}).get("command", ""))
    return {"source": str(path), "context": context, "quant": quant.group(1) if quant else "none",
            "batches": [{k: r.get(k) for k in ("batch", "speedup_median", "speedup_min", "speedup_max", "ceiling", "runs")}
                        for r in rows if r["context"] == context]}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from harp_trt import triton_runtime
        from harp_trt.bench import _serve_checks as checks
        from harp_trt.bench._serve_aiperf import tool_venv
        from harp_trt.machine import describe

        if (why := triton_runtime.available()) is not None:
            raise HarpError(f"tritonserver cannot run here: {why}")
        tools = Path(args.tools or Path(args.workdir) / "tools")
        aiperf = tool_venv(tools)
        dirs = engines(args)
        repo = deploy(dirs, args, out)
        tokenizer = repo / "harp" / "1" / "engine"
        root = tools / "tritonserver"
        server = triton_runtime.start(repo, root, timeout=600)
        from harp_trt.bench._serve_aiperf import AIPERF
        from harp_trt.versions import provenance

        prov = provenance(sys.argv[1:] if argv is None else argv, ("onnxruntime", "transformers", "numpy"))
        prov["versions"].update(aiperf=AIPERF.split("==")[1], tritonserver=f"2.51 ({triton_runtime.PYTRITON})")
        result: dict[str, Any] = {"issue": 32, "provenance": prov,
                                  "args": {k: v for k, v in vars(args).items() if k not in ("levels", "counts", "llamacpp_levels")},
                                  "machine": describe(), "engines": {k: str(v) for k, v in dirs.items()},
                                  "server_start_s": round(server.startup_s, 1)}
        try:
            rows, per_run = [], []
            for run in range(args.runs):
                rows += (mine := sweep(aiperf, {"dense": server, "harp": server}, tokenizer, args, out, run))
                per_run.append(goodput(mine, args))
            result["admission"] = admitted(server.log_tail(10**8), args.isl + args.osl)
            result.update(points=rows, goodput_per_run=per_run, summary=summarize(per_run))
            result["bad_requests"] = bad_requests_under_load(aiperf, server, tokenizer, args, out)
            if args.soak_s:
                result["soak"] = soak(aiperf, server, tokenizer, dirs, args, out)
            if args.kill_after:
                load = lambda: _aiperf(aiperf, server, tokenizer, args, "harp", max(args.levels),  # noqa: E731
                                       2 * max(args.levels), out / "aiperf-kill", seed=args.seed)
                server, result["kill"] = checks.kill_and_restart(
                    server, lambda: triton_runtime.start(repo, root, timeout=600), load, [repo, *dirs.values()],
                    "harp", args.kill_after)
        finally:
            server.stop()
        if args.llamacpp_levels:
            result["llamacpp"] = llamacpp_sweep(aiperf, tokenizer, args, out / "llamacpp")
        result["engine_decode_speedup"] = decode_speedup_beside(args)
        _finish(result, out)
    except HarpError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if getattr(e, "hint", None) else ""), file=sys.stderr)
        return e.exit_code
    return 0


def _finish(result: dict[str, Any], out: Path) -> None:
    from harp_trt.bench._serve_plot import plot

    result["plot"] = plot(result, out / "serve_load.png")
    (out / "serve_load.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    sys.exit(main())
