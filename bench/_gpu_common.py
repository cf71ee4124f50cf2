"""What the GPU-host scripts (``gpu_check.py``, ``gpu_prefill.py``, ``trtllm_check.py``) share: a run
that cannot happen on this machine raises :class:`Refused`, and :func:`run_main` turns it into exit 2
with ``{"status": "refused", "reason": ...}`` as the last stdout line (the reason also on stderr), or
prints the result as one JSON object with its ``status``. The 95 % confidence interval (``ci95``)
lives here too, for the scripts and ``_gpu_engines.py`` alike (the model shapes: ``bench/_shapes.py``)."""
from __future__ import annotations

import json
import math
import statistics
import sys
from typing import Any, Callable

__all__ = ["Refused", "run_main", "device_or_refuse", "ci95", "prefill_row"]

def ci95(xs: list[float]) -> tuple[float, float, float]:
    """(mean, half-width of the 95 % confidence interval, median)."""
    n = len(xs)
    mean = statistics.fmean(xs)
    if n < 2:
        return mean, float("nan"), mean
    from harp_trt.stats import t_quantile  # exact (the table it replaces rounded down between its rows)

    t = t_quantile(0.975, n - 1)
    return mean, t * statistics.stdev(xs) / math.sqrt(n), statistics.median(xs)


def prefill_row(variant: str, seq_len: int, xs: list[float]) -> dict:
    """One prefill row of the GPU scripts' CSV: ``xs`` seconds summarised by :func:`ci95`."""
    mean, half, med = ci95(xs)
    return {"variant": variant, "seq_len": seq_len, "mean_s": mean, "ci95_s": half, "median_s": med,
            "min_s": min(xs), "n": len(xs)}


class Refused(Exception):
    """The run cannot happen here (no GPU, no TensorRT-LLM, not an artifact): exit 2 with the reason."""


def device_or_refuse(script: str, dry_run: bool):
    """(device, dtype) to run on: a CUDA GPU in bf16, or the CPU in fp32 for a ``--dry-run``; with
    neither, :class:`Refused`."""
    import torch

    if not torch.cuda.is_available() and not dry_run:
        raise Refused(f"bench/{script} needs a CUDA GPU (none is visible to PyTorch); run it on a GPU machine, "
                      "or pass --dry-run to exercise it at tiny shapes on the CPU")
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def run_main(tool: str, run: Callable[[], dict[str, Any]], *, passed: Callable[[dict[str, Any]], bool] | None = None,
             default: Callable[[Any], Any] | None = None) -> int:
    """Run ``run()`` and print its result as JSON with ``status`` "ok" (exit 0), or "failed" (exit 1)
    where ``passed(result)`` is false; a :class:`Refused` prints the refusal and exits 2.
    ``default`` is ``json.dumps``'s, for values JSON has no type for."""
    try:
        result = run()
    except Refused as e:
        print(f"{tool}: {e}", file=sys.stderr)
        print(json.dumps({"status": "refused", "reason": str(e)}))
        return 2
    ok = passed is None or passed(result)
    result["status"] = "ok" if ok else "failed"
    print(json.dumps(result, default=default))
    return 0 if ok else 1
