"""The README's one headline table (``bench/render_results.py``'s ``headline``): the trade HARP
offers on one model, speed and accuracy side by side. Per P, the dense model, HARP's searched
alphas and the fitted ``rrr`` maps: decode speed-up at the longest context measured (median of the
process runs with their range, beside the ceiling L/(L-P)), held-out perplexity on both unseen
texts, and lm-eval's mean task accuracy. Every cell comes from a committed JSON; a P without a
speed run says so."""
from __future__ import annotations

from typing import Any

from harp_trt.stats import ratio_ci95_across_runs

__all__ = ["headline"]


def _kind(d: dict[str, Any]) -> str:
    if "lm_eval" in d:
        return "accuracy"
    if "summary" in d and "runtimes" in d["summary"]:
        return "speed"
    raise ValueError("headline: a JSON that is neither calibration_table's (lm_eval) nor long_context's (summary)")


def _mean_acc(d: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``acc`` averaged over the tasks, per variant ('dense', 'harp P=4', 'rrr P=8', ...)."""
    by: dict[str, list[float]] = {}
    for r in d["lm_eval"]:
        if r.get("metric") == "acc":
            by.setdefault(r["variant"], []).append(r["value"])
    return {v: sum(x) / len(x) for v, x in by.items()}


def _speed(runs: list[dict[str, Any]], p: int) -> str:
    """Each runtime's largest decode point of the runs whose plan pruned ``p`` layers, as
    ``runtime (bytes per weight as it stores them): median (range of N runs, min-max; the 95 %
    interval across them), context x batch``."""
    cells = []
    for d in runs:
        if d["runs"][0]["plan"]["pruned"] != p:
            continue
        for rt, r in d["summary"]["runtimes"].items():
            point = max(r["decode"], key=lambda m: (m["context"], m["batch"]))
            weights = d["runs"][0]["runtimes"][rt]["weight_bytes_per_param"]
            flag = " **ABOVE CEILING**" if point["above_ceiling_runs"] or point["median_above_ceiling"] else ""
            ci = ratio_ci95_across_runs([x["speedup"] for x in point.get("per_run", [])])
            across = f"; 95 % across them {ci[0]:.2f}-{ci[1]:.2f}" if ci else ""
            cells.append(f"{rt} ({weights:g} bytes per weight) {point['speedup_median']:.2f}x (range of {point['runs']} runs "
                         f"{point['speedup_min']:.2f}-{point['speedup_max']:.2f}{across}){flag}, "
                         f"{point['context']} x {point['batch']}")
    return "; ".join(cells) or "not measured"


def _layers(speed: list[dict[str, Any]]) -> int:
    counts = {d["runs"][0]["plan"]["num_layers"] for d in speed}
    if len(counts) != 1:
        raise ValueError(f"headline: the speed runs are of models with {sorted(counts)} layers, not one model")
    return counts.pop()


LABELS = {("harp", "none"): "HARP, searched alphas", ("rrr", "none"): "HARP + fitted rrr maps",
          ("harp", "maps"): "HARP, V/O trained end to end (`--recover maps`)",
          ("rrr", "maps"): "HARP + rrr maps, trained end to end (`--recover maps`)"}


def headline(files: list[dict[str, Any]]) -> str:
    """Rows dense, then per P HARP searched, rrr and the recovered plans (calibration_table's JSONs,
    ``--recover``); columns speed, ceiling, perplexity, accuracy."""
    accs = [d for d in files if _kind(d) == "accuracy"]
    acc = accs[0]
    speed = [d for d in files if _kind(d) == "speed"]
    layers = _layers(speed)
    means = {k: v for d in accs for k, v in _mean_acc(d).items()}
    rows = {}
    for d in accs:
        for r in d["rows"]:
            rows[(r["P"], r["replacement"], r.get("recover", "none"))] = r
    ps = sorted({k[0] for k in rows})
    first = rows[(ps[0], "harp", "none")]
    other = (first.get("other") or {}).get("corpus", "other text")
    out = ["| plan | decode speed-up over dense: median of the runs (their range; 95 % interval across them, t on log ratios), context x batch | ceiling L/(L-P) | "
           f"held-out perplexity: Wikipedia, unseen half / {other} | lm-eval mean accuracy |",
           "|---|---|---|---|---|",
           f"| dense | 1 | 1 | {first['heldout_dense']:.2f} / {first['other']['dense']:.2f} | "
           f"{_pct(means.get('dense'))} |"]
    for p in ps:
        for (name, rec), label in LABELS.items():
            r = rows.get((p, name, rec))
            if r is None:
                continue
            sp = _speed(speed, p) if (name, rec) == ("harp", "none") else "as HARP's (the same GEMMs and shapes)"
            key = f"{name} P={p}" + (" recovered" if rec != "none" else "")
            out.append(f"| P = {p}: {label} | {sp} | {layers / (layers - p):.3f} | {r['heldout_searched']:.2f} / "
                       f"{r['other']['searched']:.2f} | {_pct(means.get(key))} |")
    n = sorted({r["n"] for d in accs for r in d["lm_eval"] if r.get("metric") == "acc"})
    tasks = sorted({r["task"] for d in accs for r in d["lm_eval"] if r.get("metric") == "acc"})
    return ("\n".join(out) + f"\n\n{acc['model']}, the top P of its {layers} layers pruned. Perplexity on "
            f"{acc['tokens']} tokens per text (windows of {acc['seq_len']}) that neither the search nor the fit read; "
            f"accuracy: the mean of {', '.join(tasks)} ({', '.join(map(str, n))} documents each, PyTorch fp32); speed: "
            "ONNX Runtime and llama.cpp engines, 2 threads, separate process runs.\n")


def _pct(x: float | None) -> str:
    return "not measured" if x is None else f"{x * 100:.1f} %"
