"""Render the docs' result tables from the JSON committed under ``docs/results/``, or check them.

    python bench/render_results.py            # rewrite every rendered block in README.md and docs/*.md
    python bench/render_results.py --check    # exit 1, naming each block that differs from its JSON

A rendered block in a Markdown file is the text between ``<!-- rendered: NAME FILE.json -->`` and
``<!-- /rendered -->``: ``RENDERERS[NAME]`` turns ``docs/results/FILE.json`` into that text. A figure in
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


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {"gpu_check": gpu_check, "deps_newest": deps_newest}


def render_file(text: str) -> tuple[str, list[str]]:
    """``text`` with each rendered block redone from its JSON, and the names of the blocks in it."""
    names: list[str] = []

    def redo(m: re.Match) -> str:
        name, file = m.group(2), m.group(3)
        if name not in RENDERERS:
            raise SystemExit(f"render_results: no renderer {name!r} (known: {', '.join(RENDERERS)})")
        names.append(f"{name} {file}")
        return m.group(1) + RENDERERS[name](json.loads((RESULTS / file).read_text())) + m.group(5)

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
