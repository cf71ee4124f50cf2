"""Flags shared by several commands. A config field's flag is declared on the field (``harp_trt.cli._options``)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Iterator

from ..config import parse_batch_sizes, parse_grid, parse_ints, parse_seq_len, parse_tasks
from ..errors import ConfigError

__all__ = ["add_model_argument", "add_calibrate_arguments", "calibrate_config_from_args",
           "add_placement_arguments", "placement_from_args", "parse_ints", "parse_tasks",
           "parse_grid", "parse_batch_sizes", "progress_bar", "default_layers"]

# CalibrateConfig fields whose flags given_layers_and_alphas / calibrate_config_from_args map themselves
_GIVEN_FIELDS = ("layers", "seq_len", "prune_layers", "alphas")


def add_model_argument(p: argparse.ArgumentParser, required: bool = True) -> None:
    from ..presets import preset_names

    p.add_argument("--model", required=required,
                   help=f"preset ({preset_names()}), HF id, local HF folder or .gguf file")


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    """CalibrateConfig's flags (from its fields), the ways to give layers and alphas, placement."""
    from ..config import cli_option
    from ..registry import STAGES
    from ._options import _container, add_config_arguments

    C = STAGES.get("calibrate").config_class()
    add_config_arguments(p, C)
    from ..presets import PRESETS

    g = _container(p, cli_option(next(f for f in dataclasses.fields(C) if f.name == "alphas")).group)
    g.add_argument("--alpha-order", choices=("ascending", "top-down"), default="ascending",
                   help="order of --alphas: ascending layer index, as plans store them (default), or "
                        "top-down, as the HARP paper lists them (first = highest pruned layer)")
    g.add_argument("--paper-alphas", action="store_true",
                   help="the HARP paper's published layers and alphas of a preset ("
                        + ", ".join(n for n, p in PRESETS.items() if p.paper_alphas) + ")")
    add_placement_arguments(p)
    p.add_argument("--naive", action="store_true", help="recompute the full model per candidate (reference search)")


def add_placement_arguments(p: argparse.ArgumentParser, resident_only: bool = False) -> None:
    """--device / --dtype / --device-map / --sequential (harp_trt.device); ``resident_only``: the
    first two (a model that is loaded whole, as bench's torch engine)."""
    from ..device import PlacementRequest
    from ._options import add_config_arguments

    add_config_arguments(p, PlacementRequest, ("device", "dtype") if resident_only else None, group="where PyTorch runs")


def placement_from_args(args, default_dtype: str | None = None):
    from ..device import resolve_placement

    return resolve_placement(args.device, args.dtype or default_dtype, args.device_map, args.sequential)


def default_layers(model_ref: str) -> int:
    from ..registry import STAGES

    CalibrateConfig = STAGES.get("calibrate").config_class()
    from harp_trt.presets import PRESETS

    return PRESETS[model_ref].default_layers if model_ref in PRESETS else CalibrateConfig.default("layers")


def given_layers_and_alphas(args) -> tuple[int | None, tuple[int, ...], tuple[float, ...]]:
    """(P, explicit layers, alphas in ascending layer order) from --layers / --prune-layers /
    --alphas / --alpha-order / --paper-alphas. P is None when nothing fixes it."""
    from harp_trt.presets import PRESETS

    prune = tuple(sorted(parse_ints(args.prune_layers, "--prune-layers"))) if args.prune_layers else ()
    if len(set(prune)) != len(prune):
        raise ConfigError(f"--prune-layers repeats a layer: {args.prune_layers}")
    alphas, order = (parse_grid(args.alphas, "--alphas") if args.alphas else ()), args.alpha_order
    if args.paper_alphas:
        if args.alphas:
            raise ConfigError("--paper-alphas and --alphas both give the alphas; use one")
        preset = PRESETS.get(args.model)
        if preset is None or not preset.paper_alphas:
            have = ", ".join(n for n, p in PRESETS.items() if p.paper_alphas)
            raise ConfigError(f"--paper-alphas: the HARP paper publishes no alphas for {args.model!r}",
                              f"presets with published alphas: {have}; or pass --alphas")
        # The published alphas belong to the top P layers (the official code applies them as
        # alpha_list[L - 1 - layer] to layers L-P..L-1); on layers another strategy or
        # --prune-layers picks they are numbers searched for different layers.
        if prune or args.strategy != "top":
            chosen = f"--prune-layers {args.prune_layers}" if prune else f"--strategy {args.strategy}"
            raise ConfigError(f"--paper-alphas are the HARP paper's alphas for the top {len(preset.paper_alphas)} "
                              f"layers; {chosen} would put them on other layers",
                              "drop that flag (--strategy top is the default), or search: leave out --paper-alphas")
        alphas, order = preset.paper_alphas, "top-down"
    layers = args.layers
    for what, n in (("--prune-layers", len(prune)), ("--alphas", len(alphas))):
        if n and layers is not None and n != layers:
            raise ConfigError(f"{what} gives {n} layers but --layers is {layers}")
        layers = n or layers
    if prune and alphas and len(prune) != len(alphas):
        raise ConfigError(f"--alphas gives {len(alphas)} values for {len(prune)} --prune-layers")
    if order == "top-down":
        alphas = tuple(reversed(alphas))
    return layers, prune, alphas


def calibrate_config_from_args(args):
    """(CalibrateConfig, Placement): the device kind and dtype go into the config (and the key).
    ``--objective paper`` defaults to bf16 and the model's maximum length."""
    from ..registry import STAGES
    from ._options import cli_fields, values_from_args

    CalibrateConfig = STAGES.get("calibrate").config_class()
    paper = args.objective == "paper"
    placement = placement_from_args(args, "bfloat16" if paper else None)
    layers, prune, alphas = given_layers_and_alphas(args)
    if layers is None:
        layers = default_layers(args.model)
    seq = args.seq_len if args.seq_len is not None else ("max" if paper else str(CalibrateConfig.default("seq_len")))
    seq_len = parse_seq_len(seq)
    plain = [f.name for f, _ in cli_fields(CalibrateConfig) if f.name not in _GIVEN_FIELDS]
    config = CalibrateConfig.from_dict({
        **values_from_args(CalibrateConfig, args, plain),
        "layers": layers, "seq_len": seq_len, "prune_layers": prune, "alphas": alphas,
        "dtype": placement.dtype, "device": placement.kind})
    return config, placement


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[tuple]:
    """(progress callback for the alpha search, phase callback). Renders to stderr."""
    if not enabled:
        yield None, None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, log_path=False)  # no "_common.py:153" column: the caller is always this file
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
