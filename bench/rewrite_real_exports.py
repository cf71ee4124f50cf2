"""The HARP rewrite on graphs other exporters wrote, on a real model (default SmolLM2-135M, fp32).

Exports the model twice, with the tools users run:

* ``optimum-cli export onnx --task text-generation-with-past`` (optimum-onnx 0.1.0 needs
  transformers<4.58: it runs in its own venv, ``--optimum-python``; opset 18, SDPA decomposed);
* the onnxruntime-genai model builder ``-p fp32 -e cpu`` (``com.microsoft::GroupQueryAttention``,
  packed QKV, rotary inside the attention op), in this Python from a scratch folder;

then rewrites each with the plan (default P=4: layers 26-29, alphas 0.6 0.35 0.8 0.5), checks the
result with ``onnx.checker`` and verifies it in ONNX Runtime against the PyTorch HARP model
(``harp_trt.verify``: prefill + decode steps, tolerance ``rtol x max(1, max|logits|)``).
Each graph is rewritten and verified in a child process so its peak RSS is its own.

    python bench/rewrite_real_exports.py [--model smollm2-135m] [--optimum-python PY] [--json]

Exports are cached under ``<workdir>/real-exports/<exporter>-<model digest[:12]>``. Prints a table;
the last stdout line is one JSON object: per graph, layers matched, KV inputs removed, max |logit
diff|, tolerance, seconds (rewrite, verify) and peak RSS (MiB)."""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("harp_trt.bench.rewrite_real_exports")

GENAI_BOOTSTRAP = ("import runpy, sys; import onnxruntime_genai.models as m; "
                   "sys.path.insert(0, m.__path__[0]); "
                   "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__', alter_sys=True)")
DEFAULT_LAYERS = (26, 27, 28, 29)
DEFAULT_ALPHAS = (0.6, 0.35, 0.8, 0.5)


def stage_folder(src: Path, dst: Path) -> Path:
    """Symlinks to ``src`` plus a ``config.json`` both exporters read alike: ``architectures``
    (the genai builder needs it) and the rope base as ``rope_theta`` (transformers<4.58 does not
    read transformers 5's ``rope_parameters`` and would silently use 10000)."""
    cfg = json.loads((src / "config.json").read_text())
    cfg.setdefault("architectures", [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "mistral": "MistralForCausalLM"}.get(cfg.get("model_type"), "LlamaForCausalLM")])
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not f.name.startswith(".") and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _run(cmd: list[str], cwd: Path, timeout: float) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stderr or proc.stdout)[-3000:]}")
    return time.perf_counter() - t0


RECORD = "harp_export_record.json"


def _export(out: Path, cmd: list[str], cwd: Path, force: bool, timeout: float) -> dict:
    """Run the exporter ``cmd`` (its output folder is the last ``{out}`` placeholder) into a
    temporary folder renamed to ``out``; a finished ``out`` is reused unless ``force``. The
    command and its seconds are kept in ``out/RECORD``."""
    if (out / "model.onnx").is_file() and (out / RECORD).is_file() and not force:
        return {**json.loads((out / RECORD).read_text()), "cached": True}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    secs = _run([str(tmp) if c == "{out}" else c for c in cmd], cwd, timeout)
    record = {"command": cmd, "seconds": round(secs, 1)}
    (tmp / RECORD).write_text(json.dumps(record))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {**record, "cached": False}


def export_optimum(folder: Path, out: Path, python: str, force: bool = False, timeout: float = 3600) -> dict:
    cli = str(Path(python).parent / "optimum-cli")
    return _export(out, [cli, "export", "onnx", "--model", str(folder), "--task", "text-generation-with-past",
                         "--device", "cpu", "{out}"], folder.parent, force, timeout)


def export_genai(folder: Path, out: Path, force: bool = False, timeout: float = 3600) -> dict:
    work = folder.parent
    return _export(out, [sys.executable, "-c", GENAI_BOOTSTRAP, "-i", str(folder), "-o", "{out}", "-p", "fp32",
                         "-e", "cpu", "-c", str(work / "genai-cache")], work, force, timeout)


def _rewrite_and_verify(args: tuple) -> dict:
    """In a child process: rewrite ``src`` for the plan, verify against PyTorch HARP."""
    src, out, plan_dict, model_folder, rtol, decode_steps, greedy_steps = args
    import onnx

    from harp_trt.memory import peak_rss_bytes
    from harp_trt.plan import Plan
    from harp_trt.rewrite.stage import rewrite_onnx
    from harp_trt.verify import VerifyConfig, verify_rewrite

    plan = Plan.from_dict(plan_dict)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = rewrite_onnx(Path(src), plan, Path(out))
    t1 = time.perf_counter()
    ver = verify_rewrite(Path(out), Path(model_folder), plan.alpha_map,
                         VerifyConfig(rtol=rtol, decode_steps=decode_steps, greedy_steps=greedy_steps))
    t2 = time.perf_counter()
    g = onnx.load(str(out), load_external_data=False).graph
    return {
        "layers_matched": [r["layer"] for r in report["layers"]],
        "rules": sorted({r["rule"] for r in report["layers"]}),
        "kv_inputs_removed": [n for r in report["layers"] for n in r["kv_inputs_removed"]],
        "kv_inputs_before": report["kv_inputs_before"], "kv_inputs_after": report["kv_inputs_after"],
        "nodes_before": report["nodes_before"], "nodes_after": len(g.node),
        "params_removed": report["params_removed"],
        "max_abs_diff": ver.max_abs_diff, "prefill_max_abs_diff": ver.prefill_max_abs_diff,
        "tolerance": ver.tolerance, "rtol": rtol, "decode_steps": decode_steps, "greedy_steps": greedy_steps,
        "pad": ver.pad,
        "rewrite_s": round(t1 - t0, 2), "verify_s": round(t2 - t1, 2),
        "peak_rss_mib": round(peak_rss_bytes() / 2 ** 20, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="preset or HF folder (Llama-family)")
    ap.add_argument("--workdir", default=None, help="artifact cache (default: harp-trt's)")
    ap.add_argument("--optimum-python", default="/work/venvs/optimum/bin/python",
                    help="python of a venv with optimum-onnx==0.1.0, transformers<4.58, CPU torch")
    ap.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)))
    ap.add_argument("--alphas", default=",".join(map(str, DEFAULT_ALPHAS)))
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--greedy-steps", type=int, default=8)
    ap.add_argument("--only", choices=("optimum", "genai"), action="append", help="run only these exporters")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--force-export", action="store_true", help="export again even if cached")
    ap.add_argument("--json", action="store_true", help="(the JSON line is always printed last)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(args.workdir)
    resolved = resolve_model(args.model, store.root)
    cfg = json.loads((Path(resolved.folder) / "config.json").read_text())
    layers = tuple(int(x) for x in args.layers.split(","))
    alphas = tuple(float(x) for x in args.alphas.split(","))
    plan = Plan(model_ref=str(resolved.folder), model_digest=resolved.digest, family=cfg["model_type"],
                num_layers=int(cfg["num_hidden_layers"]), strategy="given", layers=layers, alphas=alphas)
    root = Path(store.root) / "real-exports"
    staged = stage_folder(Path(resolved.folder), root / f"hf-{resolved.digest[:12]}")
    exporters = args.only or ["optimum", "genai"]
    exports = {}
    for name in exporters:
        out = root / f"{name}-{resolved.digest[:12]}"
        log.info("export %s -> %s", name, out)
        exports[name] = (export_optimum(staged, out, args.optimum_python, args.force_export) if name == "optimum"
                         else export_genai(staged, out, args.force_export))
        exports[name]["onnx"] = str(out / "model.onnx")
    if args.export_only:
        print(json.dumps({"exports": exports}))
        return {"exports": exports}
    results = {}
    ctx = mp.get_context("spawn")
    for name in exporters:
        src = exports[name]["onnx"]
        out = root / f"rewritten-{name}-{resolved.digest[:12]}" / "model.onnx"
        log.info("rewrite + verify %s", name)
        with ctx.Pool(1) as pool:
            res = pool.apply(_rewrite_and_verify, ((src, str(out), plan.to_dict(), str(resolved.folder), args.rtol,
                                                    args.decode_steps, args.greedy_steps),))
        res["export_s"] = exports[name]["seconds"]
        res["export_cached"] = exports[name]["cached"]
        results[name] = res
        shutil.rmtree(out.parent, ignore_errors=True)
    summary = {"model": args.model, "model_digest": resolved.digest[:16], "layers": list(layers),
               "alphas": list(alphas), "graphs": results}
    hdr = f"{'graph':8s} {'matched':>12s} {'KV in -':>8s} {'max|diff|':>10s} {'tol':>9s} {'export s':>8s} " \
          f"{'rewrite s':>9s} {'verify s':>8s} {'RSS MiB':>8s}"
    print(hdr)
    for name, r in results.items():
        print(f"{name:8s} {','.join(map(str, r['layers_matched'])):>12s} {len(r['kv_inputs_removed']):8d} "
              f"{r['max_abs_diff']:10.3g} {r['tolerance']:9.3g} {r['export_s'] or 0:8.1f} {r['rewrite_s']:9.2f} "
              f"{r['verify_s']:8.2f} {r['peak_rss_mib']:8.0f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
