"""Render the docs' result tables from the JSON committed under ``docs/results/``, or check them.

    python bench/render_results.py            # rewrite every rendered block in README.md and docs/*.md
    python bench/render_results.py --check    # exit 1, naming each block that differs from its JSON

A rendered block in a Markdown file is the text between ``<!-- rendered: NAME FILE.json -->`` and
``<!-- /rendered -->``: ``RENDERERS[NAME]`` turns ``docs/results/FILE.json`` into that text (several
files, comma-separated, reach it as a list). A figure in
such a block is never typed by hand, so it cannot drift from the measurement it came from
(``tests/test_results_rendered.py`` runs the check). Ends stdout with one JSON object: the blocks
found, and those that differ (``--check``) or were rewritten."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from harp_trt.bench._render_calibration import (calibration, fit_inputs, plan_accuracy, recovery, replacement,
                                                sweep,
                                                replacement_headline, replacement_speed, replacement_texts)
from harp_trt.bench._render_headline import headline
from harp_trt.stats import ratio_ci95_across_runs
from harp_trt.bench._render_serve import serve_load, serve_load_headline

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
BLOCK = re.compile(r"(<!-- rendered: (\S+) (\S+\.json) -->\n)(.*?)(<!-- /rendered -->)", re.S)

__all__ = ["RENDERERS", "render_file", "main"]


def _ms(seconds: float, ci: float) -> str:
    return f"{seconds:.3f} +- {ci:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} +- {ci * 1e3:.1f} ms"


def gpu_check(d: dict[str, Any]) -> str:
    """``bench/gpu_check.py``'s JSON: the search, naive vs cached, prefill per length, decode."""
    a, nvc, dec = d["alpha_search"], d["naive_vs_cached"], d["decode"]
    paper = d["paper_prefill"]
    rows = ["| figure | dense | HARP | HARP / dense |", "|---|---|---|---|",
            f"| Algorithm 1, P = {len(a['layers'])}, {len(a['grid'])}-value grid, {a['tokens']} tokens "
            f"({a['windows']} windows), cached search | - | {a['seconds']:.1f} s (target <= {a['target_s']} s) | - |",
            f"| naive vs cached search (P = {len(nvc['layers'])}, grid {nvc['grid']}, {nvc['tokens']} tokens) | "
            f"naive {nvc['naive_s']:.2f} s | cached {nvc['cached_s']:.2f} s | {nvc['speedup']:.2f}x faster, "
            f"{'same' if nvc['identical_alphas'] else 'different'} alphas |"]
    for seq in sorted(d["prefill"], key=int):
        p = d["prefill"][seq]
        ratio = f"{d['prefill_speedup'][seq]:.3f}"
        if int(seq) == paper["seq_len"]:
            ratio += f" (paper, {paper['gpu']}: {paper['dense_s'] / paper['harp_s']:.3f})"
        rows.append(f"| prefill {seq} tokens (mean of 3, +- 95 %) | {_ms(*p['dense'])} | {_ms(*p['harp'])} | {ratio} |")
    b, t, kv = dec["batch"], dec["tokens_per_s"], dec["kv_bytes_per_token"]
    rows.append(f"| decode at {dec['context']} context, largest batch that fits | batch {b['dense']}: "
                f"{t['dense']:.0f} tok/s | batch {b['harp']}: {t['harp']:.0f} tok/s | {dec['throughput_ratio']:.3f} "
                f"(KV per token {kv['dense']} vs {kv['harp']} B) |")
    if "equal_batch" in dec:
        e = dec["equal_batch"]
        rows.append(f"| decode at dense's batch {e['batch']} | {e['tokens_per_s']['dense']:.0f} tok/s | "
                    f"{e['tokens_per_s']['harp']:.0f} tok/s | {e['speedup']:.3f} |")
    flagged = ", ".join(d["above_ceiling"]) or "none"
    rows.append(f"\nCeiling L/(L-P) = {d['speedup_ceiling']:.3f}; speed-ups above it: {flagged}. "
                f"{d['device']}, {d['dtype']}, torch {d['torch']}, attention {d['attention']}; the whole script "
                f"{d['seconds']:.0f} s.")
    return "\n".join(rows) + "\n"


def deps_newest(d: dict[str, Any]) -> str:
    """``.ci/newest``'s JSON: the suite on the newest releases inside the declared ranges."""
    differs = ", ".join(f"{n} {v['pinned']} -> {v['newest']}" for n, v in d["differs_from_constraints"].items())
    beyond = "; ".join(f"{r}: {', '.join(v)}" for r, v in d["releases_beyond_ranges"].items())
    return ("| commit | date | suite | newest in range vs the pins | releases past the ranges |\n|---|---|---|---|---|\n"
            f"| {d['commit']} | {d['date']} | {d['suite_tail'][-1]} (exit {d['suite_exit_code']}) | "
            f"{differs or 'equal to the pins'} | {beyond or 'none'} |\n")


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _speedup(p: dict[str, Any]) -> str:
    """Median (range of the runs; 95 % interval across them), flagged where a run's interval or the
    median lies above the ceiling."""
    ci = ratio_ci95_across_runs([r["speedup"] for r in p.get("per_run", [])])
    text = (f"{p['speedup_median']:.3f} (range {p['speedup_min']:.3f}-{p['speedup_max']:.3f}"
            + (f"; 95 % across runs {ci[0]:.3f}-{ci[1]:.3f})" if ci else ")"))
    if p["above_ceiling_runs"] or p["median_above_ceiling"]:
        runs = ", ".join(map(str, p["above_ceiling_runs"]))
        text += " **ABOVE CEILING" + (f" (run {runs})" if runs else " (median)") + "**"
    return text


FORMS = {"vo": "pruned layer as V + O", "folded": "pruned layer as one h x h"}   # flops.PRUNED_FORMS


def _point(runtime: str, what: str, engines: str, p: dict[str, Any], ideal_of: str) -> str:
    runs = ", ".join(f"[{r['ci95_low']:.3f}, {r['ci95_high']:.3f}]" for r in p["per_run"])
    return (f"| {runtime} | {what} | {engines} | {_speedup(p)} | {runs} | {p['ideal']:.3f} {ideal_of} "
            f"({FORMS[p['pruned_form']]}) | {p['ceiling']:.3f} | {p['fraction_median']:.2f} [{p['fraction_min']:.2f}] | "
            f"{_yes(p['lower_above_1_every_run'])}, {_yes(p['fraction_ge_0_9_every_run'])} |")


def _capacity_rows(d: dict[str, Any]) -> list[str]:
    rows = []
    for rt in d["summary"]["runtimes"]:
        per_run = [r["runtimes"][rt].get("capacity_under_cap") for r in d["runs"]]
        if not any(per_run):
            continue
        c = next(x for x in per_run if x)
        seqs = "; ".join(f"{x['dense']['batch']} / {x['harp']['batch']} ({x['ratio']:.3f})" for x in per_run if x)
        split = c["dense"]["rss_split"] or {}
        rows.append(f"| {rt} | {c['context']} | {c['cap_bytes'] / 2**30:.2f} GiB | {seqs} | {c['ideal']:.3f} | "
                    f"{min(x['fraction_of_ideal'] or 0 for x in per_run if x):.2f} | {c['granularity']:.3f} | "
                    f"{split.get('weights_runtime', 0) / 2**20:.0f} / {split.get('kv', 0) / 2**20:.0f} / "
                    f"{split.get('vm_activations', 0) / 2**20:.0f} MiB |")
    if rows:
        rows[:0] = ["", "| runtime | context | memory cap (RLIMIT_AS) | dense / HARP sequences (HARP / dense), each run "
                        "| ideal L/(L-P) | worst run / ideal | one dense sequence = | dense: weights+runtime / "
                        "KV (RSS) / the decode's added address space (run 1) |", "|---|---|---|---|---|---|---|---|"]
    return rows


def long_context(d: dict[str, Any]) -> str:
    """``bench/long_context.py --runs N``'s JSON: per runtime and point the runs' median speed-up with
    their spread and each run's 95 % interval, the ideal as the runtime stores a pruned layer, the
    ceiling L/(L-P) (a figure above it flagged), the claims that hold in every run, then the capacity
    inside a memory cap and where the figures come from."""
    s, first = d["summary"], d["runs"][0]
    rows = [f"| runtime | point | dense / HARP, median | HARP speed-up, median of {s['runs']} runs (their range; 95 % "
            "interval across them, t on log ratios) | "
            "each run's 95 % interval | ideal | ceiling | median / ideal [worst run] | every run: low > 1, >= 90 % "
            "of ideal |", "|---|---|---|---|---|---|---|---|---|"]
    for rt, r in s["runtimes"].items():
        for p in r["decode"]:
            tps = p["tokens_per_s_median"]
            peers = "".join(f", {k} {v:.3f} x ours" for k, v in p["peer_ratio_median"].items())
            rows.append(_point(rt, f"decode {p['context']} x {p['batch']}",
                               f"{tps['dense']:.1f} / {tps['harp']:.1f} tok/s{peers}", p, "bytes"))
        for p in r["prefill"]:
            sec = p["seconds_median"]
            rows.append(_point(rt, f"prefill {p['seq_len']}", f"{sec['dense']:.2f} / {sec['harp']:.2f} s", p, "FLOPs"))
    rows += _capacity_rows(d)
    plan, st, pv = first["plan"], first["settings"], d["provenance"]
    sizes = "; ".join(f"{rt}: weights {r['weight_bytes_per_param']:g} bytes per parameter, KV {r['kv_bytes_per_element']:g} "
                      "bytes per element" for rt, r in first["runtimes"].items())
    loads = "; ".join(f"{r['machine']['load_avg_start'][0]:.2f} -> {r['machine']['load_avg_end'][0]:.2f}"
                      for r in d["runs"])
    rows.append(f"\n{first['model'].rstrip('/').split('/')[-1]}, P = {plan['pruned']} of {plan['num_layers']} "
                f"(layers {plan['layers'][0]}-{plan['layers'][-1]}); {sizes}; {st['threads']} threads for every engine; "
                f"{first['machine']['cpu']}. Load average "
                f"before -> after each run: {loads}. Commit {pv['commit']}, {pv['date']}: `{pv['command']}`.")
    return "\n".join(rows) + "\n"


def long_context_headline(ds: list[dict[str, Any]]) -> str:
    """One row per ``bench/long_context.py --runs N`` JSON: its largest decode point (longest context,
    largest batch), the capacity inside the memory cap where measured, and the claims of every run."""
    rows = ["| runtime | decode, HARP / dense: median of the runs (their range; 95 % interval across them, t on log "
            "ratios) | byte ideal | ceiling | median / "
            "ideal | every run: low > 1, >= 90 % of ideal | sequences inside a memory cap, HARP / dense (ideal) |",
            "|---|---|---|---|---|---|---|"]
    for d in ds:
        for rt, r in d["summary"]["runtimes"].items():
            p = max(r["decode"], key=lambda m: (m["context"], m["batch"]))
            caps = [x["runtimes"][rt].get("capacity_under_cap") for x in d["runs"]]
            cap = ("not measured (`--memory-cap none`)" if d["runs"][0]["settings"].get("memory_cap") == "none"
                   else "not measured (no capped probe)")
            if all(caps):
                cap = (f"{caps[0]['dense']['batch']} -> {caps[0]['harp']['batch']} at {caps[0]['context']}: "
                       + ", ".join(f"{c['ratio']:.3f}" for c in caps) + f" ({caps[0]['ideal']:.3f}; a sequence "
                       f"is {caps[0]['granularity']:.3f})")
            rows.append(f"| {rt}, {p['context']} x {p['batch']} | {_speedup(p)} | {p['ideal']:.3f} | "
                        f"{p['ceiling']:.3f} | {p['fraction_median']:.2f} | {_yes(p['lower_above_1_every_run'])}, "
                        f"{_yes(p['fraction_ge_0_9_every_run'])} | {cap} |")
    return "\n".join(rows) + "\n"


def long_context_dense(ds: list[dict[str, Any]]) -> str:
    """The dense engines of several ``bench/long_context.py --runs N`` JSONs (separate runs on one
    machine, equal threads) and their peers: decode tokens/s medians per point, each beside the first
    JSON's dense engine (> 1: faster than it)."""
    points: dict[tuple[int, int], dict[str, float]] = {}
    labels: list[str] = []
    for d in ds:
        for rt, r in d["summary"]["runtimes"].items():
            for p in r["decode"]:
                for e, tps in p["tokens_per_s_median"].items():
                    if e == "harp":
                        continue
                    label = f"{rt} {e}"
                    labels += [label] if label not in labels else []
                    points.setdefault((p["context"], p["batch"]), {})[label] = tps
    base = labels[0]
    rows = ["| point | " + " | ".join(f"{x}, tok/s" for x in labels) + " | " +
            " | ".join(f"{x} / {base}" for x in labels[1:]) + " |", "|---" * (2 * len(labels)) + "|"]
    for (c, b), v in sorted(points.items()):
        rows.append(f"| decode {c} x {b} | " + " | ".join(f"{v[x]:.2f}" if x in v else "-" for x in labels) + " | " +
                    " | ".join(f"{v[x] / v[base]:.2f}" if x in v and base in v else "-" for x in labels[1:]) + " |")
    notes = "; ".join(f"{rt}: {r['weight_bytes_per_param']:.4g} bytes per weight, {d['runs'][0]['settings']['threads']} "
                      f"threads, `{d['provenance']['command']}` at {d['provenance']['commit']}"
                      for d in ds for rt, r in d["runs"][0]["runtimes"].items())
    return "\n".join(rows) + f"\n\nMedians of each JSON's runs. {notes}.\n"


_SIDE_NAMES = {"torch": "PyTorch eager fp32 (sdpa)", "genai_int4": "onnxruntime-genai int4"}


def _side_name(name: str) -> str:
    if name in _SIDE_NAMES:
        return _SIDE_NAMES[name]
    quant = name.split("_")[1]
    what = {"none": "fp32"}.get(quant, quant)
    return f"our ORT {what}, " + ("one call, all logits (before)" if name.endswith("_one_call")
                                   else "chunked, last logits (generate)")


def _vs_torch(sp: dict[str, Any], ceiling_digits: int = 1) -> str:
    """A prefill side's paired speed-up over PyTorch: ``point [95 % CI] (ceiling)``. A point above its
    ceiling is refused: the bound or the timing is wrong, and the table must not show it."""
    if sp["speedup"] > sp["ceiling"]:
        raise ValueError(f"speed-up {sp['speedup']} above its ceiling {sp['ceiling']}: find the bug, do not render it")
    return (f"{sp['speedup']:.2f} [{sp['speedup_ci95_low']:.2f}, {sp['speedup_ci95_high']:.2f}] "
            f"({sp['ceiling']:.{ceiling_digits}f})")


def prefill_profile(d: dict[str, Any]) -> str:
    """``bench/prefill_profile.py``'s JSON: per prompt length, every side's seconds, its speed-up over
    PyTorch with the 95 % interval and the ceiling, and the profile's seconds (GFLOP/s) per part."""
    rows = ["| prompt | side | seconds | speed-up vs PyTorch [95 % CI] (ceiling) | LM head | other GEMMs | attention "
            "| rest |", "|---|---|---|---|---|---|---|---|"]
    for n, row in d["lengths"].items():
        for name, f in row["sides"].items():
            sp = f.get("speedup_vs_torch")
            speed = _vs_torch(sp) if sp else "1"
            prof = f.get("profile_s") or {}
            rate = f.get("gflops_per_s") or {}
            parts = [(f"{prof[c]:.2f} s" + (f" ({rate[c]:.0f})" if c in rate else "")) if c in prof else "-"
                     for c in ("lm_head", "gemm", "attention", "other")]
            rows.append(f"| {n} | {_side_name(name)} | {f['seconds']:.3f} | {speed} | " + " | ".join(parts) + " |")
    m = d["machine"]
    dec = ", ".join(f"{_side_name(k).split(',')[0]} {v:.1f}" for k, v in d["decode_ms_per_token_at_512"].items())
    peaks = "; ".join(f"{n}: " + ", ".join(f"{q} {v / 1e9:.0f}" for q, v in r["gemm_peak_flops"].items())
                      for n, r in d["lengths"].items())
    ppl = d.get("heldout_perplexity")
    ppl_text = (f" Held-out Wikipedia perplexity ({ppl['tokens']} tokens, windows of {ppl['seq_len']}): "
                + ", ".join(f"{_side_name(k).split(',')[0]} {v:.3f}" for k, v in ppl.items() if k not in ("tokens", "seq_len"))
                + "." if ppl else "")
    return ("\n".join(rows) + f"\n\nMedians of {d['repeats']} interleaved repeats, {d['threads']} threads, chunk "
            f"{d['chunk']}; profile columns: seconds of one profiled call (GFLOP/s against the part's FLOPs). "
            f"Decode ms/token after a 512-token prompt: {dec}.{ppl_text} GEMM peaks (GFLOP/s, one MLP-shaped GEMM, M = the "
            f"prompt): {peaks}. CPU: {m['cpu']} ({', '.join(m['cpu_features'])}); load average "
            f"{m['load_avg_start'][0]:.2f} before, {m['load_avg_end'][0]:.2f} after; peak RSS {d['peak_rss_gb']} GB. "
            f"`{d['provenance']['command']}` at {d['provenance']['commit']}.\n")


def prefill_blocks(ds: list[dict[str, Any]]) -> str:
    """Several ``bench/prefill_profile.py`` runs of one model with different engines and
    ``--quant-block-size``: per run and side, the seconds and speed-up over that run's PyTorch [95 % CI]
    (ceiling) at every prompt length, and decode ms/token."""
    lengths = sorted({n for d in ds for n in d["lengths"]}, key=int)
    rows = ["| run: engines (block) | side | " + " | ".join(f"prefill {n}: s, vs PyTorch [95 % CI] (ceiling)"
                                                       for n in lengths) + " | decode ms/token | held-out perplexity |",
            "|---|---|" + "---|" * len(lengths) + "---|---|"]
    for d in ds:
        run = f"{', '.join(d['engines'])} ({d['quant_block_size']})"
        if d.get("genai"):
            run += f", genai int4 ({d['genai'].get('block_size', 32)})"
        for side in dict.fromkeys(s for row in d["lengths"].values() for s in row["sides"]):
            cells = []
            for n in lengths:
                f = d["lengths"].get(n, {}).get("sides", {}).get(side)
                sp = (f or {}).get("speedup_vs_torch")
                cells.append("-" if f is None else f"{f['seconds']:.2f}" + (f" ({_vs_torch(sp, 2)})" if sp else ""))
            dec = d["decode_ms_per_token_at_512"].get(side)
            ppl = (d.get("heldout_perplexity") or {}).get(side)
            rows.append(f"| {run} | {_side_name(side).split(',')[0]} | " + " | ".join(cells) +
                        (f" | {dec:.1f}" if dec is not None else " | -") + (f" | {ppl:.3f} |" if ppl else " | - |"))
    m = ds[0]["machine"]
    cmds = "; ".join(f"`{d['provenance']['command']}` at {d['provenance']['commit']}" for d in ds)
    rss = ", ".join(f"{d['peak_rss_gb']}" for d in ds)
    ppl = next((d["heldout_perplexity"] for d in ds if d.get("heldout_perplexity")), None)
    ppl_text = (f" Perplexity: held-out Wikipedia, {ppl['tokens']} tokens in windows of {ppl['seq_len']}." if ppl else "")
    return ("\n".join(rows) + f"\n\n{ds[0]['model']} ({'random weights' if ds[0].get('random_weights') else 'real weights'}"
            f"); our engines through `OrtCausalLM.prefill` (generate's path, chunk {ds[0]['chunk']}); medians of "
            f"{ds[0]['repeats']} interleaved repeats, {ds[0]['threads']} threads each, every speed-up paired "
            f"with PyTorch in its own run; decode after a 512-token prompt. {m['cpu']} ({', '.join(m['cpu_features'])}); "
            f"peak RSS per run {rss} GB (mapped weights included).{ppl_text} {cmds}.\n")


def prefill_headline(ds: list[dict[str, Any]]) -> str:
    """Several ``bench/prefill_profile.py`` JSONs side by side: per side, at every prompt length, the
    seconds and the speed-up over PyTorch [95 % CI] with its ceiling, and the held-out perplexity."""
    lengths = [(n, row) for d in ds for n, row in d["lengths"].items()]
    sides = list(dict.fromkeys(s for _, row in lengths for s in row["sides"] if not s.endswith("_one_call")))
    ppl = next((d["heldout_perplexity"] for d in ds if d.get("heldout_perplexity")), {})
    head = "| side | " + " | ".join(f"prefill {n}: s, vs PyTorch [95 % CI] (ceiling)" for n, _ in lengths) + \
        " | held-out perplexity |"
    rows = [head, "|---|" + "---|" * len(lengths) + "---|"]
    for side in sides:
        cells = []
        for _, row in lengths:
            f = row["sides"].get(side)
            sp = (f or {}).get("speedup_vs_torch")
            cells.append("-" if f is None else f"{f['seconds']:.2f}" + (f" ({_vs_torch(sp)})" if sp else ""))
        p = ppl.get(side)
        rows.append(f"| {_side_name(side).split(',')[0]} | " + " | ".join(cells) + f" | {p:.3f} |" if p
                    else f"| {_side_name(side).split(',')[0]} | " + " | ".join(cells) + " | - |")
    m = ds[0]["machine"]
    cmds = "; ".join(f"`{d['provenance']['command']}` at {d['provenance']['commit']}" for d in ds)
    return ("\n".join(rows) + f"\n\nOur engines through `OrtCausalLM.prefill` (generate's path); medians of "
            f"{ds[0]['repeats']} interleaved repeats, {ds[0]['threads']} threads each, on {m['cpu']} "
            f"({', '.join(m['cpu_features'])}). {cmds}.\n")


def _x(r: dict[str, Any]) -> str:
    return f"{r['speedup_vs_fp32']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"


def int4_kernels(d: dict[str, Any]) -> str:
    """bench/int4_kernels.py: per GEMM, fp32's rate, our int4 setting, the best int4 one and w8a8, each
    as a speed-up over fp32 MatMul with its interval, and the run's ceiling."""
    rows = ["| GEMM (K x N), M | fp32 MatMul GFLOP/s | our int4 (block 32, acc 4) | best int4 (block, acc) | w8a8 | ceiling |",
            "|---|---|---|---|---|---|"]
    for g in d["gemms"]:
        k, b = g["kernels"], g["best_int4"]
        best = k[f"int4_b{b['block']}_acc{b['accuracy_level']}"]
        rows.append(f"| {g['k']} x {g['n']}, {g['m']} | {k['fp32']['gflops']:.0f} | {_x(k['int4_b32_acc4'])} | "
                    f"{_x(best)} ({b['block']}, {b['accuracy_level']}) | {_x(k['w8a8'])} | {k['fp32']['ceiling']} |")
    m, pr = d["machine"], d["provenance"]
    return ("\n".join(rows) + f"\n\nSpeed-up over fp32 MatMul [95 % CI of {d['repeats']} interleaved pairs], each "
            f"call the best of 3; {d['threads']} threads; {m['cpu']} ({', '.join(m['cpu_features'])}); load average "
            f"{m['load_avg_start'][0]:.2f} before, {m['load_avg_end'][0]:.2f} after; peak RSS {d['peak_rss_gb']} GB. "
            f"`{pr['command']}` at {pr['commit']}.\n")


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {"gpu_check": gpu_check, "deps_newest": deps_newest,
                                                         "headline": headline, "calibration": calibration,
                                                         "int4_kernels": int4_kernels,
                                                         "long_context": long_context,
                                                         "long_context_headline": long_context_headline,
                                                         "long_context_dense": long_context_dense,
                                                         "prefill_profile": prefill_profile,
                                                         "prefill_headline": prefill_headline,
                                                         "prefill_blocks": prefill_blocks,
                                                         "serve_load": serve_load, "serve_load_headline": serve_load_headline,
                                                         "replacement": replacement, "replacement_headline": replacement_headline,
                                                         "replacement_speed": replacement_speed,
                                                         "replacement_texts": replacement_texts, "fit_inputs": fit_inputs,
                                                         "plan_accuracy": plan_accuracy, "recovery": recovery,
                                                         "sweep": sweep}


def render_file(text: str) -> tuple[str, list[str]]:
    """``text`` with each rendered block redone from its JSON, and the names of the blocks in it."""
    names: list[str] = []

    def redo(m: re.Match) -> str:
        name, file = m.group(2), m.group(3)
        if name not in RENDERERS:
            raise SystemExit(f"render_results: no renderer {name!r} (known: {', '.join(RENDERERS)})")
        names.append(f"{name} {file}")
        data = [json.loads((RESULTS / f).read_text()) for f in file.split(",")]
        return m.group(1) + RENDERERS[name](data if "," in file else data[0]) + m.group(5)

    return BLOCK.sub(redo, text), names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs from its JSON")
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md)")
    args = ap.parse_args(argv)
    found, changed = [], []
    for path in args.files or DOCS:
        text = path.read_text()
        new, names = render_file(text)
        found += [f"{path.name}: {n}" for n in names]
        if new != text:
            changed.append(path.name)
            if not args.check:
                path.write_text(new)
    for name in changed:
        print(f"{name}: {'differs from its JSON' if args.check else 'rewritten'}", file=sys.stderr)
    print(json.dumps({"blocks": found, "differ" if args.check else "rewritten": changed}))
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
