"""Flags shared by several commands. Defaults come from the config dataclasses' fields."""
from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from ..errors import ConfigError

__all__ = ["add_model_argument", "add_calibrate_arguments", "calibrate_config_from_args",
           "add_placement_arguments", "placement_from_args",
           "parse_grid", "progress_bar", "default_layers"]


def add_model_argument(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required,
                   help="preset (smollm2-135m, llama3.1-8b, mistral-7b-v0.3, qwen2-7b, gemma2-9b), "
                        "HF id, local HF folder or .gguf file")


def parse_grid(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--alpha-grid must be comma-separated numbers in [0, 1], got {text!r}") from None
    return vals


def add_calibrate_arguments(p: argparse.ArgumentParser, layers_required: bool = False) -> None:
    from calib.stage import CalibrateConfig as C

    p.add_argument("--layers", "-P", type=int, default=None, required=layers_required,
                   help="number of layers to prune (default: the preset's value, else "
                        f"{C.default('layers')})")
    p.add_argument("--strategy", default=C.default("strategy"),
                   help="layer scoring: top, gate-norm, sink, bi, attn-sim (default %(default)s)")
    p.add_argument("--alpha-grid", default=",".join(f"{a:g}" for a in C.default("alpha_grid")),
                   help="candidate alphas (default %(default)s)")
    p.add_argument("--tokens", type=int, default=C.default("tokens"),
                   help="calibration tokens per split (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=C.default("seq_len"), help="window length (default %(default)s)")
    p.add_argument("--corpus", default=C.default("corpus"), help="'wiki' or a .txt/.jsonl file (default %(default)s)")
    add_placement_arguments(p)
    p.add_argument("--naive", action="store_true", help="recompute the full model per candidate (reference search)")


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """--device / --dtype / --device-map / --sequential (harp_trt.device)."""
    g = p.add_argument_group("where PyTorch runs")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto: CUDA when torch sees a GPU)")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--device-map", default=None,
                   help="spread a resident model over all visible GPUs (and CPU) with accelerate: auto | balanced | sequential")
    g.add_argument("--sequential", action="store_true", default=None,
                   help="load one decoder layer at a time from the safetensors files (chosen automatically "
                        "when the weights exceed the free memory)")


def placement_from_args(args):
    from ..device import resolve_placement

    return resolve_placement(args.device, args.dtype, args.device_map, args.sequential)


def default_layers(model_ref: str) -> int:
    from calib.stage import CalibrateConfig
    from harp_trt.models import PRESETS

    return PRESETS[model_ref].default_layers if model_ref in PRESETS else CalibrateConfig.default("layers")


def calibrate_config_from_args(args):
    """(CalibrateConfig, Placement): the device kind and dtype go into the config (and the key)."""
    from calib.stage import CalibrateConfig

    placement = placement_from_args(args)
    layers = args.layers if args.layers is not None else default_layers(args.model)
    config = CalibrateConfig.from_dict({
        "layers": layers, "strategy": args.strategy, "alpha_grid": parse_grid(args.alpha_grid),
        "tokens": args.tokens, "seq_len": args.seq_len, "corpus": args.corpus, "dtype": placement.dtype,
        "device": placement.kind,
    })
    return config, placement


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[tuple]:
    """(progress callback for the alpha search, phase callback). Renders to stderr."""
    if not enabled:
        yield None, None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        tasks: dict[int, int] = {}

        def on_candidate(layer, i, n, alpha, ppl):
            if layer not in tasks:
                tasks[layer] = prog.add_task(f"layer {layer}", total=n)
            prog.update(tasks[layer], completed=i + 1,
                        description=f"layer {layer}: alpha={alpha:.2f} ppl={ppl:.3f}")

        def on_phase(text):
            console.log(text)

        yield on_candidate, on_phase
