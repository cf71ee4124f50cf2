"""The rendered text of a ``bench/serve_load.py`` JSON (``bench/render_results.py``'s ``serve_load``):
the headline (admission, saturation throughput and goodput, HARP over dense with L/(L-P) beside),
the AIPerf figures per concurrency, the bad-request table, the soak and the kill, and llama.cpp's own
server beside Triton where the run has it."""
from __future__ import annotations

import statistics
from typing import Any

__all__ = ["serve_load", "serve_load_headline"]


def _spread(s: dict[str, Any] | None, fmt: str = "{:.1f}") -> str:
    """``median (range of N runs: min-max)``, or ``value (one run)``: a range, never read as an interval."""
    if not s:
        return "-"
    runs = s.get("runs")
    if runs == 1 or s["min"] == s["max"] == s["median"] and runs is None:
        return f"{fmt.format(s['median'])} (one run)"
    return (f"{fmt.format(s['median'])} (range of {runs or 'the'} runs: {fmt.format(s['min'])}-"
            f"{fmt.format(s['max'])})")


def _at(per_run: list[dict[str, Any]], key: str) -> str:
    """The concurrencies a figure was read at over the runs, per model: 'dense 1, HARP 1'."""
    out = []
    for model, name in (("dense", "dense"), ("harp", "HARP")):
        cs = sorted({r[model][key] for r in per_run if r.get(model) and r[model].get(key) is not None})
        out.append(f"{name} {', '.join(map(str, cs)) or '-'}")
    return "; ".join(out)


def _median(rows: list[dict[str, Any]], metric: str, stat: str) -> float | None:
    vals = [(r.get(metric) or {}).get(stat) for r in rows]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _headline(d: dict[str, Any]) -> list[str]:
    a, s, adm = d["args"], d["summary"], d["admission"]
    ceiling = adm.get("ceiling")
    frac = {m: adm[m]["kv_budget_bytes"] / (adm[m]["tokens"] * adm[m]["kv_bytes_per_token"]) for m in ("dense", "harp")}
    rows = ["| | dense | HARP | HARP / dense | ceiling L/(L-P) |", "|---|---|---|---|---|",
            f"| sequences of {a['isl'] + a['osl']} tokens the KV budget admits: whole (budget / sequence KV; "
            f"largest decode batch seen) | {adm['dense']['admits']} ({frac['dense']:.2f}; "
            f"{adm['dense']['largest_batch_seen']}) | {adm['harp']['admits']} ({frac['harp']:.2f}; "
            f"{adm['harp']['largest_batch_seen']}) | {adm['harp_over_dense']:.2f} (unrounded "
            f"{frac['harp'] / frac['dense']:.3f}) | {ceiling:.3f} |"]
    per = d.get("goodput_per_run") or []
    for key, what in (("saturation_tokens_per_s", "output tokens/s at saturation (the highest over the "
                       f"concurrencies; reached at concurrency {_at(per, 'saturation_concurrency')})"),
                      ("goodput_tokens_per_s", "goodput: the highest output tokens/s at a concurrency inside the "
                       f"SLO (concurrency {_at(per, 'goodput_concurrency')})")):
        rows.append(f"| {what} | {_spread(s[key]['dense'])} | {_spread(s[key]['harp'])} | "
                    f"{_spread(s[key]['harp_over_dense'], '{:.2f}')} | {ceiling:.2f} |")
    eng = d.get("engine_decode_speedup")
    if eng:
        for b in eng["batches"]:
            rows.append(f"| engine-level decode speed-up, batch {b['batch']}, context {eng['context']} "
                        f"(`bench/long_context.py`, no server) | | | "
                        f"{_spread({k: b[f'speedup_{k}'] for k in ('median', 'min', 'max')} | {'runs': b.get('runs')}, '{:.2f}')}"
                        f" | {b['ceiling']:.2f} |")
    return rows


def _flight(rows: list[dict[str, Any]]) -> str:
    got = [r["streams_in_flight"] for r in rows if r.get("streams_in_flight")]
    if not got:
        return "-"
    return f"{max(g['max'] for g in got)} / {statistics.median(g['mean'] for g in got):.1f}"


def _per_level(pts: list[dict[str, Any]]) -> list[str]:
    rows = ["| model | concurrency | requests x runs | output tokens/s | requests/s | TTFT p50 / p99 (s) | "
            "ITL p50 / p99 (ms) | streams at once: most / mean | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for model in ("dense", "harp"):
        for c in sorted({p["concurrency"] for p in pts}):
            mine = [p for p in pts if p["model"] == model and p["concurrency"] == c]
            if not mine:
                continue
            f = {k: _median(mine, *k.split(":")) for k in ("output_tokens_per_s:avg", "requests_per_s:avg",
                                                          "ttft_ms:p50", "ttft_ms:p99", "itl_ms:p50", "itl_ms:p99")}
            rows.append(f"| {model} | {c} | {int(mine[0]['requests'] or 0)} x {len(mine)} | "
                        f"{f['output_tokens_per_s:avg']:.1f} | {f['requests_per_s:avg']:.3f} | "
                        f"{f['ttft_ms:p50'] / 1000:.1f} / {f['ttft_ms:p99'] / 1000:.1f} | "
                        f"{f['itl_ms:p50']:.0f} / {f['itl_ms:p99']:.0f} | {_flight(mine)} | "
                        f"{sum(p['errors'] or 0 for p in mine)} |")
    return rows


def _llamacpp(d: dict[str, Any]) -> list[str]:
    """llama.cpp's own server beside Triton: its per-level table and saturation, HARP over dense."""
    lc = d.get("llamacpp")
    if not lc:
        return []
    s = lc["summary"]["saturation_tokens_per_s"]
    kind = "f16" if lc["gguf_type"] == "none" else lc["gguf_type"]
    return ["", f"llama.cpp's own OpenAI-compatible server (`python -m llama_cpp.server`, one process per model, "
                f"the plan's {kind} deci GGUFs), the same AIPerf through its `completions` endpoint: it serves "
                f"{'one request at a time' if lc['serialises'] else 'several requests at once'} (the most "
                f"responses streaming at once, from AIPerf's per-request records). Output tokens/s at saturation: "
                f"dense {_spread(s['dense'])}, HARP {_spread(s['harp'])}, HARP / dense "
                f"{_spread(s['harp_over_dense'], '{:.2f}')}.", "", *_per_level(lc["points"])]


def _checks(d: dict[str, Any]) -> list[str]:
    out = ["| bad request (sent during AIPerf load) | HTTP status | Triton's error |", "|---|---|---|"]
    for r in d["bad_requests"]["rows"]:
        out.append(f"| {r['request']} | {r['status']} | {r['error'][:110].replace('|', '/')} |")
    b = d["bad_requests"]
    out.append(f"\nThe load around them: {b['load_requests']:.0f} AIPerf requests, {b['load_errors']} errors.")
    soak = d.get("soak")
    if soak:
        greedy = sum(r["equal"] for rows in soak["greedy"].values() for r in rows)
        total = sum(len(rows) for rows in soak["greedy"].values())
        out.append(f"Soak: {soak['seconds']:.0f} s at concurrency {soak['concurrency']} on HARP: "
                   f"{soak['requests']:.0f} requests, {soak['failures']} failed; RSS of the server and its "
                   f"Python-backend stubs {soak['rss_start_bytes'] / 2**30:.2f} GiB after warm-up, "
                   f"{soak['rss_end_bytes'] / 2**30:.2f} GiB at the end ({100 * soak['rss_growth']:+.2f} %); "
                   f"greedy answers equal to `harp-trt generate`'s: {greedy} of {total}.")
    kill = d.get("kill")
    if kill:
        out.append(f"SIGKILL after {kill['killed_after_s']:.0f} s of load: repository and engines unchanged: "
                   f"{'yes' if kill['repository_and_engines_unchanged'] else 'NO'}; the new server was ready in "
                   f"{kill['ready_s']:.1f} s and answered in {kill['first_answer_s']:.1f} s.")
    return out


def serve_load(d: dict[str, Any]) -> str:
    a, g = d["args"], d["goodput_per_run"]
    slo = [x["slo"] for x in g if x]
    m = d["machine"]
    text = ("\n".join(_headline(d)) + "\n\n" + "\n".join(_per_level(d["points"])) + "\n\n" + "\n".join(_checks(d))
            + ("\n" + "\n".join(_llamacpp(d)) if d.get("llamacpp") else ""))
    return (text + f"\n\n{a['model']} {a['quant']} engines (HARP prunes layers {a['prune_layers']}), "
            f"{a['isl']} tokens in / {a['osl']} out (ignore_eos), KV budget {a['kv_budget']} for each model, one "
            f"tritonserver ({d['provenance']['versions']['tritonserver']}) holding both, AIPerf "
            f"{d['provenance']['versions']['aiperf']} streaming through `generate_stream` on the same "
            f"{m.get('cores', '?')} cores ({m['cpu']}). SLO per run: p99 ITL <= {a['slo_itl']:g} x and p99 TTFT "
            f"<= {a['slo_ttft']:g} x dense's p50 at concurrency {min(p['concurrency'] for p in d['points'])} "
            f"(run 0: {slo[0]['itl_ms']:.0f} ms, {slo[0]['ttft_ms'] / 1000:.1f} s). Medians with the range of "
            f"{a['runs']} runs. `{d['provenance']['command']}` at {d['provenance']['commit']}.\n")


def serve_load_headline(d: dict[str, Any]) -> str:
    """The README's table: admission, saturation and goodput, HARP over dense beside L/(L-P), and the
    engine-level decode speed-up without the server."""
    a = d["args"]
    return ("\n".join(_headline(d)) + f"\n\nMedians with the range of {a['runs']} runs of AIPerf "
            f"{d['provenance']['versions']['aiperf']}; `{d['provenance']['command']}` at "
            f"{d['provenance']['commit']}.\n")
