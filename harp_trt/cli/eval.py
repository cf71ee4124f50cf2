"""harp-trt eval: perplexity of the dense model, the plan's layers at alpha=1, and the plan."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config import option
from ._common import add_placement_arguments, placement_from_args
from ._options import add_config_arguments

NAME = "eval"
HELP = "perplexity of dense / alpha=1 / the plan (searched alphas, fitted maps) on any text"


@dataclass(frozen=True)
class Text:
    """Which text ``harp-trt eval`` scores, beside the search's budget (``CalibrateConfig``'s)."""

    split: str = option("heldout", choices=("heldout", "calib"), help="which half of the corpus (default %(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("calibrate").config_class()  # a light module

    p.add_argument("--plan", required=True, help="calibrate artifact folder, its key, or a plan.json")
    add_config_arguments(p, Text)
    # CalibrateConfig's flags: the same text budget the search had
    add_config_arguments(p, C, ("tokens", "seq_len", "corpus"), overrides={
        "corpus": {"help": "'wiki' (held-out split) or a .txt/.jsonl file (default %(default)s)"},
        "tokens": {"help": "tokens to score (default %(default)s)"},
        "seq_len": {"type": int, "help": "window length (default %(default)s)", "default": C.default("seq_len")}})
    p.add_argument("--model", default=None, help="override the plan's model reference (same weights)")
    add_placement_arguments(p)


def on_search_text(plan, corpus, split: str) -> bool:
    """Whether ``split`` of ``corpus`` holds documents that chose the plan's alphas. Asking for
    ``--split calib`` is asking for the search text; a "held-out" split that the search read
    (the plan searched every document, ``--search-split all``) is refused."""
    from ..errors import ConfigError

    if not plan.reads_search_text(corpus.digest, split):
        return False
    if split == "heldout":
        held = (plan.extra.get("search_split") or {}).get("heldout") or {}
        raise ConfigError(f"the plan searched every document of {corpus.name}, so it has no held-out half",
                          f"evaluate on its held-out text (--corpus {held.get('corpus', 'OTHER')}), or pass "
                          "--split calib to see the search text")
    return True


def run(args) -> dict:
    from ..evaluate import plan_perplexities
    from ..data import load_corpus, token_windows
    from ..models import load_tokenizer, resolve_model
    from ..onnx_io import check_plan_weights
    from ..plan import open_plan
    from ..store import ArtifactStore

    store = ArtifactStore(args.workdir)
    plan = open_plan(args.plan, store)
    resolved = resolve_model(args.model or plan.model_ref, store.root)
    check_plan_weights(plan.model_digest, resolved.digest, "eval", f"model {resolved.ref!r}")
    placement = placement_from_args(args)
    corpus = load_corpus(args.corpus, store.root)
    search_text = on_search_text(plan, corpus, args.split)
    windows = token_windows(load_tokenizer(resolved.folder), corpus, args.split, args.seq_len, args.tokens)
    ppl = plan_perplexities(plan, resolved.folder, windows, placement)
    return {"plan": str(args.plan), "corpus": corpus.name, "split": args.split, "search_text": search_text,
            "tokens": int(windows.numel()),
            "layers": list(plan.layers), "alphas": list(plan.alphas),
            "replacement": plan.replacement, "fitted_layers": list(plan.fitted_layers),
            **ppl, "device": placement.device, "dtype": placement.dtype}

