"""lm-eval accuracy of a model's dense form and of calibrated plans (HARP's alphas and any fitted
maps), in PyTorch fp32 on the CPU: the helper ``bench/reproduce_papers.py`` and
``bench/calibration_table.py`` share. One row per (variant, task, metric) with its standard error."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["plan_accuracy"]


def plan_accuracy(resolved, plans: dict[str, str], tasks: list[str], limit: int | None,
                  workdir_root: Path, dense: bool = True) -> list[dict[str, Any]]:
    """``plans``: variant name -> plan.json path (its ``replacement.safetensors`` beside it). The
    dense model is evaluated first as ``dense`` (unless ``dense`` is False: an earlier JSON has it)."""
    from harp_trt.bench.stage.engine_torch import TorchEngine
    from harp_trt.bench.stage.lm_eval_adapter import EngineLM, evaluate_tasks
    from harp_trt.bench.stage.tasks import eval_data_root, write_task_yamls
    from harp_trt.layerwise import LayerStack
    from harp_trt.models import load_model, load_tokenizer
    from harp_trt.plan import Plan

    tok = load_tokenizer(resolved.folder)
    yaml_dir = Path(workdir_root) / "tmp-plan-accuracy-tasks"
    write_task_yamls(tasks, eval_data_root(workdir_root), yaml_dir)
    rows: list[dict[str, Any]] = []
    for variant, plan_path in [("dense", None)] * dense + list(plans.items()):
        t = time.perf_counter()
        model, family = load_model(resolved, dtype="float32")
        if plan_path:
            plan = Plan.load(plan_path)
            LayerStack.wrap(model, family).apply_plan(plan.alpha_map, plan.fitted_tensors())
        lm = EngineLM(TorchEngine(model, variant), tok, batch_size=8)
        rows += evaluate_tasks({variant: lm}, tasks, [str(yaml_dir)], limit)
        print(f"lm-eval {variant}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return rows
