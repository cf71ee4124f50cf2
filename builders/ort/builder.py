"""ORT engine builder: ONNX graph (dense export or HARP rewrite) -> engine folder.

An engine folder holds ``model.onnx`` (the graph after the passes of ``passes.py``, the
``GroupQueryAttention`` fusion and weight quantization, then ONNX Runtime's own graph
optimizations, saved with ``SessionOptions.optimized_model_filepath``), ``model.onnx.data`` above 1 GiB of weights, the tokenizer files and ``engine.json``::

    {"format": "harp-engine/1", "backend": "ort", "model": "model.onnx",
     "providers": [...], "intra_op_threads": 2, "graph_optimization_level": "all",
     "attention": {"rule": ..., "converted_layers": [...], "skipped": {...}},
     "kv": {"layers": [...], "num_layers": L, "kv_heads": h, "head_dim": d, "dtype": "float32",
            "bytes_per_token": ..., "dense_bytes_per_token": ..., "per_layer": [...]},
     "verify": {"logits_max_abs_diff": ..., "tolerance": ...}, "versions": {...}}

``bytes_per_token`` counts K and V of the kept layers for one sequence; a HARP engine with P of
L layers pruned has (L-P)/L of the dense figure. The built engine is checked against its source
graph (prefill + one decode step, with left padding) before it is published."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from harp_trt.engine_spec import ENGINE_FORMAT, ENGINE_JSON, write_engine_spec
from harp_trt.errors import GraphError, PreconditionError, VerificationError
from harp_trt.extras import require
from harp_trt.kvcache import kv_cache_bytes
from harp_trt.onnx_io import (EXTERNAL_DATA_SUFFIX, EXTERNAL_DATA_THRESHOLD, MODEL_FILE, VOCAB_FILES, copy_tokenizer,
                             read_export_meta)
from harp_trt.stage import Stage
from harp_trt.store import Artifact

from .config import OrtBuildConfig

__all__ = ["OrtBuilder", "OrtBuildStage", "ENGINE_JSON", "ENGINE_FORMAT"]

log = logging.getLogger(__name__)

STAGE = "build-ort"


class OrtBuilder:
    """``build(onnx_path, out_dir, config)`` writes an engine folder and returns engine.json's dict."""

    backend = "ort"

    def build(self, onnx_path: str | Path, out_dir: str | Path, config: OrtBuildConfig | None = None,
              tokenizer_dir: str | Path | None = None, source_read: Callable[[], None] | None = None) -> dict[str, Any]:
        """``source_read`` is called once the source graph's weights have been read (the staged
        graph is written; on a compact source nothing reads them again)."""
        ort = require("onnxruntime", "the ORT engine needs it")

        from harp_trt.ort_session import default_providers

        from .passes import engine_fields, graph_passes

        config = config or OrtBuildConfig()
        src = Path(onnx_path)
        out = Path(out_dir)
        if not src.is_file():
            raise GraphError(STAGE, f"no ONNX model at {src}", "pass the model.onnx of an export or rewrite artifact")
        out.mkdir(parents=True, exist_ok=True)
        meta = read_export_meta(src, STAGE)  # raises GraphError on an unreadable file
        if config.quant != "none" and not meta:
            raise GraphError(STAGE, f"{src.name} is not a harp-trt export or rewrite (no export metadata): "
                             "--quant quantizes only graphs this tool wrote",
                             "run `harp-trt build` or `harp-trt rewrite` to produce the graph")
        passes = graph_passes(config, meta, STAGE)
        staged, external, reports = self._transform(src, out, passes)
        if source_read is not None and meta.get("storage") == "compact":
            source_read()
        fields = engine_fields(reports)
        quant = fields["quant"]
        providers = list(config.providers) or default_providers()
        try:
            self._optimize(src, staged, out / MODEL_FILE, config, providers, external)
            if quant is None:
                check = self._verify(src, out / MODEL_FILE, config.verify_rtol)
            else:
                # Golden check of the build itself: the quantized graph before ORT's optimizations
                # against the engine (same MatMulNBits kernels, so fp32 rounding only). The
                # quantization error against the fp32 source is measured and recorded, not gated
                # (its effect on held-out perplexity is what `harp-trt bench` reports).
                # with int8 activations (accuracy_level > 0) a fused kernel's fp32 rounding can move
                # an activation by one int8 step, so the staged graph runs with the same ORT
                # optimizations the engine baked in: the check is that the saved engine computes
                # what ORT computes from the quantized graph
                check = self._verify(staged, out / MODEL_FILE, config.verify_rtol,
                                     src_level=config.optimization_level if config.quant_accuracy_level else "disable")
                check["reference"] = ("quantized graph under the same ORT graph optimizations"
                                      if config.quant_accuracy_level else "quantized graph before ORT graph optimizations")
                check["vs_fp32_source"] = self._compare(src, out / MODEL_FILE) if meta.get("storage") != "compact" \
                    else {"skipped": "compact source: its fp32 session is the whole graph (a 7B graph is 30 GB); the "
                                     "rewrite verified it through its probe model (harp_trt.probe)"}
        finally:
            staged.unlink(missing_ok=True)
            (out / (staged.name + EXTERNAL_DATA_SUFFIX)).unlink(missing_ok=True)

        copied = self._copy_tokenizer(Path(tokenizer_dir) if tokenizer_dir else src.parent, out)
        spec = {
            "format": ENGINE_FORMAT, "backend": self.backend, "model": MODEL_FILE,
            "external_data": (out / (MODEL_FILE + EXTERNAL_DATA_SUFFIX)).exists(), "providers": providers,
            "intra_op_threads": config.intra_op_threads, "graph_optimization_level": config.optimization_level,
            "attention": fields["attention"], "kv": self._kv_layout(out / MODEL_FILE, meta),
            "verify": check, "quant": quant, "fused_matmuls": fields["fused_matmuls"],
            "logits_to_keep": fields["logits_to_keep"],
            "source": {"onnx": str(src), "export_meta": meta.get("format")},
            "tokenizer_files": copied, "versions": {"onnxruntime": ort.__version__},
        }
        write_engine_spec(out, spec)
        log.info("engine %s: attention on GQA for %d layers, KV %d B/token (dense %d)", out,
                 len(fields["attention"]["converted_layers"]), spec["kv"]["bytes_per_token"],
                 spec["kv"]["dense_bytes_per_token"])
        return spec

    @staticmethod
    def _transform(src: Path, out: Path, passes: list) -> tuple[Path, bool, dict]:
        """Load ``src`` with its weights, run ``passes`` (``passes.py``: the one place that orders
        them) and save the result beside the engine as ``.staged.onnx``. Returns (path, whether
        its weights went to external data, the passes' reports by key)."""
        import onnx_ir as ir

        from .passes import run_passes

        from harp_trt.compact import expand

        try:
            model = ir.load(src)
        except Exception as e:  # external data missing or truncated
            raise GraphError(STAGE, f"cannot load {src} with its weights: {type(e).__name__}: {e}"[:400],
                             "check model.onnx.data sits next to model.onnx") from None
        expand(model)  # a compact graph's weights as (lazy) fp32 initializers: the engine is plain
        model, reports = run_passes(passes, model)
        weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                           if v.const_value is not None)
        # above 1 GiB (not only past protobuf's 2 GB) the weights go to external data: saved inline,
        # the whole model is serialized as one protobuf in memory (7.8 GB for a 1.9 GB int4 graph)
        external = weight_bytes > min(EXTERNAL_DATA_THRESHOLD, 1 << 30)
        staged = out / ".staged.onnx"
        ir.save(model, staged, external_data=(staged.name + EXTERNAL_DATA_SUFFIX) if external else None)
        return staged, external, reports

    @staticmethod
    def _optimize(src: Path, staged: Path, target: Path, config: OrtBuildConfig, providers: list[str],
                  external: bool) -> None:
        """ONNX Runtime's graph optimizations on ``staged``, saved to ``target``
        (``SessionOptions.optimized_model_filepath``)."""
        import onnxruntime as ort

        levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[config.optimization_level]
        so.optimized_model_filepath = str(target)
        so.log_severity_level = 3
        # this session only optimizes and saves: without prepacking its kernels never copy the
        # weights into their compute layouts (the saved file is byte-identical, tested; at 1.5B
        # int8 the step's peak falls from 3.1 to 1.0 GB). ORT: session.disable_prepacking
        so.add_session_config_entry("session.disable_prepacking", "1")
        if external:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        MODEL_FILE + EXTERNAL_DATA_SUFFIX)
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        try:
            ort.InferenceSession(str(staged), so, providers=providers)
        except Exception as e:
            raise GraphError(STAGE, f"ONNX Runtime cannot optimize {src.name}: {str(e).splitlines()[0][:300]}",
                             "try attention='onnx' or a lower optimization_level") from None

    @staticmethod
    def _kv_layout(path: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
        from harp_trt.ort_session import OrtCausalLM

        lm = OrtCausalLM(path, providers=["CPUExecutionProvider"], graph_optimization_level="disable")
        itemsize = np.dtype(lm.kv_dtype).itemsize
        per_layer = kv_cache_bytes(lm.kv_heads, lm.head_dim, itemsize)
        return {"layers": lm.kv_layers, "num_layers": lm.num_layers, "kv_heads": lm.kv_heads,
                "head_dim": lm.head_dim, "dtype": np.dtype(lm.kv_dtype).name,
                "bytes_per_token": lm.kv_bytes_per_token(), "dense_bytes_per_token": lm.num_layers * per_layer,
                "per_layer": [{"layer": i, "kv": i in lm.kv_layers, "bytes_per_token": per_layer if i in lm.kv_layers else 0}
                              for i in range(lm.num_layers)]}

    @classmethod
    def _verify(cls, src: Path, built: Path, rtol: float, src_level: str = "disable") -> dict[str, Any]:
        """Source graph vs engine within ``rtol`` of the logit scale (VerificationError if not)."""
        check = cls._compare(src, built, src_level)
        tol = rtol * check.pop("logit_scale")
        if not check["logits_max_abs_diff"] <= tol:
            raise VerificationError(STAGE, f"engine logits differ from {Path(src).name} by "
                                    f"{check['logits_max_abs_diff']:.3g} (tolerance {tol:.3g})",
                                    "rebuild with attention='onnx' and report this")
        return {**check, "tolerance": tol}

    @staticmethod
    def _run(path: Path, ids: np.ndarray, mask: np.ndarray, step_ids: np.ndarray | None,
             level: str = "disable") -> tuple[np.ndarray, ...]:
        """Prefill logits of a left-padded batch, and one decode step's (of ``step_ids``, or of the
        prefill's argmax); one session (ORT optimizations ``level``), closed before the next opens."""
        from harp_trt.ort_session import OrtCausalLM

        lm = OrtCausalLM(path, providers=["CPUExecutionProvider"], graph_optimization_level=level)
        pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
        logits, past = lm.forward(ids, mask, pos)
        if step_ids is None:
            step_ids = logits[:, -1].argmax(-1)[:, None]
        mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        logits2, _ = lm.forward(step_ids, mask2, pos[:, -1:] + 1, past)
        return logits, logits2, step_ids, int(lm.vocab_size or 2)

    @classmethod
    def _compare(cls, src: Path, built: Path, src_level: str = "disable") -> dict[str, float]:
        """Logits of two graphs on a left-padded batch-2 prefill then one decode step: max |diff|,
        the logit scale max(1, max|logits|) and top-1 agreement over real prefill positions. The
        graphs run one after the other (one session resident)."""
        from harp_trt.onnx_io import read_export_meta

        vocab = int((read_export_meta(src) or {}).get("vocab_size") or 0)
        if not vocab:
            from harp_trt.ort_session import OrtCausalLM

            vocab = int(OrtCausalLM(src, providers=["CPUExecutionProvider"],
                                    graph_optimization_level="disable").vocab_size or 2)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, vocab, (2, 6))
        mask = np.ones((2, 6), np.int64)
        mask[1, :2] = 0
        la, la2, step_ids, _ = cls._run(src, ids, mask, None, src_level)
        lb, lb2, _, _ = cls._run(built, ids, mask, step_ids)
        valid = mask.astype(bool)
        diff = max(float(np.abs(la - lb)[valid].max()), float(np.abs(la2 - lb2).max()))
        top1 = float((la.argmax(-1) == lb.argmax(-1))[valid].mean())
        return {"logits_max_abs_diff": diff, "logit_scale": max(1.0, float(np.abs(la[valid]).max())),
                "top1_agreement": top1}

    @staticmethod
    def _copy_tokenizer(folder: Path, out: Path) -> list[str]:
        copied = copy_tokenizer(folder, out)
        if not set(VOCAB_FILES) & set(copied):
            log.warning("no tokenizer files in %s: `harp-trt generate` will need --tokenizer", folder)
        return copied


class OrtBuildStage(Stage[OrtBuildConfig]):
    """inputs: ``{"onnx": Artifact}`` (an export or rewrite artifact holding ``model.onnx`` and the
    tokenizer files); optional ``{"tokenizer": Artifact | path}`` when those files live elsewhere."""

    name = STAGE
    version = 1
    outputs = (ENGINE_JSON, "model.onnx")

    def requirements(self, config: OrtBuildConfig) -> tuple[tuple[str, str], ...]:
        return (("onnxruntime", "the ORT engine needs it"),)

    def check_preconditions(self, config: OrtBuildConfig, inputs: Mapping[str, Any]) -> None:
        art = inputs.get("onnx")
        if not isinstance(art, Artifact):
            raise PreconditionError(self.name, "needs inputs={'onnx': Artifact} (an export or rewrite artifact)")
        f = art.path / art.manifest.get("onnx", MODEL_FILE)
        if not f.is_file():
            raise PreconditionError(self.name, f"artifact {art.key} has no {f.name}", "re-run its stage")

    def prepare(self, store, config: OrtBuildConfig, inputs: Mapping[str, Any], hooks) -> dict[str, Any]:
        """The inputs, plus the pipeline's ``release`` hook (not part of the key)."""
        return {**inputs, "release": hooks.release} if hooks.release is not None else dict(inputs)

    def run(self, config: OrtBuildConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        art: Artifact = inputs["onnx"]
        tok = inputs.get("tokenizer")
        tok_dir = tok.path if isinstance(tok, Artifact) else tok
        release = inputs.get("release")
        spec = OrtBuilder().build(art.path / art.manifest.get("onnx", MODEL_FILE), Path(out_dir), config,
                                  tokenizer_dir=tok_dir, source_read=(lambda: release(art)) if release else None)
        return {"engine": spec, "model": art.manifest.get("model"), "plan": art.manifest.get("plan")}
