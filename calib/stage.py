"""The calibrate stage: score layers, choose P, search alpha (Algorithm 1); artifact = plan.

Artifact ``calibrate-<key>/``: ``plan.json`` (the contract for later stages, see
``harp_trt.plan``), ``search_trace.parquet`` (every candidate tried), ``scores.csv`` and
``alpha_search.png``. The key hashes the weights' digest, this config, the corpus digest and the
code version — not the model's path."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from harp_trt.errors import PreconditionError
from harp_trt.extras import figures_skipped
from harp_trt.plan import FITTED_FILE, Plan
from harp_trt.ppl import PAD
from harp_trt.stage import Stage
from harp_trt.versions import library_versions

from .config import CalibrateConfig
from .search import Progress, given_alphas, search_alphas
from .strategies import ScoreContext, get_strategy

__all__ = ["CalibrateStage", "CalibrateInputs"]

log = logging.getLogger(__name__)


@dataclass
class CalibrateInputs:
    """What the stage reads: a resolved model and a corpus (loaded lazily by the stage), and where
    to run. ``placement`` (device index, device map, sequential) does not change the numbers and
    is not part of the key; its device kind and dtype are, through the config."""

    resolved: Any               # harp_trt.models.ResolvedModel
    corpus: Any                 # harp_trt.data.Corpus
    naive: bool = False         # reference search; same answer, not part of the key
    progress: Progress | None = None
    on_phase: Callable[[str], None] | None = None
    placement: Any = None       # harp_trt.device.Placement; default: config.device / config.dtype
    heldout_corpus: Any = None  # harp_trt.data.Corpus of config.heldout_corpus (search_split "all")



class CalibrateStage(Stage[CalibrateConfig]):
    name = "calibrate"
    version = 1
    outputs = ("plan.json", "search_trace.parquet", "scores.csv")
    figures = ("alpha_search.png",)

    def key_material(self, config: CalibrateConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
        inp: CalibrateInputs = inputs["calibrate"]
        material = {"stage_version": self.version, "code": self.code_version(), "config": config.key_material(),
                    "weights": inp.resolved.digest, "corpus": inp.corpus.digest}
        if inp.heldout_corpus is not None:
            material["heldout_corpus"] = inp.heldout_corpus.digest
        return material

    def prepare(self, store, config: CalibrateConfig, inputs: Mapping[str, Any], hooks) -> dict[str, Any]:
        """``{"model": ResolvedModel}`` -> ``{"calibrate": CalibrateInputs}`` (the corpus is found
        by name and hashed; its text is read only on a cache miss)."""
        from harp_trt.data import load_corpus

        held = load_corpus(config.heldout_corpus, store.root) if config.heldout_corpus else None
        return {"calibrate": CalibrateInputs(inputs["model"], load_corpus(config.corpus, store.root),
                                             naive=bool(inputs.get("naive", False)), progress=hooks.progress,
                                             on_phase=hooks.on_phase, placement=hooks.placement,
                                             heldout_corpus=held)}

    def check_preconditions(self, config: CalibrateConfig, inputs: Mapping[str, Any]) -> None:
        from transformers import AutoConfig

        placement, held = inputs["calibrate"].placement, inputs["calibrate"].heldout_corpus
        if held is not None and held.digest == inputs["calibrate"].corpus.digest:
            raise PreconditionError(self.name, f"--heldout-corpus {config.heldout_corpus} holds the same text as "
                                    f"--corpus {config.corpus}; held-out perplexity would be on the search text",
                                    "name a different text")
        if placement is not None and (placement.kind, placement.dtype) != (config.device, config.dtype):
            raise PreconditionError(self.name, f"placement {placement.device}/{placement.dtype} disagrees with the "
                                    f"config's {config.device}/{config.dtype} (they enter the artifact key)")
        cfg = AutoConfig.from_pretrained(inputs["calibrate"].resolved.folder, trust_remote_code=False)
        n = cfg.num_hidden_layers
        if config.layers >= n:
            raise PreconditionError(self.name, f"--layers {config.layers} must be smaller than the model's "
                                    f"{n} layers (valid: 1..{n - 1})")
        out = [l for l in config.prune_layers if l >= n]
        if out:
            raise PreconditionError(self.name, f"--prune-layers {out} out of range for a {n}-layer model "
                                    f"(valid: 0..{n - 1})")

    def run(self, config: CalibrateConfig, inputs: Mapping[str, Any], out_dir: Path) -> dict[str, Any]:
        import polars as pl

        from harp_trt.data import prefix_token_id
        from harp_trt.device import resolve_placement
        from harp_trt.layerwise import LayerStack
        from harp_trt.models import load_tokenizer

        inp: CalibrateInputs = inputs["calibrate"]
        phase = inp.on_phase or (lambda s: log.info(s))
        timings: dict[str, float] = {}
        t = time.perf_counter()
        placement = inp.placement or resolve_placement(config.device, config.dtype)
        stack = LayerStack.open(inp.resolved.folder, placement)
        model, family = stack.model, stack.family
        phase(f"model on {placement.describe(stack.sequential)}")
        tok = load_tokenizer(inp.resolved.folder)
        sources = split_sources(config, inp)
        calib, held = _windows(config, tok, model.config, sources)
        timings["load"] = time.perf_counter() - t

        t = time.perf_counter()
        strategy_name, scores, selected = _select_layers(config, inp, stack, calib, prefix_token_id(tok), phase)
        timings["score"] = time.perf_counter() - t

        phase("dense perplexity")
        t = time.perf_counter()
        ppl_dense, ppl_held_dense = stack.perplexity(calib), stack.perplexity(held)
        timings["dense_ppl"] = time.perf_counter() - t

        fitted, held_at = _fit_and_fixed(config, stack, calib, held, selected, phase, timings)
        if config.alphas:
            phase(f"given alphas on layers {selected}")
            res = given_alphas(stack, family, calib, selected, config.alphas)
        else:
            phase(f"alpha search over layers {selected}")
            res = search_alphas(stack, family, calib, selected, config.alpha_grid, naive=inp.naive,
                                progress=inp.progress, method=config.search, fitted=fitted)
        timings["search"] = res.seconds

        phase("held-out perplexity")
        t = time.perf_counter()
        ppl_held_searched = stack.perplexity(held)
        timings["heldout_ppl"] += time.perf_counter() - t

        ppl = {"dense": ppl_dense, "alpha1": res.ppl_alpha1, "searched": res.ppl_searched,
               "heldout_dense": ppl_held_dense, "heldout_alpha1": held_at[1.0], "heldout_alpha0": held_at[0.0],
               "heldout_searched": ppl_held_searched}
        real = lambda w: int((w != PAD).sum())  # noqa: E731  tokens, right padding excluded
        scored = lambda w: int((w[:, 1:] >= 0).sum())  # noqa: E731  tokens predicted (ppl.window_nll)
        plan = Plan(model_ref=inp.resolved.ref, model_digest=inp.resolved.digest, family=family.name,
                    num_layers=model.config.num_hidden_layers, strategy=strategy_name,
                    layers=tuple(selected), alphas=tuple(res.alphas[l] for l in selected),
                    scores=tuple(scores), grid=() if config.alphas else tuple(float(a) for a in config.alpha_grid),
                    ppl=ppl,
                    extra={"tokens": real(calib), "heldout_tokens": real(held), "windows": int(calib.shape[0]),
                           "scored_tokens": scored(calib), "heldout_scored_tokens": scored(held),
                           "objective": config.objective, "alphas_given": bool(config.alphas),
                           "search_split": split_record(config, sources),
                           "search": {"method": res.method, "evaluations": {str(l): n for l, n in res.evaluations.items()},
                                      "grid_size": len(config.alpha_grid), "fallback_layers": res.fallbacks},
                           "seq_len": int(calib.shape[1]) - (config.objective == "paper"), "corpus": inp.corpus.name,
                           "corpus_digest": inp.corpus.digest, "naive_search": inp.naive,
                           "placement": _placement_record(placement, stack),
                           "timings": {k: round(v, 3) for k, v in timings.items()},
                           "versions": library_versions()})
        if fitted:
            plan.extra["replacement"] = _save_fitted(out_dir, config.replacement, fitted, res, stack)
        plan.save(out_dir / "plan.json")
        pl.DataFrame(res.trace).write_parquet(out_dir / "search_trace.parquet")
        pl.DataFrame({"layer": list(range(len(scores))), "score": scores,
                      "selected": [i in selected for i in range(len(scores))]}).write_csv(out_dir / "scores.csv")
        if self.figures_enabled():
            from .plots import plot_search

            plot_search(plan, res.trace, out_dir / "alpha_search.png")
        else:
            log.warning(figures_skipped(self.figures))
        return {"model": inp.resolved.to_dict(), "plan": "plan.json", "layers": selected,
                "alphas": list(plan.alphas), "ppl": ppl, "placement": plan.extra["placement"]}


def _windows(config: CalibrateConfig, tok, model_config, sources):
    """(calibration, held-out) token windows: lm-eval-style rolling windows over whole documents for
    ``--objective paper``, else fixed windows of ``seq_len``."""
    from harp_trt.data import model_max_length, paper_add_special_tokens, rolling_windows, token_windows

    if config.objective == "paper":
        max_len = config.seq_len or model_max_length(model_config)
        special = paper_add_special_tokens(config.paper_bos, getattr(model_config, "model_type", ""))
        return tuple(rolling_windows(tok, c, s, max_len, config.tokens, special) for c, s in sources)
    return tuple(token_windows(tok, c, s, config.seq_len, config.tokens) for c, s in sources)


def _select_layers(config: CalibrateConfig, inp: CalibrateInputs, stack, calib, prefix_id,
                   phase) -> tuple[str, list[float], list[int]]:
    """(strategy name, per-layer scores, the layers to prune): ``--prune-layers`` as given, else the
    strategy's scores on the first ``score_windows`` calibration windows and its selection."""
    if config.prune_layers:
        return "explicit", [], sorted(config.prune_layers)
    phase(f"scoring layers ({config.strategy})")
    strategy = get_strategy(config.strategy)
    ctx = ScoreContext(family=stack.family, config=stack.model.config, folder=inp.resolved.folder, stack=stack,
                       windows=calib[: config.score_windows], prefix_id=prefix_id)
    scores = strategy.score(ctx)
    return config.strategy, scores, strategy.select(scores, config.layers)


def _fit_and_fixed(config: CalibrateConfig, stack, calib, held, selected: list[int], phase, timings) -> tuple[dict, dict]:
    """(the fitted candidates of ``--replacement``, from the dense model; held-out perplexity at
    HARP's alpha = 1 and 0, measured before any fitted map is installed)."""
    fitted = {}
    if config.replacement != "harp":
        from .fit import fit_candidates

        phase(f"fitting {config.replacement} maps of layers {selected}")
        t = time.perf_counter()
        fitted = fit_candidates(stack, calib, selected, config.replacement)
        timings["fit"] = time.perf_counter() - t
    t = time.perf_counter()
    held_at = _heldout_at_fixed_alphas(stack, held, selected)
    timings["heldout_ppl"] = time.perf_counter() - t
    return fitted, held_at


def _save_fitted(out_dir: Path, method: str, fitted: dict, res, stack) -> dict[str, Any]:
    """``replacement.safetensors`` (the checkpoint tensors of the layers where the fitted map won,
    ``harp_trt.plan.Plan.fitted_tensors``) and the plan's record of every fitted candidate."""
    from safetensors.torch import save_file

    from harp_trt.dims import ModelDims
    from harp_trt.onnx_io import file_digest

    from .fit import cost_record

    kept = sorted(res.fitted)
    tensors = {k: v for l in kept for k, v in fitted[l].tensors.items()}
    digest = None
    if tensors:
        save_file(tensors, str(out_dir / FITTED_FILE), metadata={"format": "harp-fitted/1", "method": method})
        digest = file_digest(out_dir / FITTED_FILE)  # in plan.json, so later stages' keys cover the maps
    fit_ppl = {int(r["layer"]): r["ppl"] for r in res.trace if r.get("candidate", "harp") != "harp"}
    return {"method": method, "layers": kept, "file": FITTED_FILE if tensors else None, "sha256": digest,
            "cost": cost_record(method, ModelDims.from_config(stack.model.config)),
            "candidates": {str(l): {**f.map.record(), "ppl": fit_ppl.get(l)} for l, f in sorted(fitted.items())}}


def _heldout_at_fixed_alphas(stack, held, selected: list[int]) -> dict[float, float]:
    """Held-out perplexity with every selected layer pruned at alpha = 1 (HARP unscaled) and at
    alpha = 0 (the sublayer removed, as Gate-Norm does); leaves the model at alpha = 0."""
    from harp_trt.harp import apply_harp, set_alpha

    apply_harp(stack.model, {l: 1.0 for l in selected}, stack.family)
    out = {}
    for a in (1.0, 0.0):
        for layer in selected:
            set_alpha(stack.model, layer, a, stack.family)
        out[a] = stack.perplexity(held)
    return out


def split_sources(config: CalibrateConfig, inp: CalibrateInputs) -> tuple[tuple[Any, str], tuple[Any, str]]:
    """((corpus, split) searched, (corpus, split) held out). ``halves``: even / odd documents of
    one corpus; ``all``: every document of the corpus / every document of the other, named text."""
    if config.search_split == "all":
        return (inp.corpus, "all"), (inp.heldout_corpus, "all")
    return (inp.corpus, "calib"), (inp.corpus, "heldout")


def split_record(config: CalibrateConfig, sources) -> dict[str, Any]:
    """The plan's record of which text chose the alphas and which text the held-out figures
    come from (``Plan.search_split``). ``ppl_on_search_text`` names the ``ppl`` entries measured
    on the search text: the search's own objective, never a held-out figure."""
    names = {"calib": "even", "heldout": "odd", "all": "all"}
    (sc, ss), (hc, hs) = sources
    return {"name": config.search_split,
            "search": {"corpus": sc.name, "corpus_digest": sc.digest, "documents": names[ss],
                       "count": len(sc.documents(ss))},
            "heldout": {"corpus": hc.name, "corpus_digest": hc.digest, "documents": names[hs],
                        "count": len(hc.documents(hs))},
            "ppl_on_search_text": ["dense", "alpha1", "searched"],
            "paper_bos": config.paper_bos}


def _placement_record(placement, stack) -> dict[str, Any]:
    path = "sequential" if stack.sequential else ("device-map" if placement.device_map else "in-memory")
    return {"device": placement.device, "dtype": placement.dtype, "device_map": placement.device_map,
            "path": path, "layer_loads": stack.loads}
