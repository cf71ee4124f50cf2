"""Long-context decode, prefill and KV capacity of a dense and a HARP engine on the runtimes users run
: our ONNX Runtime engine (``--quant``), onnxruntime-genai, llama.cpp (flash attention on,
``--kv-type``).

    python bench/long_context.py --model smollm2-135m --prune-layers 22,23,24,25,26,27,28,29 \\
        --runtime llamacpp --contexts 2048,4096 --batches 1,4 --prefill-lens 4096 --kv-budget 2GiB

The plan is ``--plan`` (a plan.json, a calibrate artifact or its key) or made from ``--model`` and
``--prune-layers`` at ``--alpha`` (speed does not depend on the alphas). ``--shape qwen2.5-0.5b`` (or
``llama3.2-1b``, any of ``bench/_shapes.py``'s) stands in a random-weight model of a real
model's shapes for ``--model`` (written once into ``--workdir``; positions up to its config's, past
8192), so long contexts can be timed on a larger model than SmolLM2. The engines are built by
the pipeline's own stages (``harp_trt.registry.BACKENDS``: the steps the runtime's bench compares),
cached in ``--workdir``. Per runtime, interleaved with the order rotating
(``bench/_long_context_measure.py``): decode tokens/s with ITL p50/p90/p99 at every context x batch,
prefill seconds at every ``--prefill-lens``, KV bytes per token as the runtime allocates them, peak
RSS of the process, the KV capacity of ``--kv-budget`` as the runtime sizes its caches (an expectation),
and on ORT and llama.cpp the sequences of ``--cap-context`` that decode inside ``--memory-cap``, measured
in capped child processes (``bench/_long_context_capacity.py``). ``--runs N`` (default 3) repeats all
of it in N processes and summarises them (``bench/_long_context_runs.py``: median [min, max], claims
that hold in every run); ``--kv-fill written`` writes the decode cache instead of prefilling it (ORT).
Every figure sits next to its ideal from ``harp_trt/flops.py``: bytes per decode step (weights
once plus every sequence's KV, at the runtime's weight and KV element sizes), prefill FLOPs, the
counted KV bytes per token, and L/(L-P) for capacity. Speed-ups carry 95 % intervals
(``harp_trt.bench.stage.latency.paired_speedup``). Writes ``long_context.png`` (matplotlib, if installed) and
``long_context.json`` under ``--out`` and ends stdout with the JSON object."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harp_trt.config import parse_ints  # noqa: E402
from harp_trt.errors import ConfigError, HarpError  # noqa: E402
from harp_trt.machine import describe  # noqa: E402
from harp_trt.memory import parse_bytes  # noqa: E402

from harp_trt.bench._long_context_peers import PEERS, load_peer, open_peer_plan, peer_path  # noqa: E402
from harp_trt.bench._pipeline_engines import RUNTIMES, add_quant_argument, build_sources, make_plan  # noqa: E402
from harp_trt.bench._shapes import SHAPES  # noqa: E402

__all__ = ["main", "parse_args", "run", "RUNTIMES"]

log = logging.getLogger("long_context")

QUIET_LOAD = 0.5   # 1-minute load average before the run at or below which the machine counts as quiet


def machine_note(load_before: float, load_after: float) -> str:
    """What the timings can be trusted for, from the machine's load average (other jobs before the
    run; the run's own threads are in the figure after it)."""
    state = "quiet" if load_before <= QUIET_LOAD else "busy"
    return (f"{state} machine: load average {load_before:.2f} before the run (others' jobs), {load_after:.2f} "
            "after it (this run's threads included); speed-up intervals cover this run's repeat-to-repeat "
            "noise only" + ("" if state == "quiet" else ", not the other jobs' load"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", help="plan.json, calibrate artifact folder or its key in --workdir")
    src.add_argument("--model", help="model reference (preset, HF folder); with --prune-layers")
    src.add_argument("--shape", choices=sorted(SHAPES),
                     help="a random-weight model of these real shapes (bench/_shapes.py); with --prune-layers")
    p.add_argument("--tokenizer", default="smollm2-135m", help="model whose tokenizer --shape borrows")
    p.add_argument("--prune-layers", default="", help="layers to prune with --model, e.g. 22,23,...,29")
    p.add_argument("--alpha", type=float, default=0.5, help="alpha of every pruned layer (default 0.5)")
    p.add_argument("--corpus", default="wiki", help="text the plan's perplexities are read on (with --model)")
    p.add_argument("--calib-tokens", type=int, default=512, help="tokens of that text (default 512)")
    p.add_argument("--runtime", default="ort", choices=[*RUNTIMES, "all"])
    add_quant_argument(p, default="none")
    p.add_argument("--gguf-type", default="none", help="llama.cpp: quantize both GGUFs with llama.cpp's quantizer "
                   "(q4_0, q4_k_m, ...; builders/gguf GGUF_TYPES; default none: the f16 files)")
    p.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="llama.cpp's KV cache type")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prefill-lens", default="4096,8192")
    p.add_argument("--kv-fill", default="prefill", choices=["prefill", "written"],
                   help="how a decode point's KV cache is filled: a real prefill (default), or written directly "
                        "with random values (ORT only; a step's cost does not depend on the values: 7B contexts)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per engine per round")
    p.add_argument("--repeats", type=int, default=5, help="rounds (pairs for the intervals)")
    p.add_argument("--prefill-repeats", type=int, default=0,
                   help="prefill pairs (default: --repeats); a long prefill costs a minute per engine here")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps / prefills first")
    p.add_argument("--kv-budget", default="2GiB", help="KV budget the capacity is measured in")
    p.add_argument("--capacity-step", type=int, default=256, help="token granularity of the capacity search")
    p.add_argument("--memory-cap", default="auto",
                   help="ORT and llama.cpp: sequences decoded inside this address-space cap (RLIMIT_AS, child "
                        "processes: bench/_long_context_capacity.py); auto = dense base + 10.5 dense sequences at "
                        "--cap-context, none = skip (default auto)")
    p.add_argument("--cap-context", type=int, default=0, help="context of the capped capacity (default: the longest "
                                                              "of --contexts)")
    p.add_argument("--peer", default="", choices=["", *PEERS],
                   help="time a peer beside the dense engine: genai-int4 (onnxruntime-genai's own int4 model, "
                        "with --runtime ort), llamacpp-convert (llama.cpp's converter and quantizer, --runtime llamacpp)")
    p.add_argument("--peer-plan", default="",
                   help="with --plan: a second plan of the same model (e.g. calibrate --replacement rrr) whose HARP "
                        "engine is timed beside, in the same rounds; its speed against the first plan's HARP engine "
                        "is reported as vs_harp (HARP ms / its ms, 95 %% interval: 1 = as fast)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of every engine of the run, peers included (default: every core; 0 = each "
                        "runtime's own default, which differ: genai's gave a speed-up above the ceiling)")
    p.add_argument("--runs", type=int, default=3,
                   help="independent process runs; the summary gives each figure's median, spread and whether "
                        "a claim holds in every run (default 3)")
    p.add_argument("--settle", type=float, default=150,
                   help="--runs > 1: seconds at most to wait before each run for the 1-minute load average to "
                        f"fall to {QUIET_LOAD} (the builds' and the previous run's threads; default 150)")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "harp-trt"), help="artifact cache")
    p.add_argument("--out", default="long_context_out", help="folder for the JSON and the plot")
    p.add_argument("--seed", type=int, default=0)
    return _checked(p.parse_args(argv))


def _checked(a: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags with their lists parsed and derived values set; ConfigError names the flag."""
    a.contexts = parse_ints(a.contexts, "--contexts", positive=True)
    a.batches = parse_ints(a.batches, "--batches", positive=True)
    a.prefill_lens = (parse_ints(a.prefill_lens, "--prefill-lens", positive=True)
                      if a.prefill_lens.strip() not in ("", "none") else ())
    a.layers = parse_ints(a.prune_layers, "--prune-layers", positive=True) if a.prune_layers else ()
    if (a.model or a.shape) and not a.layers:
        raise ConfigError("--model/--shape need --prune-layers (the layers to prune), e.g. --prune-layers 28,29")
    if a.peer_plan and not a.plan:
        raise ConfigError("--peer-plan compares two plans of one model: give the first with --plan")
    if a.plan and a.layers:
        raise ConfigError("--prune-layers makes a plan from --model; with --plan the plan names its layers")
    if not 0.0 <= a.alpha <= 1.0:
        raise ConfigError(f"--alpha must lie in [0, 1], got {a.alpha}")
    a.prefill_repeats = a.prefill_repeats or a.repeats
    for name in ("decode_steps", "repeats", "prefill_repeats", "capacity_step", "runs"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0 or a.threads < 0 or a.settle < 0:
        raise ConfigError("--warmup, --threads and --settle must be >= 0")
    a.kv_budget_bytes = parse_bytes(a.kv_budget)
    a.memory_cap_bytes = None if a.memory_cap in ("auto", "none") else parse_bytes(a.memory_cap, "--memory-cap")
    if a.cap_context < 0:
        raise ConfigError(f"--cap-context must be >= 0, got {a.cap_context}")
    a.runtimes = list(RUNTIMES) if a.runtime == "all" else [a.runtime]
    return a


def load_pair(runtime: str, plan, sources, args, headroom: int):
    from harp_trt.bench.stage.config import ENGINES, BenchConfig

    cfg = BenchConfig(engine=runtime, decode_tokens=headroom, greedy_tokens=1, threads=args.threads,
                      latency=False, accuracy=False)
    loader = ENGINES.get(runtime)
    if runtime == "llamacpp":
        return loader(plan, sources, cfg, kv_type=args.kv_type)
    if runtime == "genai":   # each batch prefill's buffers go back to the system when it ends
        return loader(plan, sources, cfg, arena=False)
    pair = loader(plan, sources, cfg)
    for e in pair.engines().values():  # an ORT session hands each long prefill's arena back
        if hasattr(getattr(e, "session", None), "shrink_after_prefill"):
            e.session.shrink_after_prefill = True
    return pair


def capacity_under_cap(runtime: str, sources, args, L: int, P: int) -> dict[str, Any] | None:
    """Dense and HARP sequences at ``--cap-context`` decoded inside one ``--memory-cap``, each try a
    child process under RLIMIT_AS (``bench/_long_context_capacity.py``); None where the runtime has no
    capped probe (genai) or ``--memory-cap none``. The engines are the files this run timed."""
    from harp_trt.bench._long_context_capacity import RUNTIMES as CAPPED, measure_capacity
    from harp_trt.bench.stage.engine_llamacpp import gguf_path
    from harp_trt.bench.stage.engine_ort import engine_folder

    if args.memory_cap == "none" or runtime not in CAPPED:
        return None
    path = gguf_path if runtime == "llamacpp" else engine_folder
    return measure_capacity(runtime, {v: path(sources[v]) for v in ("dense", "harp")},
                            args.cap_context or max(args.contexts), args.memory_cap_bytes, args.threads,
                            ideal=L / (L - P))


PACKAGES = ("torch", "numpy", "onnxruntime", "onnxruntime-genai", "llama_cpp_python", "transformers")


def _write_json(out: dict[str, Any], out_dir: Path) -> None:
    """``long_context.json`` under ``out_dir``, written beside it and renamed: never half-written."""
    tmp = out_dir / "long_context.json.tmp"
    tmp.write_text(json.dumps(out, indent=1, default=str))
    tmp.replace(out_dir / "long_context.json")


def run(args, argv: list[str]) -> dict[str, Any]:
    """One run: every runtime's figures in this process."""
    from harp_trt.store import ArtifactStore
    from harp_trt.versions import provenance

    from harp_trt.bench._long_context_runtime import measure_runtime
    from harp_trt.bench._long_context_plot import write_plot

    load_before = list(os.getloadavg())  # before this run's own work (calibration, engine builds)
    store = ArtifactStore(Path(args.workdir))
    plan, resolved, calib_art = make_plan(args, store)
    peer_plan = open_peer_plan(args, plan, store)
    L, P = plan.num_layers, len(plan.layers)
    out: dict[str, Any] = {
        "issue": 31, "provenance": provenance(argv, PACKAGES), "model": resolved.ref, "model_digest": resolved.digest,
        "plan": {"layers": list(plan.layers), "alphas": list(plan.alphas), "num_layers": L, "pruned": P,
                 "kept_fraction": (L - P) / L, "capacity_ideal": L / (L - P), "replacement": plan.replacement},
        "peer_plan": None if peer_plan is None else {"layers": list(peer_plan.layers), "alphas": list(peer_plan.alphas),
                                                     "replacement": peer_plan.replacement},
        "settings": {k: getattr(args, k) for k in ("contexts", "batches", "prefill_lens", "decode_steps", "repeats",
                                                   "prefill_repeats", "warmup", "kv_budget_bytes", "capacity_step",
                                                   "quant", "kv_type", "threads", "peer", "seed", "shape",
                                                   "memory_cap", "cap_context", "kv_fill")}
        | {"threads_equal": args.threads > 0},
        "machine": {**describe(args.threads or None), "cpus": os.cpu_count(), "load_avg_start": load_before},
        "runtimes": {}}
    headroom = args.warmup + args.repeats * args.decode_steps + 2
    for runtime in args.runtimes:
        t = time.perf_counter()
        sources = build_sources(runtime, plan, resolved, calib_art, store, args)
        pair = load_pair(runtime, plan, sources, args, headroom)
        peers, peer_pair = {}, None
        try:
            if args.peer and PEERS[args.peer] == runtime:
                peers[args.peer] = load_peer(args, resolved, store, pair.max_positions, headroom)
            if peer_plan is not None:   # its pair's HARP engine is timed; the pair closes both
                peer_pair = load_pair(runtime, peer_plan, build_sources(runtime, peer_plan, resolved, None, store, args),
                                      args, headroom)
            timed = {**peers, **({"peer-plan": peer_pair.harp} if peer_pair else {})}
            out["runtimes"][runtime] = measure_runtime(runtime, pair, timed, args)
            if args.peer in peers:
                out["runtimes"][runtime]["peer_files"] = {args.peer: str(peer_path(args.peer, resolved, store, args))}
        finally:
            pair.close()
            if peer_pair is not None:
                peer_pair.close()
            for e in peers.values():
                e.close()
        capped = capacity_under_cap(runtime, sources, args, L, P)
        if capped:
            out["runtimes"][runtime]["capacity_under_cap"] = capped
        out["runtimes"][runtime]["seconds"] = round(time.perf_counter() - t, 1)
    out["machine"]["load_avg_end"] = list(os.getloadavg())
    out["note"] = machine_note(out["machine"]["load_avg_start"][0], out["machine"]["load_avg_end"][0])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out["plot"], out["plot_note"] = write_plot(out, out_dir / "long_context.png")
    _write_json(out, out_dir)
    return out


def run_many(args, argv: list[str]) -> dict[str, Any]:
    """``--runs N``: the engines built here once, then N independent processes of one run each
    (``bench/_long_context_runs.py``), and their summary: medians, spreads, claims in every run."""
    from harp_trt.store import ArtifactStore
    from harp_trt.versions import provenance

    from harp_trt.bench._long_context_runs import run_processes, summarize

    store = ArtifactStore(Path(args.workdir))
    plan, resolved, calib_art = make_plan(args, store)
    peer_plan = open_peer_plan(args, plan, store)
    for runtime in args.runtimes:
        build_sources(runtime, plan, resolved, calib_art, store, args)
        if peer_plan is not None:
            build_sources(runtime, peer_plan, resolved, None, store, args)
    if args.peer:
        peer_path(args.peer, resolved, store, args)
    out_dir = Path(args.out)
    runs = run_processes(Path(__file__).resolve(), argv, args.runs, out_dir, QUIET_LOAD, args.settle)
    from harp_trt.bench._long_context_plot import write_summary_plot

    out = {"issue": 31, "provenance": provenance(argv, PACKAGES), "runs": runs, "summary": summarize(runs)}
    try:   # a plot is a view of the figures: its failure must not lose them
        out["plot"], out["plot_note"] = write_summary_plot([out], out_dir / "long_context.png")
    except Exception as e:  # noqa: BLE001
        out["plot"], out["plot_note"] = None, f"plot failed: {type(e).__name__}: {e}"
    _write_json(out, out_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        out = run(args, argv) if args.runs == 1 else run_many(args, argv)
    except HarpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
