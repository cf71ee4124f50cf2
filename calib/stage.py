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
        if config.recover != "none":  # refused before any work (calib/recover.py checks again)
            from harp_trt.families import family_of

            if placement is not None and placement.sequential:
                raise PreconditionError(self.name, "--recover trains the pruned layers end to end and needs the "
                                        "model in memory, not --sequential", "drop --sequential or --recover")
            if family_of(cfg).alpha_after_post_attn_norm:
                raise PreconditionError(self.name, f"--recover does not support {family_of(cfg).name}: its alpha "
                                        "sits after the post-attention norm and cannot be folded into o_proj",
                                        "drop --recover")
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
        texts = _windows(config, tok, model.config, sources)
        calib, held = texts["search"], texts["heldout"]
        timings["load"] = time.perf_counter() - t

        t = time.perf_counter()
        strategy_name, scores, selected = _select_layers(config, inp, stack, _score_windows(config, tok, sources, calib),
                                                         prefix_token_id(tok), phase)
        timings["score"] = time.perf_counter() - t

        phase("dense perplexity")
        t = time.perf_counter()
        dense = {name: stack.perplexity(w) for name, w in texts.items()}
        timings["dense_ppl"] = time.perf_counter() - t

        teachers = _teachers(config, stack, tok, sources, texts, selected, phase, timings)
        fitted, fixed = _fit_and_fixed(config, stack, texts, selected, phase, timings)
        res = _search(config, inp, stack, texts, selected, fitted, phase)
        timings["search"] = res.seconds

        phase("held-out perplexity")
        t = time.perf_counter()
        ppl_held_searched = stack.perplexity(held)
        timings["heldout_ppl"] += time.perf_counter() - t

        ppl = _ppl_record(dense, fixed, res, ppl_held_searched, bool(fitted))
        recovered = _recover(config, stack, selected, teachers, res, texts, ppl, phase, timings) if teachers else None
        plan = Plan(model_ref=inp.resolved.ref, model_digest=inp.resolved.digest, family=family.name,
                    num_layers=model.config.num_hidden_layers, strategy=strategy_name,
                    layers=tuple(selected), alphas=tuple(res.alphas[l] for l in selected),
                    scores=tuple(scores), grid=() if config.alphas else tuple(float(a) for a in config.alpha_grid),
                    ppl=ppl,
                    extra={**_token_counts(texts), "objective": config.objective, "alphas_given": bool(config.alphas),
                           "search_split": split_record(config, sources),
                           "search": {"method": res.method, "evaluations": {str(l): n for l, n in res.evaluations.items()},
                                      "grid_size": len(config.alpha_grid), "fallback_layers": res.fallbacks},
                           "seq_len": int(calib.shape[1]) - (config.objective == "paper"), "corpus": inp.corpus.name,
                           "corpus_digest": inp.corpus.digest, "naive_search": inp.naive,
                           "placement": _placement_record(placement, stack),
                           "timings": {k: round(v, 3) for k, v in timings.items()},
                           "versions": library_versions()})
        if fitted or (recovered is not None and recovered.kept):
            plan.extra["replacement"] = _save_fitted(out_dir, config, fitted, res, stack, recovered)
        if recovered is not None:
            plan.extra["recovery"] = recovered.record
        plan.save(out_dir / "plan.json")
        pl.DataFrame(res.trace).write_parquet(out_dir / "search_trace.parquet")
        pl.DataFrame({"layer": list(range(len(scores))), "score": scores,
                      "selected": [i in selected for i in range(len(scores))]}).write_csv(out_dir / "scores.csv")
        if self.figures_enabled():
            from .plots import plot_search

            plot_search(plan, res.trace, out_dir / "alpha_search.png")
        else:
            log.info(figures_skipped(self.figures))  # the summary prints the search as text instead
        return {"model": inp.resolved.to_dict(), "plan": "plan.json", "layers": selected,
                "alphas": list(plan.alphas), "ppl": ppl, "placement": plan.extra["placement"]}


def _search(config: CalibrateConfig, inp: CalibrateInputs, stack, texts: dict, selected: list[int], fitted: dict,
            phase):
    """Algorithm 1 over ``selected`` on the search text (with each fitted candidate chosen on the
    select text), or the given ``--alphas``."""
    if config.alphas:
        phase(f"given alphas on layers {selected}")
        return given_alphas(stack, stack.family, texts["search"], selected, config.alphas)
    phase(f"alpha search over layers {selected}")
    return search_alphas(stack, stack.family, texts["search"], selected, config.alpha_grid, naive=inp.naive,
                         progress=inp.progress, method=config.search, fitted=fitted, select=texts.get("select"),
                         report=texts["heldout"])


def _ppl_record(dense: dict, fixed: dict, res, heldout_searched: float, fitted: bool) -> dict[str, float]:
    """The plan's perplexities: on the search text (the fit text for a fitted plan), the held-out
    text and (fitted) the select text; alpha1 at HARP's alpha = 1 on every selected layer."""
    ppl = {"dense": dense["search"], "alpha1": fixed["search"][1.0] if fitted else res.ppl_alpha1,
           "searched": res.ppl_searched, "heldout_dense": dense["heldout"], "heldout_alpha1": fixed["heldout"][1.0],
           "heldout_alpha0": fixed["heldout"][0.0], "heldout_searched": heldout_searched}
    if fitted:
        ppl.update(select_dense=dense["select"], select_searched=res.ppl_select)
    elif "select" in dense:  # harp with --recover: the select text decides recovery's stopping point
        ppl["select_dense"] = dense["select"]
    return ppl


def _token_counts(texts: dict) -> dict[str, int]:
    """Tokens of each text (right padding excluded) and tokens predicted (``ppl.window_nll``)."""
    real = lambda w: int((w != PAD).sum())  # noqa: E731
    scored = lambda w: int((w[:, 1:] >= 0).sum())  # noqa: E731
    calib, held = texts["search"], texts["heldout"]
    out = {"tokens": real(calib), "heldout_tokens": real(held), "windows": int(calib.shape[0]),
           "scored_tokens": scored(calib), "heldout_scored_tokens": scored(held)}
    if "select" in texts:
        out["select_tokens"] = real(texts["select"])
    return out


def _windows(config: CalibrateConfig, tok, model_config, sources: dict) -> dict:
    """Token windows of each text (``split_sources``'s roles): lm-eval-style rolling windows over
    whole documents for ``--objective paper``, else fixed windows of ``seq_len``."""
    from harp_trt.data import model_max_length, paper_add_special_tokens, rolling_windows, token_windows

    if config.objective == "paper":
        max_len = config.seq_len or model_max_length(model_config)
        special = paper_add_special_tokens(config.paper_bos, getattr(model_config, "model_type", ""))
        return {r: rolling_windows(tok, c, s, max_len, config.tokens, special) for r, (c, s) in sources.items()}
    return {r: token_windows(tok, c, s, config.seq_len, config.tokens) for r, (c, s) in sources.items()}


def _score_windows(config: CalibrateConfig, tok, sources: dict, calib):
    """The windows a data-driven strategy scores: the first ``score_windows`` search windows, or
    ``--score-tokens`` tokens of the search text in windows of ``--seq-len`` (512 for the paper
    objective's maximum length)."""
    if not config.score_tokens:
        return calib[: config.score_windows]
    from harp_trt.data import token_windows

    corpus, split = sources["search"]
    return token_windows(tok, corpus, split, config.seq_len or 512, config.score_tokens)


def _select_layers(config: CalibrateConfig, inp: CalibrateInputs, stack, windows, prefix_id,
                   phase) -> tuple[str, list[float], list[int]]:
    """(strategy name, per-layer scores, the layers to prune): ``--prune-layers`` as given, else the
    strategy's scores on ``windows`` and its selection."""
    if config.prune_layers:
        return "explicit", [], sorted(config.prune_layers)
    phase(f"scoring layers ({config.strategy})")
    strategy = get_strategy(config.strategy)
    ctx = ScoreContext(family=stack.family, config=stack.model.config, folder=inp.resolved.folder, stack=stack,
                       windows=windows, prefix_id=prefix_id)
    scores = strategy.score(ctx)
    return config.strategy, scores, strategy.select(scores, config.layers)


def _fit_and_fixed(config: CalibrateConfig, stack, texts: dict, selected: list[int], phase,
                   timings) -> tuple[dict, dict]:
    """(the fitted candidates of ``--replacement``, each installed in its layer as the search
    starts; perplexity with every selected layer at HARP's alpha = 1 and 0, by text: the held-out
    text, and the search text too where maps are fitted)."""
    fitted = {}
    if config.replacement != "harp":
        from .fit import fit_candidates

        phase(f"fitting {config.replacement} maps of layers {selected} ({config.fit_inputs} inputs)")
        t = time.perf_counter()
        fitted = fit_candidates(stack, texts["search"], texts["select"], selected, config.replacement,
                                config.fit_inputs)
        timings["fit"] = time.perf_counter() - t
    t = time.perf_counter()
    wanted = {k: texts[k] for k in (("search", "heldout") if fitted else ("heldout",))}
    fixed = _at_fixed_alphas(stack, wanted, selected, fitted)
    timings["heldout_ppl"] = time.perf_counter() - t
    return fitted, fixed


def _save_fitted(out_dir: Path, config: CalibrateConfig, fitted: dict, res, stack, recovered=None) -> dict[str, Any]:
    """``replacement.safetensors`` (the checkpoint tensors of the layers where the fitted map won,
    ``harp_trt.plan.Plan.fitted_tensors``, or every layer recovery trained) and the plan's record of
    every fitted candidate: its fit statistics and, by text (fit: in-sample; select: the decision;
    heldout: report only), the perplexity of the map and of the layer's best alpha when the layer
    was decided."""
    from safetensors.torch import save_file

    from harp_trt.dims import ModelDims
    from harp_trt.onnx_io import file_digest

    from .fit import cost_record

    if recovered is not None and recovered.kept:
        kept, tensors = list(recovered.layers), dict(recovered.tensors)
    else:
        kept = sorted(res.fitted)
        tensors = {k: v for l in kept for k, v in fitted[l].tensors.items()}
    digest = None
    if tensors:
        save_file(tensors, str(out_dir / FITTED_FILE),
                  metadata={"format": "harp-fitted/1", "method": config.replacement})
        digest = file_digest(out_dir / FITTED_FILE)  # in plan.json, so later stages' keys cover the maps
    return {"method": config.replacement, "fit_inputs": config.fit_inputs if fitted else None, "layers": kept,
            "recovered": recovered is not None and recovered.kept,
            "file": FITTED_FILE if tensors else None, "sha256": digest,
            "cost": cost_record(config.replacement, ModelDims.from_config(stack.model.config)),
            "start_ppl": res.ppl_alpha1,
            "candidates": {str(l): {**f.map.record(), **res.decisions.get(l, {})} for l, f in sorted(fitted.items())}}


def _teachers(config: CalibrateConfig, stack, tok, sources: dict, texts: dict, selected: list[int], phase,
              timings) -> tuple | None:
    """With ``--recover``: the dense model's states on the recovery windows (``--recover-tokens`` of
    the fit text) and on the select text (``calib.recover.dense_teacher``), taken before any layer
    is pruned; else None."""
    if config.recover == "none":
        return None
    from harp_trt.data import token_windows

    from .recover import dense_teacher

    phase(f"dense states for recovery ({config.recover_tokens} fit tokens)")
    t = time.perf_counter()
    corpus, split = sources["search"]
    windows = token_windows(tok, corpus, split, config.seq_len, config.recover_tokens)
    lo = min(selected)
    out = dense_teacher(stack, windows, lo), dense_teacher(stack, texts["select"], lo)
    timings["recover_teacher"] = time.perf_counter() - t
    return out


def _recover(config: CalibrateConfig, stack, selected: list[int], teachers: tuple, res, texts: dict,
             ppl: dict, phase, timings):
    """Train the replacement parameters end to end (``calib.recover``). Where the trained state
    wins on the select text, every trained layer's alpha becomes 1 (folded into its weights) and
    the plan's perplexities are those of the recovered model; the layer-wise ones are kept beside
    under ``*_layerwise``."""
    from .recover import RecoverySettings, recover

    if "select_searched" not in ppl:
        ppl["select_searched"] = stack.perplexity(texts["select"])
    phase(f"recovering layers {selected} end to end ({config.recover_steps} steps at most)")
    settings = RecoverySettings(steps=config.recover_steps, lr=config.recover_lr)
    out = recover(stack, selected, *teachers, settings)
    timings["recover"] = out.record["seconds"]
    t = time.perf_counter()
    for key, name in (("searched", "search"), ("select_searched", "select"), ("heldout_searched", "heldout")):
        if key in ppl:  # not kept: the model is the layer-wise one (alpha folded), its figures stand
            ppl[f"{key}_layerwise"] = ppl[key]
            ppl[key] = stack.perplexity(texts[name]) if out.kept else ppl[key]
    timings["heldout_ppl"] += time.perf_counter() - t
    if out.kept:
        for l in out.layers:
            res.alphas[l] = 1.0
    log.info("recovery %s: select KL %.4f -> %.4f, held-out perplexity %.3f -> %.3f",
             "kept" if out.kept else "not kept", out.record["select_kl_start"], out.record["select_kl_best"],
             ppl["heldout_searched_layerwise"], ppl["heldout_searched"])
    return out


def _at_fixed_alphas(stack, texts: dict, selected: list[int], fitted: dict) -> dict[str, dict[float, float]]:
    """Perplexity of each text with every selected layer pruned at alpha = 1 (HARP unscaled) and
    at alpha = 0 (the sublayer removed, as Gate-Norm does). Fitted maps are taken out for the
    measurement and put back at alpha 1; without maps the model is left at alpha = 0."""
    from harp_trt.harp import apply_harp, set_alpha

    for layer in fitted:
        stack.remove_fitted(layer)
    apply_harp(stack.model, {l: 1.0 for l in selected}, stack.family)
    out: dict[str, dict[float, float]] = {name: {} for name in texts}
    for a in (1.0, 0.0):
        for layer in selected:
            set_alpha(stack.model, layer, a, stack.family)
        for name, w in texts.items():
            out[name][a] = stack.perplexity(w)
    for layer, f in fitted.items():
        set_alpha(stack.model, layer, 1.0, stack.family)
        stack.install_fitted(layer, f.tensors)
    return out


def split_sources(config: CalibrateConfig, inp: CalibrateInputs) -> dict[str, tuple[Any, str]]:
    """Role -> (corpus, split). ``search``: the text the alphas are searched on; ``heldout``: the
    report's text; ``select`` (fitted replacements only): the text the map-or-alpha choice and
    ridge lambda are read on. ``halves``: even / odd documents of one corpus, and with a fitted
    replacement the even half's even documents (fit, searched) and odd ones (select); ``all``:
    every document of the corpus (its even / odd ones as fit / select) and the other, named text."""
    base = "all" if config.search_split == "all" else "calib"
    held = (inp.heldout_corpus, "all") if config.search_split == "all" else (inp.corpus, "heldout")
    if not config.uses_select:
        return {"search": (inp.corpus, base), "heldout": held}
    prefix = "all/" if base == "all" else ""
    return {"search": (inp.corpus, prefix + "fit"), "select": (inp.corpus, prefix + "select"), "heldout": held}


def split_record(config: CalibrateConfig, sources: dict) -> dict[str, Any]:
    """The plan's record of which text chose the alphas and which text the held-out figures
    come from (``Plan.search_split``). ``ppl_on_search_text`` names the ``ppl`` entries measured
    on the search text: the search's own objective, never a held-out figure; ``select_*`` entries
    are on the select text, which chose between a fitted map and an alpha."""
    names = {"calib": "even", "heldout": "odd", "all": "all", "fit": "even of even", "select": "odd of even",
             "all/fit": "even", "all/select": "odd"}

    def text(corpus, split):
        return {"corpus": corpus.name, "corpus_digest": corpus.digest, "documents": names[split],
                "count": len(corpus.documents(split))}

    out = {"name": config.search_split, **{role: text(*src) for role, src in sources.items()},
           "ppl_on_search_text": ["dense", "alpha1", "searched"], "paper_bos": config.paper_bos}
    if "select" in sources:
        out["ppl_on_select_text"] = ["select_dense", "select_searched"]
    return out


def _placement_record(placement, stack) -> dict[str, Any]:
    path = "sequential" if stack.sequential else ("device-map" if placement.device_map else "in-memory")
    return {"device": placement.device, "dtype": placement.dtype, "device_map": placement.device_map,
            "path": path, "layer_loads": stack.loads}
