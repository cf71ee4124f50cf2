"""Memory and time of every stage on a randomly initialised model with a real model's shapes.

    python bench/scale_probe.py --shape qwen2-1.5b|qwen2-7b|llama3.1-8b|tiny [--stages calibrate,deploy,rewrite]

Writes the model once (bf16 safetensors, sharded, written tensor by tensor so the writer itself
holds one tensor; a borrowed SmolLM2 tokenizer), then runs each stage as a ``harp-trt`` command in a
subprocess and reads that subprocess's peak resident memory from ``wait4``. No weights are needed to
measure memory and time: shapes decide both. The last stdout line is one JSON object: per stage the
command, seconds, peak RSS, peak RSS / model bf16 bytes (and / fp32 graph bytes for the ONNX stages),
the path it took (in-memory or sequential), the disk bytes of each artifact it wrote and its exit code.

Stages: ``calibrate`` (auto placement), ``calibrate-seq`` (``--sequential``), ``deploy`` (TensorRT-LLM
checkpoint + HF folder, verified), ``rewrite`` (fp32 ONNX export + HARP rewrite + verification),
``build`` (``harp-trt build --backend ort --quant Q`` with a ``--sequential`` calibrate, every step
in one process: per step its seconds and the process's peak RSS when it ended, and the cache's
peak disk, sampled every second while it runs; ``--backend ort --quant int4`` as in the issue),
``generate`` (greedy tokens from the engine ``build`` wrote).
Delete the probe folder afterwards (``--clean``): a 7B probe is ~15 GB and its checkpoint as much again."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harp_trt.bench._pipeline_engines import add_quant_argument
from harp_trt.bench._random_model import write_random_model
from harp_trt.bench._shapes import SHAPES  # one table for every script

def _measured(cmd: list[str], env: dict) -> dict:
    """Run one command under a tiny wrapper process that reports the command's own peak RSS
    (``RUSAGE_CHILDREN`` of the wrapper: the command alone), its seconds and exit code."""
    wrapper = ("import json,subprocess,sys,time;from harp_trt.memory import children_peak_rss_bytes;"
               "t=time.perf_counter();"
               "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
               "sys.stderr.write(p.stderr);print(p.stdout);"
               "print(json.dumps({'__probe__':1,'peak_rss':children_peak_rss_bytes(),'code':p.returncode,"
               "'seconds':time.perf_counter()-t}))")
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env)
    lines = p.stdout.strip().splitlines()
    probe = json.loads(lines[-1])
    result = None
    for line in reversed(lines[:-1]):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
            break
    return {"seconds": round(probe["seconds"], 2), "peak_rss": probe["peak_rss"], "exit_code": probe["code"],
            "result": result, "stderr_tail": p.stderr.strip().splitlines()[-3:] if probe["code"] else []}


def artifact_bytes(cache: Path) -> dict[str, int]:
    """Disk bytes of every finished artifact folder in the cache (one with a ``manifest.json``),
    by folder name (``<stage>-<hash>``)."""
    if not cache.is_dir():
        return {}
    return {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            for d in sorted(cache.iterdir()) if (d / "manifest.json").is_file()}


def cache_bytes(cache: Path) -> int:
    """Bytes of every file under the cache folder (finished artifacts and temp folders alike)."""
    total = 0
    for dirpath, _, files in os.walk(cache):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:  # renamed or removed while walking
                pass
    return total


class DiskPeak:
    """The cache folder's peak size while a command runs (sampled every ``every`` seconds)."""

    def __init__(self, cache: Path, every: float = 1.0):
        import threading

        self.cache, self.every, self.peak = cache, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, cache_bytes(self.cache))
            self._stop.wait(self.every)

    def __enter__(self) -> "DiskPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, cache_bytes(self.cache))


def _stage_command(stage: str, calib: list[str], plan: str | None, args, model_dir: Path) -> list[str] | str:
    """The harp-trt command line of one probed stage, or why it is skipped."""
    if stage in ("calibrate", "calibrate-seq"):
        return calib + (["--sequential", "--force"] if stage == "calibrate-seq" else [])
    if stage == "build":
        return ["build", "--backend", args.backend, "--quant", args.quant, *calib[1:], "--sequential"] + \
            (["--keep-intermediates"] if args.keep_intermediates else [])
    if stage == "generate":
        return "needs a build stage first" if plan is None else \
            ["generate", "--artifact", plan, "--prompt", "The capital of France is", "--max-new-tokens", "8", "--no-stream"]
    if stage not in ("deploy", "rewrite"):
        raise SystemExit(f"unknown stage {stage!r}")
    if plan is None:
        return "needs a calibrate stage first"
    if stage == "deploy":
        return ["deploy", "trtllm", "--plan", plan, "--dtype", "bfloat16", "--tp", str(args.tp),
                "--max-input-len", "256", "--max-seq-len", "512"]
    return ["rewrite", "--model", str(model_dir), "--plan", plan]


def _stage_figures(stage: str, r: dict, bf16: int) -> dict:
    """Add the stage's figures to its record ``r`` (peak RSS against the bf16 and fp32-graph bytes,
    the plan's layers, the deploy's KV bytes, the rewrite's verification); returns the command's JSON."""
    if r["peak_rss"]:
        r["peak_rss_gb"] = round(r["peak_rss"] / 1e9, 3)
        r["rss_over_bf16_bytes"] = round(r["peak_rss"] / bf16, 3)
        if stage == "rewrite":
            r["rss_over_fp32_graph_bytes"] = round(r["peak_rss"] / (2 * bf16), 3)
    res = r.pop("result") or {}
    if stage.startswith("calibrate") and res.get("plan"):
        r["path"] = (res.get("placement") or {}).get("path")
        r["layers"], r["alphas"] = res.get("layers"), res.get("alphas")
        if res.get("replacement", "harp") != "harp":
            r["replacement"], r["fitted_layers"] = res["replacement"], res.get("fitted_layers")
    if stage == "deploy":
        for k in ("verify_max_abs_diff", "kv_bytes_per_token", "kv_bytes_per_token_unpruned"):
            r[k] = res.get(k)
    if stage == "rewrite":
        r["max_abs_diff"], r["verify_path"] = res.get("max_abs_diff"), res.get("verify_path")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b")
    ap.add_argument("--stages", default="calibrate,calibrate-seq,deploy,rewrite")
    ap.add_argument("--root", default=None, help="probe folder (default: $TMPDIR/harp-scale-<shape>)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--alpha-grid", default="0,0.5,1")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backend", default="ort", help="build stage: backend (default %(default)s)")
    add_quant_argument(ap, default="int4")   # the build stage's
    ap.add_argument("--keep-intermediates", action="store_true", help="build stage: keep export/rewrite weights")
    ap.add_argument("--dtype", default="bfloat16", help="calibration dtype (default %(default)s)")
    ap.add_argument("--replacement", default="harp",
                    help="calibrate: harp | rrr | lmmse (the fitted maps' statistics stream layer by layer)")
    ap.add_argument("--clean", action="store_true", help="delete the probe folder at the end")
    args = ap.parse_args(argv)

    from harp_trt.models import resolve_model
    from harp_trt.store import default_cache_root

    root = Path(args.root or Path(os.environ.get("TMPDIR", "/tmp")) / f"harp-scale-{args.shape}")
    model_dir, cache = root / "model", root / "cache"
    env = {**os.environ, "HARP_TRT_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    info_file = root / "model.json"
    if not info_file.is_file():
        tok = resolve_model("smollm2-135m", Path(os.environ.get("HARP_TRT_TOKENIZER_CACHE", default_cache_root())))
        t = time.perf_counter()
        info = write_random_model(args.shape, model_dir, tok.folder)
        info["write_seconds"] = round(time.perf_counter() - t, 1)
        info_file.write_text(json.dumps(info))
    info = json.loads(info_file.read_text())
    bf16 = info["bytes_bf16"]
    exe = [sys.executable, "-m", "harp_trt.cli"]
    common = ["--workdir", str(cache), "--json"]
    calib = ["calibrate", "--model", str(model_dir), "--dtype", args.dtype, "--device", "cpu",
             "--layers", str(args.layers), "--tokens", str(args.tokens), "--seq-len", str(args.seq_len),
             "--alpha-grid", args.alpha_grid] + (["--replacement", args.replacement] if args.replacement != "harp" else [])
    stages: dict[str, dict] = {}
    plan = engine = None
    for stage in [s for s in args.stages.split(",") if s]:
        cmd = _stage_command(stage, calib, engine if stage == "generate" else plan, args, model_dir)
        if isinstance(cmd, str):
            stages[stage] = {"skipped": cmd}
            continue
        before = artifact_bytes(cache)
        with DiskPeak(cache) as disk:
            r = _measured(exe + cmd + common, env)
        r["cache_peak_disk"] = disk.peak
        r["cache_disk_after"] = cache_bytes(cache)
        r["command"] = "harp-trt " + " ".join(cmd)
        r["artifact_bytes"] = {k: v for k, v in artifact_bytes(cache).items() if k not in before}
        res = _stage_figures(stage, r, bf16)
        if stage.startswith("calibrate") and res.get("plan"):
            plan = res["plan"]
        if stage == "build" and res.get("engine"):
            engine = res["engine"]
            r["cache_peak_disk_over_bf16_bytes"] = round(disk.peak / bf16, 3)
            r["steps"] = {k: {"seconds": v["seconds"], "cached": v["cached"], "peak_rss_gb_so_far":
                              round(v.get("peak_rss_so_far", 0) / 1e9, 3)} for k, v in res["stages"].items()}
            r.update(preflight=res.get("preflight"), quant=res.get("quant"), layers=res.get("layers"),
                     alphas=res.get("alphas"), kv_bytes_per_token=res.get("kv_bytes_per_token"))
        if stage == "generate":
            r["text"] = res.get("text") or res.get("completion")
            r["tokens"] = res.get("tokens") or res.get("new_tokens")
        stages[stage] = r
        print(f"{stage}: {r.get('seconds')} s, peak {r.get('peak_rss_gb')} GB, exit {r['exit_code']}",
              file=sys.stderr)
    from harp_trt.versions import provenance

    out = {"provenance": provenance(sys.argv[1:] if argv is None else list(argv)), "shape": args.shape,
           "model_bytes_bf16": bf16, "params": info["params"], "write_seconds": info.get("write_seconds"),
           "stages": stages}
    if args.clean:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))
    return 0 if all(s.get("exit_code", 0) == 0 for s in stages.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
