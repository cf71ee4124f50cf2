"""The bench's gates (``--max-ppl-increase``, ``--min-speedup``), read from a finished (or cached)
summary: not part of the stage key."""
from __future__ import annotations

from typing import Any, Mapping

from harp_trt.errors import GateError

__all__ = ["headline_speedup", "check_gates"]


def headline_speedup(summary: Mapping[str, Any]) -> tuple[str, float, float, float, int | None] | None:
    """(label, speed-up, 95 % CI low, high, pairs) the ``--min-speedup`` gate checks: prefill at the
    longest measured prompt (the paper's figure), else decode. A summary written before the
    intervals existed (bench config version 1) has the point only: it stands for both bounds and
    pairs is None."""
    spd = summary.get("speedups") or {}
    pre = summary.get("prefill_speedup") or {}
    if pre:
        seq = max(pre, key=lambda s: int(s))
        label, point, ci = f"prefill_{seq}", float(pre[seq]), spd.get(f"prefill_{seq}")
    elif summary.get("decode_speedup") is not None:
        label = f"inter_token_latency at {summary['decode_context']} tokens"
        point, ci = float(summary["decode_speedup"]), spd.get("inter_token_latency")
    else:
        return None
    if not ci:
        return label, point, point, point, None
    return label, float(ci["speedup"]), float(ci["speedup_ci95_low"]), float(ci["speedup_ci95_high"]), ci["pairs"]


def check_gates(summary: Mapping[str, Any], max_ppl_increase: float | None = None,
                min_speedup: float | None = None) -> list[str]:
    """Raise GateError naming each figure that fell short; return the gates that passed.
    ``--min-speedup`` fails only when the speed-up's 95 % confidence interval lies wholly below the
    threshold (its upper bound is below it): a difference inside the noise does not fail a build.
    A pass whose interval includes the threshold says "not resolved"."""
    failed, passed = [], []
    if max_ppl_increase is not None:
        p = summary.get("ppl") or {}
        if "increase" not in p:
            failed.append("held-out perplexity was not measured (run with accuracy on) but --max-ppl-increase "
                          "was given")
        elif p["increase"] > max_ppl_increase:
            failed.append(f"held-out perplexity increase {100 * p['increase']:.2f} % (dense {p['dense']:.4f} -> "
                          f"HARP {p['harp']:.4f}) exceeds --max-ppl-increase {max_ppl_increase:g} "
                          f"({100 * max_ppl_increase:.2f} %)")
        else:
            passed.append(f"ppl increase {100 * p['increase']:.2f} % <= {100 * max_ppl_increase:.2f} %")
    if min_speedup is not None:
        head = headline_speedup(summary)
        if head is None:
            failed.append("no speed-up was measured (run with latency on) but --min-speedup was given")
        else:
            label, point, low, high, n = head
            fig = f"{label} {point:.3f}x (95% CI {low:.3f}-{high:.3f})"
            basis = (f"{n} interleaved pairs" if n is not None
                     else "no interval in this summary: the point value stands for both bounds")
            if high < min_speedup:
                failed.append(f"{fig}: upper bound {high:.3f} below --min-speedup {min_speedup:g} ({basis})")
            elif low >= min_speedup:
                passed.append(f"{fig} >= {min_speedup:g}x, resolved: the whole interval is at or above it")
            else:
                passed.append(f"{fig} vs --min-speedup {min_speedup:g}x: not resolved, the interval includes "
                              f"it ({basis}; more --repeats narrow it)")
    if failed:
        raise GateError("bench gate failed: " + "; ".join(failed),
                        "see report.md in the bench artifact for the full tables")
    return passed
