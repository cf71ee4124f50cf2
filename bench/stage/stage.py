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
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from harp_trt.config import digest_of
from harp_trt.errors import GateError, HarpError, PostconditionError, PreconditionError
from harp_trt.onnx_io import MODEL_FILE, check_plan_weights, file_digest, read_export_meta
from harp_trt.plan import Plan
from harp_trt.stage import Stage
from harp_trt.versions import library_versions
from harp_trt.store import Artifact, ArtifactStore

from .config import BenchConfig

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
            return {v: s.key if isinstance(s, Artifact) else _engine_digest(Path(s)) for v, s in self.source.items()}
        return {"weights": getattr(self.source, "digest", None)}


def _engine_digest(p: Path) -> str:
    """Content digest of an engine given as a path: a GGUF file, or a folder's graph (``model.onnx``)
    with its ``genai_config.json`` / its ``model.gguf``."""
    if p.is_file():
        return file_digest(p)
    files = [p / n for n in (MODEL_FILE, "genai_config.json", "model.gguf") if (p / n).is_file()]
    if not files:
        raise PreconditionError("bench", f"engine folder {p} holds no model.onnx or model.gguf",
                                "pass a built engine folder (or its artifact key)")
    return file_digest(files[0]) if len(files) == 1 else digest_of({f.name: file_digest(f) for f in files})


def machine_fingerprint(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "system": platform.system()}



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
               "accuracy.parquet", "accuracy.csv", "report.md", "latency.png", "accuracy.png", "summary.json")

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
        import polars as pl
        import torch

        from .config import ENGINES
        from .flops import ideal_speedups
        from .latency import (LatencySettings, measure_generation, measure_prefill, paired_speedups,
                              serving_figures, summarise)
        from .report import plot_accuracy, plot_latency, write_report

        plan: Plan = inputs["plan"]
        inp: BenchInputs = inputs["bench"]
        phase = inp.on_phase or (lambda s: log.info(s))
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        phase(f"loading {config.engine} engines (dense and HARP)")
        pair = ENGINES.get(config.engine)(plan, inp.source, config)
        try:
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
            speed_rows = _speedups(lat_rows, paired_speedups(samples, config.seed), ideal, config)
            serving = serving_figures(samples, config.batch_sizes)

            acc_rows: list[dict] = []
            ppl: dict[str, Any] = {}
            agree: dict[str, Any] = {}
            task_info: dict[str, Any] = {}
            if config.accuracy:
                ppl, agree = _heldout(pair, inp, config, phase)
                acc_rows += [
                    {"task": "heldout", "metric": "perplexity", "split": "heldout", "dense": ppl["dense"],
                     "harp": ppl["harp"], "dense_stderr": None, "harp_stderr": None, "n": ppl["tokens"],
                     "higher_is_better": False},
                    {"task": "heldout", "metric": "top1_agreement", "split": "heldout", "dense": 1.0,
                     "harp": agree["top1_agreement"], "dense_stderr": None, "harp_stderr": None,
                     "n": ppl["tokens"], "higher_is_better": True},
                ]
                for ref in _reference_ppl(pair, inp, config, phase):
                    acc_rows.append(ref)
                    ppl[f"{ref['metric']}_dense"], ppl[f"{ref['metric']}_harp"] = ref["dense"], ref["harp"]
                if "greedy_match" in agree:
                    acc_rows.append({"task": "heldout", "metric": "greedy_match", "split": "heldout", "dense": 1.0,
                                     "harp": agree["greedy_match"], "dense_stderr": None, "harp_stderr": None,
                                     "n": agree["greedy_prompts"], "higher_is_better": True})
                if config.tasks:
                    rows, task_info = _lm_eval(pair, inp, config, out_dir, phase)
                    acc_rows += rows
            for r in acc_rows:
                r["delta"] = r["harp"] - r["dense"]
            schema = {"task": pl.String, "metric": pl.String, "split": pl.String, "dense": pl.Float64,
                      "harp": pl.Float64, "delta": pl.Float64, "dense_stderr": pl.Float64,
                      "harp_stderr": pl.Float64, "n": pl.Int64, "higher_is_better": pl.Boolean}
            acc = pl.DataFrame(acc_rows, schema=schema)
            lat = pl.DataFrame(lat_rows, schema={
                "engine": pl.String, "measure": pl.String, "seq_len": pl.Int64, "batch_size": pl.Int64,
                "variant": pl.String,
                "median_ms": pl.Float64, "p90_ms": pl.Float64, "p99_ms": pl.Float64, "mean_ms": pl.Float64,
                "min_ms": pl.Float64, "n": pl.Int64, "tokens_per_s": pl.Float64, "kv_bytes_per_token": pl.Float64})
            spd = pl.DataFrame(speed_rows, schema={
                "measure": pl.String, "seq_len": pl.Int64, "batch_size": pl.Int64, "dense_median_ms": pl.Float64,
                "harp_median_ms": pl.Float64, "speedup": pl.Float64, "speedup_ci95_low": pl.Float64,
                "speedup_ci95_high": pl.Float64, "pairs": pl.Int64, "ideal_speedup": pl.Float64,
                "ideal_speedup_bytes": pl.Float64, "realised": pl.Float64, "dense_gflops": pl.Float64,
                "harp_gflops": pl.Float64})
            pl.DataFrame(samples, schema={"measure": pl.String, "variant": pl.String, "seq_len": pl.Int64,
                                          "batch_size": pl.Int64, "repeat": pl.Int64, "step": pl.Int64,
                                          "ms": pl.Float64}
                         ).write_parquet(out_dir / "latency_samples.parquet")
            for name, df in (("latency", lat), ("speedup", spd), ("accuracy", acc)):
                df.write_parquet(out_dir / f"{name}.parquet")
                df.write_csv(out_dir / f"{name}.csv")

            summary = _summary(plan, pair, config, machine, spd, lat, acc, cache, ppl, agree, task_info, serving)
            summary["kv_bytes_per_token_counted"] = ideal["kv_bytes_per_token"]  # beside the measured figure
            (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
            title = f"{summary['model']} · {pair.backend} · layers {list(plan.layers)} · {machine['cpu']}"
            plot_latency(spd, out_dir / "latency.png", title, summary)
            tasks_only = acc.filter(pl.col("task") != "heldout")
            plot_accuracy(tasks_only, {"dense": ppl.get("dense", 0.0), "harp": ppl.get("harp", 0.0)} if ppl else {},
                          out_dir / "accuracy.png", title)
            write_report(out_dir / "report.md", summary, spd, lat, acc)
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


def check_source_matches_plan(plan: Plan, source: Any, engine: str) -> None:
    """PreconditionError when the engines were not built from the plan's weights and layers."""
    if isinstance(source, Mapping):
        missing = [v for v in ("dense", "harp") if v not in source]
        if missing:
            raise PreconditionError("bench", f"the {engine} engine needs a dense and a HARP engine folder; "
                                    f"missing {', '.join(missing)}", "pass --dense-engine DIR and --harp-engine DIR")
        for variant, s in source.items():
            folder = s.path if isinstance(s, Artifact) else Path(s)
            digest, layers = _engine_identity(folder)
            check_plan_weights(plan.model_digest, digest, "bench", f"the {variant} engine {folder}",
                               "bench engines built from the plan's model")
            if variant in ("harp", "harp_fp32") and layers is not None and sorted(layers) != sorted(plan.layers):
                raise PreconditionError("bench", f"HARP engine {folder} prunes layers {sorted(layers)}, the plan "
                                        f"prunes {list(plan.layers)}", "rebuild the engine from this plan")
            if variant in ("dense", "dense_fp32") and layers:
                raise PreconditionError("bench", f"dense engine {folder} already prunes layers {sorted(layers)}",
                                        "pass the dense (unrewritten) export as --dense-engine")
        return
    digest = getattr(source, "digest", None)
    if not digest:
        raise PreconditionError("bench", f"model {getattr(source, 'ref', source)!r} has no weights digest",
                                "pass a model resolved by harp_trt.models.resolve_model")
    check_plan_weights(plan.model_digest, digest, "bench", f"model {getattr(source, 'ref', source)!r}")


def _engine_identity(folder: Path) -> tuple[str | None, list[int] | None]:
    """(weights digest, pruned layers) recorded by the export/rewrite/build stages, where present:
    the artifact manifest's model digest, engine.json's KV layout (layers without KV are pruned),
    a plan.json beside the graph, or the graph's export metadata."""
    def read(name):
        f = folder / name
        try:
            return json.loads(f.read_text()) if f.is_file() else None
        except ValueError:
            return None

    manifest, engine, plan = read("manifest.json"), read("engine.json"), read("plan.json")
    digest = None
    for d in (manifest, engine):
        if d is not None and digest is None:
            found = _find(d, ("model_digest", "digest"))
            digest = found if isinstance(found, str) else None
    layers = None
    kv = (engine or {}).get("kv") or {}
    if isinstance(kv.get("layers"), list) and kv.get("num_layers"):
        layers = sorted(set(range(int(kv["num_layers"]))) - {int(i) for i in kv["layers"]})
    elif plan is not None and isinstance(plan.get("layers"), list):
        layers = [int(i) for i in plan["layers"]]
    elif (folder / MODEL_FILE).is_file():
        try:
            meta = read_export_meta(folder / MODEL_FILE, "bench")
            if isinstance(meta.get("kv_layers"), list) and meta.get("num_layers"):
                layers = sorted(set(range(int(meta["num_layers"]))) - {int(i) for i in meta["kv_layers"]})
        except HarpError as e:  # a user's graph without our metadata: nothing to check against
            log.info("no export metadata in %s: %s", folder, e)
    return digest, layers


def _find(d: Any, keys: tuple[str, ...]) -> Any:
    """First value under one of ``keys`` in a nested dict (breadth first)."""
    queue = [d]
    while queue:
        cur = queue.pop(0)
        if isinstance(cur, dict):
            for k in keys:
                if k in cur and isinstance(cur[k], (str, list)):
                    return cur[k]
            queue += [v for v in cur.values() if isinstance(v, dict)]
    return None


def _speedups(lat_rows: list[dict], pairs: dict[tuple, dict], ideal: dict[str, Any],
              config: BenchConfig) -> list[dict]:
    """One row per speed-up: prefill per sequence length, TTFT and decode (inter-token latency) at
    batch 1, and ``throughput`` per ``batch_sizes`` entry (end-to-end time of a batch of requests).
    ``speedup`` and its interval come from the interleaved pairs (``latency.paired_speedup``); the
    medians are for reading."""
    med = {(r["measure"], r["seq_len"], r["batch_size"], r["variant"]): r["median_ms"] for r in lat_rows}
    wanted = {"prefill": {1}, "ttft": {1}, "decode": {1}, "request": {int(b) for b in config.batch_sizes}}
    out = []
    for (measure, seq, batch), ci in sorted(pairs.items()):
        if batch not in wanted.get(measure, ()):
            continue
        d, h = med.get((measure, seq, batch, "dense")), med.get((measure, seq, batch, "harp"))
        if d is None or h is None:
            continue
        bytes_ideal = None
        if measure == "prefill":
            flops = ideal["prefill"].get(seq)
        elif measure == "ttft":
            flops = ideal["ttft"]
        elif measure == "decode":
            flops = ideal["decode"]
            bytes_ideal = ideal["decode_bytes"]["ideal"]
        else:
            flops = None  # a request mixes prefill and decode: no single counted ideal
        idl = flops["ideal"] if flops else None
        speed = ci["speedup"]
        out.append({"measure": "throughput" if measure == "request" else measure, "seq_len": seq,
                    "batch_size": batch, "dense_median_ms": d, "harp_median_ms": h, **ci,
                    "ideal_speedup": idl, "ideal_speedup_bytes": bytes_ideal,
                    "realised": (speed - 1) / (idl - 1) if idl and idl > 1 else None,
                    "dense_gflops": flops["dense_flops"] / 1e9 if flops else None,
                    "harp_gflops": flops["harp_flops"] / 1e9 if flops else None})
    order = {"prefill": 0, "ttft": 1, "decode": 2, "throughput": 3}
    return sorted(out, key=lambda r: (order[r["measure"]], r["seq_len"], r["batch_size"]))


def _heldout(pair, inp: BenchInputs, config: BenchConfig, phase) -> tuple[dict, dict]:
    from harp_trt.data import token_windows

    from .accuracy import greedy_match, heldout_accuracy

    if inp.corpus is None:
        from harp_trt.errors import CorpusError

        raise CorpusError("the bench needs a corpus for held-out perplexity", "pass --corpus wiki or a file")
    windows = token_windows(pair.tokenizer, inp.corpus, "heldout", config.ppl_seq_len, config.ppl_tokens)
    phase(f"held-out perplexity on {windows.numel()} tokens")
    acc = heldout_accuracy(pair, windows, phase)
    ppl = {"dense": acc["ppl_dense"], "harp": acc["ppl_harp"], "increase": acc["ppl_harp"] / acc["ppl_dense"] - 1,
           "tokens": acc["tokens"], "seq_len": config.ppl_seq_len, "corpus": inp.corpus.name}
    agree = {"top1_agreement": acc["top1_agreement"]}
    if config.greedy_prompts:
        prompt_len = min(32, config.ppl_seq_len)
        prompts = windows[: config.greedy_prompts, :prompt_len]
        agree.update(greedy_match(pair, prompts, config.greedy_tokens))
    return ppl, agree


def _reference_ppl(pair, inp: BenchInputs, config: BenchConfig, phase) -> list[dict]:
    """Held-out perplexity of the unquantized engines (source keys ``dense_fp32`` / ``harp_fp32``,
    given next to quantized ``dense`` / ``harp`` engines) on the same windows: one row, metric
    ``perplexity_fp32``, so a report shows what quantization costs beside what HARP costs."""
    names = ("dense_fp32", "harp_fp32")
    if pair.backend != "ort" or not isinstance(inp.source, Mapping) or not all(k in inp.source for k in names):
        return []
    refs = {k: inp.source[k] for k in names}
    from harp_trt.data import token_windows
    from harp_trt.ort_session import OrtCausalLM
    from harp_trt.ppl import perplexity_from_logits_fn

    from .engine_ort import OrtEngine

    windows = token_windows(pair.tokenizer, inp.corpus, "heldout", config.ppl_seq_len, config.ppl_tokens)
    count = int((windows[:, 1:] >= 0).sum())  # tokens predicted (ppl.window_nll)
    out = {}
    for name, src in refs.items():
        lm = OrtEngine(OrtCausalLM.from_engine(src.path if isinstance(src, Artifact) else Path(src),
                                               intra_op_threads=config.threads or None), name, 1 << 30)
        out[name] = perplexity_from_logits_fn(lambda i, ids: lm.logits(ids), windows)
    phase(f"held-out perplexity of the fp32 engines: dense {out['dense_fp32']:.3f}, harp {out['harp_fp32']:.3f}")
    return [{"task": "heldout", "metric": "perplexity_fp32", "split": "heldout", "dense": out["dense_fp32"],
             "harp": out["harp_fp32"], "dense_stderr": None, "harp_stderr": None, "n": count,
             "higher_is_better": False}]


def _lm_eval(pair, inp: BenchInputs, config: BenchConfig, out_dir: Path, phase) -> tuple[list[dict], dict]:
    from .lm_eval_adapter import EngineLM, evaluate_tasks
    from .tasks import EVAL_TASKS, eval_data_root, write_task_yamls

    builtin = [t for t in config.tasks if t in EVAL_TASKS]
    include = [config.task_dir] if config.task_dir else []
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="harp-bench-tasks-") as td:
        if builtin:
            root = eval_data_root(inp.cache_root or Path(tempfile.gettempdir()), config.eval_data or None)
            info = write_task_yamls(builtin, root, Path(td))
            include.append(td)
        phase(f"lm-eval {', '.join(config.tasks)} (limit {config.limit or 'none'})")
        lms = {v: EngineLM(e, pair.tokenizer, batch_size=config.batch_size) for v, e in pair.engines().items()}
        rows = evaluate_tasks(lms, list(config.tasks), include, config.limit or None, seed=config.seed)
    table: dict[tuple, dict] = {}
    for r in rows:
        if r["metric"] in ("sample_len",):
            continue
        k = (r["task"], r["metric"])
        e = table.setdefault(k, {"task": r["task"], "metric": r["metric"],
                                 "split": info.get(r["task"], {}).get("split", "user"), "n": r["n"],
                                 "higher_is_better": r["metric"] != "perplexity"})
        e[r["variant"]] = r["value"]
        e[f"{r['variant']}_stderr"] = r["stderr"]
    out = [e for e in table.values() if "dense" in e and "harp" in e]
    for e in out:
        e.setdefault("dense_stderr", None)
        e.setdefault("harp_stderr", None)
    return out, info


def _label(measure: str, seq: int, batch: int) -> str:
    """Key of a speed-up in the summary's ``speedups``."""
    return {"prefill": f"prefill_{seq}", "ttft": "time_to_first_token", "decode": "inter_token_latency",
            "throughput": f"throughput_bs{batch}"}[measure]


def headline_speedup(summary: Mapping[str, Any]) -> tuple[str, float, float, float, int | None] | None:
    """(label, speed-up, 95 % CI low, high, pairs) the ``--min-speedup`` gate checks: prefill at the
    longest measured prompt (the paper's figure), else decode. A summary written before the
    intervals existed (bench config version 1) has the point only: it stands for both bounds and
    pairs is None."""
    spd = summary.get("speedups") or {}
    pre = summary.get("prefill_speedup") or {}
    if pre:
        seq = max(pre, key=lambda s: int(s))
        label, point, ci = f"prefill_{seq}", float(pre[seq]), spd.get(f"prefill_{seq}")
    elif summary.get("decode_speedup") is not None:
        label = f"inter_token_latency at {summary['decode_context']} tokens"
        point, ci = float(summary["decode_speedup"]), spd.get("inter_token_latency")
    else:
        return None
    if not ci:
        return label, point, point, point, None
    return label, float(ci["speedup"]), float(ci["speedup_ci95_low"]), float(ci["speedup_ci95_high"]), ci["pairs"]


def check_gates(summary: Mapping[str, Any], max_ppl_increase: float | None = None,
                min_speedup: float | None = None) -> list[str]:
    """Raise GateError naming each figure that fell short; return the gates that passed.
    ``--min-speedup`` fails only when the speed-up's 95 % confidence interval lies wholly below the
    threshold (its upper bound is below it): a difference inside the noise does not fail a build.
    A pass whose interval includes the threshold says "not resolved"."""
    failed, passed = [], []
    if max_ppl_increase is not None:
        p = summary.get("ppl") or {}
        if "increase" not in p:
            failed.append("held-out perplexity was not measured (run with accuracy on) but --max-ppl-increase "
                          "was given")
        elif p["increase"] > max_ppl_increase:
            failed.append(f"held-out perplexity increase {100 * p['increase']:.2f} % (dense {p['dense']:.4f} -> "
                          f"HARP {p['harp']:.4f}) exceeds --max-ppl-increase {max_ppl_increase:g} "
                          f"({100 * max_ppl_increase:.2f} %)")
        else:
            passed.append(f"ppl increase {100 * p['increase']:.2f} % <= {100 * max_ppl_increase:.2f} %")
    if min_speedup is not None:
        head = headline_speedup(summary)
        if head is None:
            failed.append("no speed-up was measured (run with latency on) but --min-speedup was given")
        else:
            label, point, low, high, n = head
            fig = f"{label} {point:.3f}x (95% CI {low:.3f}-{high:.3f})"
            basis = (f"{n} interleaved pairs" if n is not None
                     else "no interval in this summary: the point value stands for both bounds")
            if high < min_speedup:
                failed.append(f"{fig}: upper bound {high:.3f} below --min-speedup {min_speedup:g} ({basis})")
            elif low >= min_speedup:
                passed.append(f"{fig} >= {min_speedup:g}x, resolved: the whole interval is at or above it")
            else:
                passed.append(f"{fig} vs --min-speedup {min_speedup:g}x: not resolved, the interval includes "
                              f"it ({basis}; more --repeats narrow it)")
    if failed:
        raise GateError("bench gate failed: " + "; ".join(failed),
                        "see report.md in the bench artifact for the full tables")
    return passed


def _summary(plan, pair, config, machine, spd, lat, acc, cache, ppl, agree, task_info,
             serving) -> dict[str, Any]:
    import polars as pl

    from .latency import BOOTSTRAP_RESAMPLES

    def by(measure):
        return {str(r["seq_len"]): r for r in spd.filter(pl.col("measure") == measure).iter_rows(named=True)}

    pre, dec, ttft = by("prefill"), by("decode"), by("ttft")
    dec_row = next(iter(dec.values()), None)
    ttft_row = next(iter(ttft.values()), None)
    tps = {r["variant"]: r["tokens_per_s"] for r in lat.filter((pl.col("measure") == "decode")
                                                               & (pl.col("batch_size") == 1)).iter_rows(named=True)}
    kv = {v: c["kv_bytes_per_token"] for v, c in cache.items()}
    ci_keys = ("speedup", "speedup_ci95_low", "speedup_ci95_high", "pairs")
    speedups = {_label(r["measure"], r["seq_len"], r["batch_size"]): {k: r[k] for k in ci_keys}
                for r in spd.iter_rows(named=True)}
    tasks = {}
    for r in acc.filter(pl.col("task") != "heldout").iter_rows(named=True):
        tasks.setdefault(r["task"], {})[r["metric"]] = {"dense": r["dense"], "harp": r["harp"], "delta": r["delta"]}
    return {
        "model": plan.model_ref, "model_digest": plan.model_digest, "engine": pair.backend,
        "layers": list(plan.layers), "alphas": list(plan.alphas), "machine": machine["cpu"],
        "threads": machine["threads"], "repeats": config.repeats, "warmup": config.warmup,
        "speedups": speedups,
        "speedup_ci": f"95 % percentile bootstrap ({BOOTSTRAP_RESAMPLES} resamples, seed {config.seed}) of the "
                      f"geometric mean of per-repeat dense/HARP ratios",
        "prefill_speedup": {k: r["speedup"] for k, r in pre.items()},
        "prefill_ideal": {k: r["ideal_speedup"] for k, r in pre.items()},
        "prefill_ms": {k: {"dense": r["dense_median_ms"], "harp": r["harp_median_ms"]} for k, r in pre.items()},
        "decode_context": config.decode_context,
        "decode_tokens": config.decode_tokens,
        "decode_speedup": dec_row["speedup"] if dec_row else None,
        "decode_ideal_flops": dec_row["ideal_speedup"] if dec_row else None,
        "decode_ideal_bytes": dec_row["ideal_speedup_bytes"] if dec_row else None,
        "ttft_speedup": ttft_row["speedup"] if ttft_row else None,
        "time_to_first_token": serving["time_to_first_token"],
        "inter_token_latency": serving["inter_token_latency"],
        "batch_sizes": [int(b) for b in config.batch_sizes],
        "throughput": serving["throughput"],
        "tokens_per_s": tps,
        "kv_bytes_per_token": kv,
        "kv_reduction": (kv["dense"] / kv["harp"]) if kv.get("harp") else None,
        "ppl": ppl, "top1_agreement": agree.get("top1_agreement"), "greedy_match": agree.get("greedy_match"),
        "tasks": tasks, "task_splits": {t: i["split"] for t, i in task_info.items()},
    }


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
