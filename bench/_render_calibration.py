"""The rendered text of a ``bench/calibration_table.py`` JSON run with ``--replacements``
(``bench/render_results.py``'s ``replacement``, ``replacement_texts``, ``fit_inputs``): held-out
perplexity of HARP's searched alpha beside the fitted maps, on the searched corpus's held-out half
and on a second text; each plan on the text that chose it beside the texts that did not; the
sequential fit beside the one-pass dense fit."""
from __future__ import annotations

from typing import Any

__all__ = ["calibration", "replacement", "replacement_headline", "replacement_speed", "replacement_texts", "fit_inputs",
           "plan_accuracy", "recovery", "sweep"]


def _cut(dense: float, harp: float, fitted: float) -> str:
    """How much of HARP's gap to dense the fitted map closes: (harp - fitted) / (harp - dense)."""
    return f"{(harp - fitted) / (harp - dense) * 100:.0f} %" if harp > dense else "-"


def _by_p(d: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    """The table's rows by P, then by replacement (harp, rrr, lmmse)."""
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for r in d["rows"]:
        by.setdefault(r["P"], {})[r["replacement"]] = r
    return by


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 1 \
        else ", ".join(map(str, layers))


def calibration(d: dict[str, Any]) -> str:
    """HARP's searched plans alone: per P the pruned layers, the searched alphas and held-out perplexity
    dense / alpha = 1 / searched, with the share of alpha = 1's loss the search takes back."""
    rows = ["| P | pruned layers | searched alphas | held-out PPL dense | alpha = 1 | searched | share of the alpha=1 "
            "loss recovered |", "|---|---|---|---|---|---|---|"]
    for p, by in sorted(_by_p(d).items()):
        h = by["harp"]
        share = (h["heldout_alpha1"] - h["heldout_searched"]) / (h["heldout_alpha1"] - h["heldout_dense"])
        rows.append(f"| {p} | {_span(h['layers'])} | {', '.join(f'{a:g}' for a in h['alphas'])} | "
                    f"{h['heldout_dense']:.2f} | {h['heldout_alpha1']:.2f} | **{h['heldout_searched']:.2f}** | "
                    f"{share * 100:.0f} % |")
    prov = d["provenance"]
    return ("\n".join(rows) + f"\n\n{d['tokens']} tokens per half, windows of {d['seq_len']}; "
            f"`{prov['command']}` at {prov['commit']}.\n")


def replacement_texts(d: dict[str, Any]) -> str:
    """Each plan's perplexity on the text that chose it (the search's: the fit text for a fitted plan,
    the calibration half for HARP's), on the select text (which chose map or alpha per layer), on the
    held-out half and on the other text, beside the dense model's; and whether the fitted plan reads
    worse than HARP's searched alphas on either unseen text."""
    by = _by_p(d)
    rows = ["| P | plan | search text: plan (dense) | select text: plan (dense) | held-out half | "
            f"{d.get('other_corpus') or 'other text'} | layers with a map | worse than HARP searched on an unseen text |",
            "|---|---|---|---|---|---|---|---|"]
    for p in sorted(by):
        harp = by[p]["harp"]
        for name in ("harp", "rrr", "lmmse"):
            r = by[p].get(name)
            if r is None:
                continue
            other = (r.get("other") or {}).get("searched")
            worse = "-"
            if name != "harp":
                bad = [t for t, mine, base in (("held-out", r["heldout_searched"], harp["heldout_searched"]),
                                               (d.get("other_corpus") or "other", other,
                                                (harp.get("other") or {}).get("searched")))
                       if mine is not None and base is not None and mine > base]
                worse = ", ".join(bad) or "no"
            sel = "-" if r.get("select_searched") is None else f"{r['select_searched']:.2f} ({r['select_dense']:.2f})"
            rows.append(f"| {p} | {'HARP searched' if name == 'harp' else name} | {r['calib_searched']:.2f} "
                        f"({r['calib_dense']:.2f}) | {sel} | {r['heldout_searched']:.2f} | {_f(other)} | "
                        f"{', '.join(map(str, r['fitted_layers'])) or ('-' if name == 'harp' else 'none')} | {worse} |")
    prov = d["provenance"]
    return ("\n".join(rows) + f"\n\n{d['tokens']} tokens per text, windows of {d['seq_len']}; dense held-out "
            f"{by[min(by)]['harp']['heldout_dense']:.2f}, dense {d.get('other_corpus') or 'other'} "
            f"{_f((by[min(by)]['harp'].get('other') or {}).get('dense'))}; `{prov['command']}` at {prov['commit']}.\n")


def fit_inputs(files: list[dict[str, Any]] | dict[str, Any]) -> str:
    """The same fitted replacement with maps fitted on sequential inputs (each layer on the model whose
    lower layers carry their maps) and on one dense pass, side by side per P."""
    files = files if isinstance(files, list) else [files]
    rows = ["| P | replacement | fit inputs | held-out half | other text | select text | layers with a map |",
            "|---|---|---|---|---|---|---|"]
    found = sorted(((r["P"], r["replacement"], r["fit_inputs"]), r) for d in files for r in d["rows"]
                   if r["replacement"] != "harp")
    for (p, rep, fi), r in found:
        rows.append(f"| {p} | {rep} | {fi} | {r['heldout_searched']:.2f} | {_f((r.get('other') or {}).get('searched'))} | "
                    f"{_f(r.get('select_searched'))} | {', '.join(map(str, r['fitted_layers'])) or 'none'} |")
    cmds = "; ".join(f"`{d['provenance']['command']}` at {d['provenance']['commit']}" for d in files)
    return "\n".join(rows) + f"\n\n{cmds}.\n"


def replacement(d: dict[str, Any]) -> str:
    by = _by_p(d)
    rows = ["| P | text | dense | alpha = 1 | HARP searched | rrr | lmmse | rrr's cut of HARP's gap | lmmse's cut |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(by):
        runs = by[p]
        harp, rrr, lm = runs["harp"], runs.get("rrr"), runs.get("lmmse")
        texts = [("held-out half", lambda r: (r["heldout_dense"], r["heldout_alpha1"], r["heldout_searched"]))]
        if "other" in harp:
            texts.append((f"{harp['other']['corpus']} (other text)",
                          lambda r: (r["other"]["dense"], r["other"]["alpha1"], r["other"]["searched"])))
        for name, get in texts:
            dense, a1, h = get(harp)
            fr = get(rrr)[2] if rrr else None
            fl = get(lm)[2] if lm else None
            rows.append(f"| {p} | {name} | {dense:.2f} | {a1:.2f} | {h:.2f} | "
                        f"{'-' if fr is None else f'**{fr:.2f}**'} | {'-' if fl is None else f'{fl:.2f}'} | "
                        f"{'-' if fr is None else _cut(dense, h, fr)} | {'-' if fl is None else _cut(dense, h, fl)} |")
    lines = ["\n| P | pruned layers | HARP's alphas | rrr kept in | rrr plan's alphas (1 where fitted) | lmmse kept in | calibrate seconds on a shared machine "
             "(harp / rrr / lmmse, fit included) |", "|---|---|---|---|---|---|---|"]
    for p in sorted(by):
        runs = by[p]
        h, rr, lm = runs["harp"], runs.get("rrr") or {}, runs.get("lmmse") or {}
        secs = " / ".join(f"{r['search_seconds'] + (r.get('fit_seconds') or 0):.0f}" for r in (h, rr, lm) if r)
        lines.append(f"| {p} | {', '.join(map(str, h['layers']))} | {', '.join(map(str, h['alphas']))} | "
                     f"{', '.join(map(str, rr.get('fitted_layers', []))) or 'none'} | "
                     f"{', '.join(map(str, rr.get('alphas', [])))} | {', '.join(map(str, lm.get('fitted_layers', []))) or 'none'} | "
                     f"{secs} |")
    cost = next((r["replacement_record"]["cost"] for r in d["rows"] if r["replacement"] == "lmmse"
                 and r.get("replacement_record")), None)
    tail = (f"\n\nCost per token of one replaced block: rrr {cost['harp_macs_per_token']:,} multiply-adds, as HARP's "
            f"V.O; lmmse {cost['macs_per_token']:,} ({cost['ratio_to_harp']:.2f}x). " if cost else "\n\n")
    prov = d["provenance"]
    return ("\n".join(rows) + "\n" + "\n".join(lines) + tail +
            f"{d['tokens']} tokens per text, windows of {d['seq_len']}; `{prov['command']}` at {prov['commit']}.\n")


def replacement_headline(d: dict[str, Any]) -> str:
    """The README's lines: held-out perplexity on both texts, HARP searched against rrr, per P."""
    by = _by_p(d)
    rows = ["| P | held-out text | dense | HARP searched | rrr | rrr's cut of HARP's gap to dense |", "|---|---|---|---|---|---|"]
    for p in sorted(by):
        h, rr = by[p]["harp"], by[p].get("rrr")
        if rr is None:
            continue
        pairs = [("Wikipedia, unseen half", h["heldout_dense"], h["heldout_searched"], rr["heldout_searched"])]
        if "other" in h:
            pairs.append((f"{h['other']['corpus']} (unseen text)", h["other"]["dense"], h["other"]["searched"],
                          rr["other"]["searched"]))
        rows += [f"| {p} | {name} | {dense:.2f} | {harp:.2f} | **{fit:.2f}** | {_cut(dense, harp, fit)} |"
                 for name, dense, harp, fit in pairs]
    return "\n".join(rows) + "\n"


def replacement_speed(files: list[dict[str, Any]] | dict[str, Any]) -> str:
    """``bench/long_context.py --plan HARP --peer-plan FITTED --runs N`` JSONs (one per runtime): per run,
    the fitted plan's (rrr or lmmse) engine's decode speed over the HARP plan's (``vs_harp``: HARP ms /
    fitted ms, paired 95 % interval over that run's rounds), the median over runs, and whether every
    interval holds 1."""
    files = files if isinstance(files, list) else [files]
    name = files[0]["runs"][0]["peer_plan"].get("replacement", "rrr")
    rows = [f"| runtime | context x batch | HARP plan tok/s (median of runs) | {name} plan tok/s | {name} / HARP per run "
            "[95 % interval] | median | every interval holds 1 |", "|---|---|---|---|---|---|---|"]
    cmds, plans = [], None
    for d in files:
        runs = d["runs"]
        plans = plans or (runs[0]["plan"], runs[0]["peer_plan"])
        runtime = next(iter(runs[0]["runtimes"]))
        for i, m0 in enumerate(runs[0]["runtimes"][runtime]["decode"]):
            ms = [r["runtimes"][runtime]["decode"][i] for r in runs]
            v = [m["vs_harp"]["peer-plan"] for m in ms]
            tok = {e: sorted(m["per_engine"][e]["tokens_per_s"] for m in ms)[len(ms) // 2] for e in ("harp", "peer-plan")}
            per = ", ".join(f"{x['speedup']:.3f} [{x['speedup_ci95_low']:.3f}, {x['speedup_ci95_high']:.3f}]" for x in v)
            med = sorted(x["speedup"] for x in v)[len(v) // 2]
            holds = all(x["speedup_ci95_low"] <= 1 <= x["speedup_ci95_high"] for x in v)
            rows.append(f"| {runtime} | {m0['context']} x {m0['batch']} | {tok['harp']:.1f} | {tok['peer-plan']:.1f} | "
                        f"{per} | {med:.3f} | {'yes' if holds else 'no'} |")
        cmds.append(f"`{d['provenance']['command']}` at {d['provenance']['commit']}")
    harp, fitted = plans
    removed = lambda p: [l for l, a in zip(p["layers"], p["alphas"]) if a == 0.0]  # noqa: E731
    blocks = ("two GEMMs of the same shapes in both" if name == "rrr" else
              f"HARP's two GEMMs (V, then the folded O) in one plan and {name}'s one hidden x hidden GEMM and bias Add "
              "in the other")
    return ("\n".join(rows) + f"\n\nPruned layers {', '.join(map(str, harp['layers']))} in both plans; blocks removed "
            f"outright (alpha 0): HARP {', '.join(map(str, removed(harp))) or 'none'}, {name} "
            f"{', '.join(map(str, removed(fitted))) or 'none'}; every other pruned layer is {blocks}. "
            + "; ".join(cmds) + ".\n")


def plan_accuracy(files: list[dict[str, Any]] | dict[str, Any]) -> str:
    """lm-eval accuracy per task (``acc``; LAMBADA's too) of the dense model and each plan, value
    +- lm-eval's standard error, and the plan's difference from dense with whether it exceeds twice
    the standard error of the difference (the two runs share their documents, so this is conservative).
    Several JSONs (the same tasks and ``--limit``) add their plans' rows to the first's."""
    import math

    files = files if isinstance(files, list) else [files]
    d = files[0]
    rows = [r for f in files for r in f.get("lm_eval", []) if r.get("metric") == "acc" and r.get("stderr") is not None]
    tasks = sorted({r["task"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["variant"], r["task"]): r for r in rows}
    out = ["| plan | " + " | ".join(tasks) + " | mean |", "|---" * (len(tasks) + 2) + "|"]
    for v in variants:
        cells, vals = [], []
        for t in tasks:
            r, base = by.get((v, t)), by.get(("dense", t))
            if r is None:
                cells.append("-")
                continue
            vals.append(r["value"])
            cell = f"{r['value'] * 100:.1f} ± {r['stderr'] * 100:.1f}"
            if v != "dense" and base is not None:
                diff = r["value"] - base["value"]
                se = math.hypot(r["stderr"], base["stderr"])
                cell += f" ({diff * 100:+.1f}{'*' if abs(diff) > 2 * se else ''})"
            cells.append(cell)
        out.append(f"| {v} | " + " | ".join(cells) + f" | {sum(vals) / len(vals) * 100:.1f} |")
    n = sorted({r["n"] for r in rows})
    limits = sorted({str(f.get("lm_eval_limit")) for f in files})
    provs = [f.get("lm_eval_provenance") or f["provenance"] for f in files]
    cmds = "; ".join(f"`{p['command']}` at {p['commit']}" for p in provs)
    return ("\n".join(out) + f"\n\nAccuracy in % ± lm-eval's standard error; (difference from dense, * where it exceeds "
            f"2 standard errors of the difference); {', '.join(map(str, n))} documents per task "
            f"(`--limit {', '.join(limits)}`, the first documents of each set); {cmds}.\n")


def recovery(files: list[dict[str, Any]] | dict[str, Any]) -> str:
    """End-to-end recovery (``calibration_table.py --recover maps``): per recovered plan its held-out
    perplexity before (the layer-wise plan of the same run) and after, the share of HARP's gap to dense
    closed (HARP = the searched-alpha row of the first JSON at that P), the second text, the select
    text's KL that stopped it, and its cost."""
    files = files if isinstance(files, list) else [files]
    harp = {r["P"]: r for d in files for r in d["rows"] if r["replacement"] == "harp" and r.get("recover", "none") == "none"}
    out = ["| P | plan | held-out perplexity, Wikipedia: layer-wise -> recovered (dense) | HARP's gap closed: layer-wise -> "
           "recovered | c4, recovered (dense) | select KL: start -> best | steps (best) | fit tokens, seen | seconds, "
           "peak RSS |", "|---|---|---|---|---|---|---|---|---|"]
    for d in files:
        for r in d["rows"]:
            rec = r.get("recovery")
            if not rec:
                continue
            lw, dense, h = r["layerwise"]["heldout_searched"], r["heldout_dense"], harp.get(r["P"])
            cut = (f"{_cut(dense, h['heldout_searched'], lw)} -> {_cut(dense, h['heldout_searched'], r['heldout_searched'])}"
                   if h else "-")
            other = r.get("other") or {}
            out.append(f"| {r['P']} | {r['replacement']}{'' if rec['kept'] else ' (not kept)'} | {lw:.2f} -> "
                       f"{r['heldout_searched']:.2f} ({dense:.2f}) | {cut} | {_f(other.get('searched'))} "
                       f"({_f(other.get('dense'))}) | {rec['select_kl_start']:.3f} -> {rec['select_kl_best']:.3f} | "
                       f"{rec['steps']} ({rec['best_step']}) | {rec['fit_tokens']}, {rec['tokens_seen']} | "
                       f"{rec['seconds']:.0f} s, {rec['peak_rss_bytes'] / 2**30:.1f} GiB |")
    prov = [d["provenance"] for d in files if any(r.get("recovery") for r in d["rows"])]
    cmds = "; ".join(f"`{p['command']}` at {p['commit']}" for p in prov)
    return ("\n".join(out) + "\n\nHARP's gap closed = (HARP searched - plan) / (HARP searched - dense) on the held-out half, "
            "HARP searched being the paper's plan at that P (its alphas searched on every even document); a recovered "
            "plan's own search and fit read the even documents' even half, its early stop their odd half. Seconds: the "
            f"recovery alone; peak RSS: the calibrating process's when it ended; CPU fp32, 2 threads. {cmds}.\n")


def sweep(d: dict[str, Any]) -> str:
    """``harp-trt sweep --json``: the frontier over P and the plan it picked at the budget."""
    pick = (d.get("chosen") or {}).get("P")
    out = [f"| P | pruned layers | alphas | held-out perplexity (dense {d['frontier'][0]['heldout_dense']:.2f}) | "
           f"increase | decode ceiling L/(L-P) | byte ideal at {d['context']} x {d['batch']} | KV saved |",
           "|---|---|---|---|---|---|---|---|"]
    for r in d["frontier"]:
        mark = " **picked**" if r["P"] == pick else ""
        out.append(f"| {r['P']}{mark} | {_span(r['layers'])} | {', '.join(f'{a:g}' for a in r['alphas'])} | "
                   f"{r['heldout']:.2f} | {r['ppl_increase'] * 100:+.1f} % | {r['ceiling']:.3f} | {r['byte_ideal']:.3f} | "
                   f"{r['kv_saved'] * 100:.0f} % |")
    budget = d.get("max_ppl_increase")
    picked = (f"At `--max-ppl-increase {budget:g}` the sweep picks P = {pick}." if pick is not None else
              f"No P is within `--max-ppl-increase {budget:g}`." if budget is not None else "")
    prov = d["provenance"]
    return ("\n".join(out) + f"\n\n{d['model']} ({d['num_layers']} layers), strategy {d['strategy']}, replacement "
            f"{d['replacement']}, recover {d['recover']}; byte ideal with {d['weight_bytes']:g} bytes per weight. {picked} "
            f"{d['seconds'] / 60:.0f} min in all (cached plans cost nothing), peak RSS {d['peak_rss_bytes'] / 2**30:.1f} GiB. "
            f"`{prov['command']}` at {prov['commit']}.\n")
