"""harp-trt score: per-layer scores of one strategy and the P layers it would prune."""
from __future__ import annotations

import argparse

from ._common import add_model_argument, add_placement_arguments, default_layers, placement_from_args
from ._options import add_config_arguments

NAME = "score"
HELP = "score every layer with a strategy (top, gate-norm, sink, bi, attn-sim)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("calibrate").config_class()  # a light module

    add_model_argument(p)
    # CalibrateConfig's flags; scoring reads score_windows windows of seq_len tokens
    add_config_arguments(p, C, ("strategy", "layers", "tokens", "seq_len", "corpus"), overrides={
        "layers": {"help": "how many layers to select (default: the preset's value, else %(field_default)s)"},
        "tokens": {"default": C.default("score_windows") * C.default("seq_len"),
                   "help": "calibration tokens for data-driven strategies (default %(default)s)"},
        "seq_len": {"type": int, "help": "window length (default %(default)s)", "default": C.default("seq_len")}})
    p.add_argument("--save", default=None, help="write the table to a .csv or .parquet file")
    add_placement_arguments(p)


def check_save(text: str | None):
    """The ``--save`` path, checked before the scoring: a .csv or .parquet file in an existing folder."""
    from pathlib import Path

    from ..errors import ConfigError

    if text is None:
        return None
    path = Path(text).expanduser()
    if path.suffix not in (".csv", ".parquet"):
        raise ConfigError(f"--save must end in .csv or .parquet, got {text!r}")
    if not path.parent.is_dir():
        raise ConfigError(f"--save {text}: folder {path.parent} does not exist", "create it first")
    if path.is_dir():
        raise ConfigError(f"--save {text} is a folder; give a file name ending in .csv or .parquet")
    return path


def run(args) -> dict:
    import polars as pl
    from transformers import AutoConfig

    from ..errors import ConfigError
    from ..families import family_of
    from ..layerwise import LayerStack
    from ..models import load_tokenizer, resolve_model
    from ..registry import STAGES
    from ..store import ArtifactStore

    spec = STAGES.get("calibrate")  # the strategies are the calibrate stage's
    ScoreContext, get_strategy = spec.entry(".strategies:ScoreContext"), spec.entry(".strategies:get_strategy")

    save = check_save(args.save)  # before minutes of scoring
    if args.layers is not None and args.layers < 1:
        raise ConfigError(f"--layers must be a positive number of layers to select, got {args.layers}")
    store = ArtifactStore(args.workdir)
    strategy = get_strategy(args.strategy)
    placement = placement_from_args(args)
    resolved = resolve_model(args.model, store.root)
    cfg = AutoConfig.from_pretrained(resolved.folder, trust_remote_code=False)
    family = family_of(cfg)
    p = args.layers if args.layers is not None else default_layers(args.model)
    ctx = ScoreContext(family=family, config=cfg, folder=resolved.folder)
    if strategy.needs_data:  # data-free strategies stream weights and never load the model
        from ..data import load_corpus, prefix_token_id, token_windows

        ctx.stack = LayerStack.open(resolved.folder, placement)
        corpus = load_corpus(args.corpus, store.root)
        tok = load_tokenizer(resolved.folder)
        ctx.windows = token_windows(tok, corpus, "calib", args.seq_len, args.tokens)
        ctx.prefix_id = prefix_token_id(tok)
    scores = strategy.score(ctx)
    selected = strategy.select(scores, p)
    df = pl.DataFrame({"layer": list(range(len(scores))), "score": scores,
                       "selected": [i in selected for i in range(len(scores))]})
    if save is not None:
        df.write_parquet(save) if save.suffix == ".parquet" else df.write_csv(save)
    return {"model": args.model, "strategy": args.strategy, "scores": scores, "selected": selected,
            "_tables": {f"{args.strategy} scores": df.to_dicts()}}
