"""The bench stage: latency and accuracy of a HARP engine against the dense engine.

inputs (``Stage.execute``): ``plan`` (a ``Plan``) and ``bench`` (``BenchInputs``: the engine
source, the corpus, progress callbacks). Artifact ``bench-<key>/``:

* ``latency.{parquet,csv}``      median/p90/p99/mean ms per (measure, seq_len, batch_size, variant),
                                 tokens/s;
* ``latency_samples.parquet``    every timed sample (with its repeat: the dense/HARP pairs);
* ``speedup.{parquet,csv}``      dense/HARP speed-up per measure with its 95 % confidence interval
                                 (``latency.paired_speedup``), next to the ideal from ``flops``;
* ``accuracy.{parquet,csv}``     perplexity, agreement and lm-eval metrics, dense vs HARP;
* ``report.md``, ``latency.png``, ``accuracy.png``, ``summary.json`` (what ``--json`` prints).

The key hashes the stage version, the stage's code version, the config, the plan, the weights'
digest (torch) or the engines' keys/digests (ort), the corpus digest, the library versions and the
machine (CPU model, cores, threads): timings from another machine are not this machine's. Gates
are *not* part of the key: ``check_gates`` reads a finished (or cached) summary."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from harp_trt.config import digest_of
from harp_trt.errors import PostconditionError, PreconditionError
from harp_trt.extras import figures_skipped
from harp_trt.plan import Plan
from harp_trt.stage import Stage
from harp_trt.versions import library_versions
from harp_trt.store import Artifact, ArtifactStore

from .config import BenchConfig
from .gates import check_gates, headline_speedup
from .source import check_source_matches_plan, engine_digest

__all__ = ["BenchInputs", "BenchStage", "run_bench", "check_gates", "headline_speedup",
           "machine_fingerprint"]

log = logging.getLogger(__name__)


@dataclass
class BenchInputs:
    """``source``: a ``ResolvedModel`` (torch) or ``{"dense": path|Artifact, "harp": path|Artifact}``
    of built engine folders (ort). ``corpus``: a ``harp_trt.data.Corpus`` (None skips perplexity)."""

    source: Any
    corpus: Any = None
    cache_root: Path | None = None
    on_phase: Callable[[str], None] | None = None

    def source_key(self) -> Any:
        if isinstance(self.source, Mapping):
            return {v: s.key if isinstance(s, Artifact) else engine_digest(Path(s)) for v, s in self.source.items()}
        return {"weights": getattr(self.source, "digest", None)}


def machine_fingerprint(threads: int) -> dict[str, Any]:
    """``harp_trt.machine.describe`` with the threads the engines ran (torch's default when 0)."""
    import torch

    from harp_trt.machine import describe

    return describe(threads or torch.get_num_threads())


def _versions() -> dict[str, str]:
    return library_versions(("torch", "transformers", "onnxruntime", "onnxruntime-genai", "llama-cpp-python",
                             "lm_eval", "datasets"))


def _model_limits(source: Any) -> tuple[int, str]:
    """(max_position_embeddings, where it was read) of the engine source."""
    folders = []
    if isinstance(source, Mapping):
        for s in source.values():
            folders.append(s.path if isinstance(s, Artifact) else Path(s))
    else:
        folders.append(Path(source.folder))
    limit = None
    for f in folders:
        cfg = f / "config.json"
        m = json.loads(cfg.read_text()).get("max_position_embeddings") if cfg.is_file() else None
        gguf = f if f.suffix == ".gguf" else f / "model.gguf"
        if not m and gguf.is_file():  # a GGUF engine: its {arch}.context_length
            from .gguf_meta import gguf_dims

            m = gguf_dims(gguf)[1]
        if m:
            limit = m if limit is None else min(limit, m)
    return (int(limit) if limit else 1 << 30), str(folders[0])


class BenchStage(Stage[BenchConfig]):
    name = "bench"
    version = 1
    outputs = ("latency.parquet", "latency.csv", "latency_samples.parquet", "speedup.parquet", "speedup.csv",
               "accuracy.parquet", "accuracy.csv", "report.md", "summary.json")
    figures = ("latency.png", "accuracy.png")
    # the runtime each engine needs (harp_trt.extras names the extra that installs it)
    _RUNTIMES = {"ort": "onnxruntime", "genai": "onnxruntime_genai", "llamacpp": "llama_cpp"}

    def requirements(self, config: BenchConfig) -> tuple[tuple[str, str], ...]:
        """The engine's runtime; lm-eval for the accuracy tasks (``--tasks none`` skips them)."""
        runtime = self._RUNTIMES.get(config.engine)
        return (((runtime, f"the bench's {config.engine} engines need it"),) if runtime else ()) + (
            (("lm_eval", "the bench's accuracy tasks need it (or pass --tasks none)"),)
            if config.accuracy and config.tasks else ())

    def prepare(self, store: ArtifactStore, config: BenchConfig, inputs: Mapping[str, Any], hooks) -> dict[str, Any]:
        """``{"calibrate": Artifact | folder | plan.json | Plan, "source": model ref | ResolvedModel |
        {"dense": ..., "harp": ...}}`` -> ``{"plan", "bench"[, "calibrate"]}``."""
        from harp_trt.data import load_corpus
        from harp_trt.models import ResolvedModel, resolve_model

        plan_artifact, source = inputs["calibrate"], inputs.get("source")
        if isinstance(plan_artifact, Plan):
            plan = plan_artifact
        else:
            plan = Plan.load(plan_artifact.path if isinstance(plan_artifact, Artifact) else Path(plan_artifact))
        if not isinstance(source, (Mapping, ResolvedModel)):
            source = resolve_model(str(source or plan.model_ref), store.root)
        corpus = load_corpus(config.corpus, store.root) if config.accuracy else None
        if corpus is not None and plan.reads_search_text(corpus.digest, "heldout"):  # --search-split all
            held = ((plan.extra.get("search_split") or {}).get("heldout") or {}).get("corpus", "OTHER")
            raise PreconditionError(self.name, f"the plan searched every document of {corpus.name}: its held-out "
                                    "half is search text", f"pass the plan's held-out text: --corpus {held}")
        out: dict[str, Any] = {"plan": plan, "bench": BenchInputs(source, corpus, store.root, hooks.on_phase)}
        if isinstance(plan_artifact, Artifact):
            out["calibrate"] = plan_artifact
        return out

    def key_material(self, config: BenchConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
        plan: Plan = inputs["plan"]
        inp: BenchInputs = inputs["bench"]
        return {"stage_version": self.version, "code": self.code_version(), "config": config.key_material(),
                "plan": digest_of(plan.to_dict()), "source": inp.source_key(),
                "corpus": getattr(inp.corpus, "digest", None), "versions": _versions(),
                "machine": machine_fingerprint(config.threads)}

    def check_preconditions(self, config: BenchConfig, inputs: Mapping[str, Any]) -> None:
        plan: Plan = inputs["plan"]
        inp: BenchInputs = inputs["bench"]
        check_source_matches_plan(plan, inp.source, config.engine)
        max_pos, where = _model_limits(inp.source)
        too_long = [int(s) for s in config.seq_lens if int(s) > max_pos] if config.latency else []
        if too_long:
            raise PreconditionError(self.name, f"--seq-lens {too_long} exceed the model's context of {max_pos} "
                                    f"tokens (max_position_embeddings in {where})",
                                    f"use lengths up to {max_pos}")
        if config.latency and config.decode_context + config.decode_tokens > max_pos:
            raise PreconditionError(self.name, f"--decode-context {config.decode_context} + --decode-tokens "
                                    f"{config.decode_tokens} exceed the model's context of {max_pos} tokens")
        if config.accuracy and config.ppl_seq_len > max_pos:
            raise PreconditionError(self.name, f"--ppl-seq-len {config.ppl_seq_len} exceeds the model's context "
                                    f"of {max_pos} tokens")
        if config.accuracy and config.tasks:
            from .tasks import check_task_names, user_task_names

            check_task_names(config.tasks, user_task_names(config.task_dir) if config.task_dir else ())
            if config.eval_data or os.environ.get("HARP_TRT_EVAL_DATA"):  # else fetched in run()
                from .tasks import check_eval_data, eval_data_root

                root = eval_data_root(inp.cache_root or Path(tempfile.gettempdir()), config.eval_data or None)
                check_eval_data(config.tasks, root)

    def run(self, config: BenchConfig, inputs: Mapping[str, Any], out_dir: Path) -> dict[str, Any]:
        import torch

        from .config import ENGINES

        plan: Plan = inputs["plan"]
        inp: BenchInputs = inputs["bench"]
        phase = inp.on_phase or (lambda s: log.info(s))
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        phase(f"loading {config.engine} engines (dense and HARP)")
        pair = ENGINES.get(config.engine)(plan, inp.source, config)
        try:
            summary = _measure(plan, pair, inp, config, out_dir, phase, self.figures_enabled())
        finally:
            pair.close()
        return {"summary": summary}

    def check_postconditions(self, config: BenchConfig, inputs: Mapping[str, Any], out_dir) -> None:
        super().check_postconditions(config, inputs, out_dir)
        import polars as pl

        if config.latency:
            lat = pl.read_parquet(Path(out_dir) / "latency.parquet")
            wanted = [("prefill", 1), ("ttft", 1), ("decode", 1)] + [("request", int(b)) for b in config.batch_sizes]
            for measure, b in wanted:
                got = set(lat.filter((pl.col("measure") == measure) & (pl.col("batch_size") == b))["variant"])
                if got != {"dense", "harp"}:
                    raise PostconditionError(self.name, f"latency table lacks dense and HARP rows for {measure} "
                                             f"at batch {b} (has {sorted(got)})")


def _measure(plan: Plan, pair, inp: BenchInputs, config: BenchConfig, out_dir: Path, phase,
             figures: bool = True) -> dict[str, Any]:
    """Latency, then accuracy, on the loaded engine pair; writes the tables, the summary, the plots
    and the report into ``out_dir``; returns the summary."""
    import polars as pl

    from .accuracy_rows import accuracy_rows
    from harp_trt.flops import ideal_speedups
    from .latency import (LatencySettings, measure_generation, measure_prefill, paired_speedups,
                          serving_figures, summarise)
    from .report import plot_accuracy, plot_latency, write_report
    from .summary import speedup_rows, summarise_bench, write_tables

    machine = machine_fingerprint(config.threads)
    samples: list[dict] = []
    cache: dict[str, dict] = {}
    if config.latency:
        settings = LatencySettings(tuple(int(s) for s in config.seq_lens), config.decode_context,
                                   config.decode_tokens, config.warmup, config.repeats, config.seed,
                                   tuple(int(b) for b in config.batch_sizes))
        samples += measure_prefill(pair, settings, phase)
        gen, cache = measure_generation(pair, settings, phase)
        samples += gen
    lat_rows = summarise(samples)
    for r in lat_rows:
        r["engine"] = pair.backend
        c = cache.get(r["variant"], {})
        r["kv_bytes_per_token"] = c.get("kv_bytes_per_token") if r["measure"] != "prefill" else None
    ideal = ideal_speedups(pair.dims, pair.pruned, [int(s) for s in config.seq_lens],
                           config.decode_context, pair.dense.prefill_logits,
                           dtype_bytes=2 if config.dtype != "float32" else 4,
                           kv_dtype_bytes=pair.dense.kv_dtype_bytes)
    speed_rows = speedup_rows(lat_rows, paired_speedups(samples), ideal, config)
    serving = serving_figures(samples, config.batch_sizes)

    acc_rows, ppl, agree, task_info = [], {}, {}, {}
    if config.accuracy:
        acc_rows, ppl, agree, task_info = accuracy_rows(pair, inp, config, out_dir, phase)
    lat, spd, acc = write_tables(out_dir, samples, lat_rows, speed_rows, acc_rows)

    summary = summarise_bench(plan, pair, config, machine, spd, lat, acc, cache, ppl, agree, task_info, serving)
    summary["kv_bytes_per_token_counted"] = ideal["kv_bytes_per_token"]  # beside the measured figure
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    title = f"{summary['model']} · {pair.backend} · layers {list(plan.layers)} · {machine['cpu']}"
    if figures:
        plot_latency(spd, out_dir / "latency.png", title, summary)
        tasks_only = acc.filter(pl.col("task") != "heldout")
        plot_accuracy(tasks_only, {"dense": ppl.get("dense", 0.0), "harp": ppl.get("harp", 0.0)} if ppl else {},
                      out_dir / "accuracy.png", title)
    else:
        log.warning(figures_skipped(BenchStage.figures))
    write_report(out_dir / "report.md", summary, spd, lat, acc)
    return summary


def run_bench(plan_artifact: Any, source: Any, config: BenchConfig, store: ArtifactStore | None = None,
              force: bool = False, on_phase: Callable[[str], None] | None = None) -> Artifact:
    """Bench a plan: ``plan_artifact`` is a calibrate ``Artifact``, its folder, a plan.json or a
    ``Plan``; ``source`` is a model reference / ``ResolvedModel`` (engine "torch") or
    ``{"dense": ..., "harp": ...}`` engine folders or artifacts (engine "ort"). Returns the
    (cached or new) bench ``Artifact``; its manifest's ``summary`` is what ``--json`` prints."""
    from harp_trt.stage import Hooks

    store = store or ArtifactStore()
    stage = BenchStage()
    inputs = stage.prepare(store, config, {"calibrate": plan_artifact, "source": source}, Hooks(on_phase=on_phase))
    return stage.execute(store, config, inputs, force=force)
