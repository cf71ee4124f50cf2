"""Flags shared by several commands. Defaults come from the config dataclasses' fields."""
from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from ..errors import ConfigError

__all__ = ["add_model_argument", "add_calibrate_arguments", "calibrate_config_from_args",
           "add_placement_arguments", "placement_from_args", "parse_ints", "parse_tasks",
           "parse_grid", "progress_bar", "default_layers"]


def add_model_argument(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required,
                   help="preset (smollm2-135m, llama3.1-8b, mistral-7b-v0.3, qwen2-7b, gemma2-9b), "
                        "HF id, local HF folder or .gguf file")


def parse_grid(text: str, flag: str = "--alpha-grid") -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers in [0, 1], got {text!r}") from None
    return vals


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


def parse_tasks(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_calibrate_arguments(p: argparse.ArgumentParser, layers_required: bool = False) -> None:
    from ..registry import STAGES

    C = STAGES.get("calibrate").config_class()  # defaults, from a light module
    from calib.config import PAPER_BOS, SEARCH_SPLITS

    p.add_argument("--layers", "-P", type=int, default=None, required=layers_required,
                   help="number of layers to prune (default: the preset's value, else "
                        f"{C.default('layers')})")
    p.add_argument("--strategy", default=C.default("strategy"),
                   help="layer scoring: top, bottom, gate-norm, gate-norm-folded, sink, bi, attn-sim "
                        "(default %(default)s)")
    p.add_argument("--alpha-grid", default=",".join(f"{a:g}" for a in C.default("alpha_grid")),
                   help="candidate alphas (default %(default)s)")
    p.add_argument("--search", default=C.default("search"), choices=("exhaustive", "golden"),
                   help="exhaustive: every grid value (the paper's Algorithm 1); golden: golden-section over "
                        "the sorted grid assuming unimodal perplexity, falling back to the full grid when a "
                        "probe contradicts it (default %(default)s)")
    g = p.add_argument_group("given layers and alphas (no search)")
    g.add_argument("--prune-layers", default=None,
                   help="prune exactly these layers, e.g. 28,29 (instead of a strategy's choice)")
    g.add_argument("--alphas", default=None,
                   help="use these alphas instead of searching, one per pruned layer, e.g. 0.8,0.2")
    g.add_argument("--alpha-order", choices=("ascending", "top-down"), default="ascending",
                   help="order of --alphas: ascending layer index, as plans store them (default), or "
                        "top-down, as the HARP paper lists them (first = highest pruned layer)")
    g.add_argument("--paper-alphas", action="store_true",
                   help="the HARP paper's published layers and alphas of a preset (llama3.1-8b, "
                        "mistral-7b-v0.3, qwen2-7b, gemma2-9b)")
    p.add_argument("--objective", choices=("windows", "paper"), default=C.default("objective"),
                   help="windows: fixed windows of --seq-len over the corpus (default); paper: the HARP "
                        "paper's objective, lm-eval wikitext style: whole documents prefixed with BOS in "
                        "rolling windows of the model's maximum length, bf16 unless --dtype")
    p.add_argument("--tokens", type=int, default=C.default("tokens"),
                   help="calibration tokens per split (default %(default)s)")
    p.add_argument("--seq-len", default=None,
                   help=f"window length, or 'max' (the model's maximum length) (default {C.default('seq_len')}; "
                        "with --objective paper: max)")
    p.add_argument("--corpus", default=C.default("corpus"), help="'wiki' or a .txt/.jsonl file (default %(default)s)")
    p.add_argument("--search-split", choices=SEARCH_SPLITS, default=C.default("search_split"),
                   help="halves: search on the corpus's even documents, held-out perplexity on its odd ones "
                        "(default); all: the HARP paper's split, search on every document of --corpus and "
                        "report held-out perplexity on --heldout-corpus")
    p.add_argument("--heldout-corpus", default=None,
                   help="with --search-split all: the other text ('wiki' or a .txt/.jsonl file) for held-out perplexity")
    p.add_argument("--paper-bos", choices=PAPER_BOS, default=C.default("paper_bos"),
                   help="with --objective paper: once = one BOS before each document (default); lm-eval-0.4.7 = "
                        "as that version scores Gemma: its tokenizer's BOS after the prefix BOS, the second one scored")
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


def placement_from_args(args, default_dtype: str | None = None):
    from ..device import resolve_placement

    return resolve_placement(args.device, args.dtype or default_dtype, args.device_map, args.sequential)


def default_layers(model_ref: str) -> int:
    from ..registry import STAGES

    CalibrateConfig = STAGES.get("calibrate").config_class()
    from harp_trt.models import PRESETS

    return PRESETS[model_ref].default_layers if model_ref in PRESETS else CalibrateConfig.default("layers")


def given_layers_and_alphas(args) -> tuple[int | None, tuple[int, ...], tuple[float, ...]]:
    """(P, explicit layers, alphas in ascending layer order) from --layers / --prune-layers /
    --alphas / --alpha-order / --paper-alphas. P is None when nothing fixes it."""
    from harp_trt.models import PRESETS

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

    CalibrateConfig = STAGES.get("calibrate").config_class()
    paper = args.objective == "paper"
    placement = placement_from_args(args, "bfloat16" if paper else None)
    layers, prune, alphas = given_layers_and_alphas(args)
    if layers is None:
        layers = default_layers(args.model)
    seq = args.seq_len if args.seq_len is not None else ("max" if paper else str(CalibrateConfig.default("seq_len")))
    if seq == "max":
        seq_len = 0
    else:
        try:
            seq_len = int(seq)
        except ValueError:
            raise ConfigError(f"--seq-len must be a number of tokens or 'max', got {seq!r}") from None
        if seq_len < 1:
            raise ConfigError(f"--seq-len must be >= 1 or 'max', got {seq!r}")
    config = CalibrateConfig.from_dict({
        "layers": layers, "strategy": args.strategy, "alpha_grid": parse_grid(args.alpha_grid),
        "tokens": args.tokens, "seq_len": seq_len, "corpus": args.corpus, "dtype": placement.dtype,
        "device": placement.kind, "prune_layers": prune, "alphas": alphas, "objective": args.objective,
        "search": args.search, "search_split": args.search_split, "heldout_corpus": args.heldout_corpus or "",
        "paper_bos": args.paper_bos,
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


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> tuple[int, ...]:
    """Request batch sizes for the bench's throughput runs; ``none`` = no throughput runs."""
    if text.strip().lower() == "none":
        return ()
    sizes = parse_ints(text, flag)
    if not sizes or any(b < 1 for b in sizes):
        raise ConfigError(f"{flag} must be positive request counts, got {text!r}",
                          f"e.g. {flag} 1,4,16, or 'none' to skip the throughput runs")
    return sizes
