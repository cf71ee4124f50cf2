"""``TritonRepoStage``: an ONNX or TensorRT-LLM artifact -> a Triton model repository.

Inputs: one artifact folder (or cache key).

* ONNX Runtime: an ``export`` or ``rewrite`` artifact, an ORT engine folder (``engine.json`` next to
  ``model.onnx``), or any folder holding ``model.onnx`` -> one ``onnxruntime`` model
  (``onnx_repo.py``).
* TensorRT-LLM: a ``trtllm`` artifact (``TrtllmCheckpointStage``) -> ensemble / preprocessing /
  tensorrt_llm / postprocessing (``trtllm_repo.py``).

Every repository also gets ``client.py`` (tritonclient gRPC), ``README.md`` (how to start the server
and call it) and ``harp_triton.json`` (what was written from which artifact, and the values of the
template keys). The repository is written as every stage writes a folder (``Stage.write_to``): into
a temporary sibling of ``--out``, renamed into place only after every ``config.pbtxt`` parses as
Triton's ``ModelConfig`` and the ensemble wiring checks out (:func:`validate_repository`, the
stage's postcondition), so a failure leaves nothing half-written. An existing, non-empty ``--out``
is replaced only with ``force``."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping

from harp_trt.engine_spec import engine_threads
from harp_trt.errors import ConfigError, PostconditionError, PreconditionError
from harp_trt.onnx_io import copy_tokenizer, tokenizer_files
from harp_trt.mapping import ParallelMapping
from harp_trt.stage import Stage

from .artifact import ONNX_STAGES, TRTLLM_STAGES, ArtifactInfo, inspect_artifact
from .config import TritonRepoConfig
from .pbtxt import STAGE
from .readme import readme_llm, readme_onnx, readme_trtllm
from .validate import validate_repository

__all__ = ["TritonRepoStage", "ArtifactInfo", "inspect_artifact", "write_repository",
           "validate_repository", "ONNX_STAGES", "TRTLLM_STAGES", "REPO_MANIFEST"]

log = logging.getLogger(__name__)

REPO_MANIFEST = "harp_triton.json"


# ---- the stage --------------------------------------------------------------------------------
class TritonRepoStage(Stage[TritonRepoConfig]):
    """inputs: ``{"artifact": ArtifactInfo | Artifact | path}`` (``"engine"``, ``"onnx"`` and ``"trtllm"``
    are accepted as the key too). Writes a Triton model repository into ``out_dir``. Usable with
    ``Stage.execute`` (the repository then lives in the artifact cache, keyed by the upstream
    artifact and the config) or through :func:`write_repository` (a folder of the user's choice)."""

    name: ClassVar[str] = STAGE
    version: ClassVar[int] = 1
    outputs: ClassVar[tuple[str, ...]] = ("README.md", "client.py", REPO_MANIFEST)

    def requirements(self, config) -> tuple[tuple[str, str], ...]:
        return (("tritonclient", "Triton repositories need it (each config.pbtxt is checked against its "
                                 "ModelConfig schema)"),)
    INPUT_KEYS: ClassVar[tuple[str, ...]] = ("artifact", "engine", "onnx", "trtllm")

    @classmethod
    def artifact_of(cls, inputs: Mapping[str, Any]) -> ArtifactInfo:
        ref = next((inputs[k] for k in cls.INPUT_KEYS if inputs.get(k) is not None), None)
        if isinstance(ref, ArtifactInfo):
            return ref
        if ref is None:
            raise PreconditionError(STAGE, f"needs one of the inputs {', '.join(cls.INPUT_KEYS)} "
                                    "(an artifact, its folder or an ArtifactInfo)",
                                    "e.g. TritonRepoStage().execute(store, config, {'engine': ort_artifact})")
        return inspect_artifact(getattr(ref, "path", ref))

    def key_material(self, config: TritonRepoConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
        base = super().key_material(config, inputs)
        info = self.artifact_of(inputs)
        return {**base, "artifact": info.manifest.get("key") or str(info.path)}

    def check_preconditions(self, config: TritonRepoConfig, inputs: Mapping[str, Any]) -> None:
        info = self.artifact_of(inputs)
        if info.kind == "trtllm":
            from .trtllm_repo import read_checkpoint_config

            read_checkpoint_config(info.path)
            self._tokenizer_source(config, info)

    def run(self, config: TritonRepoConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        info = self.artifact_of(inputs)
        out = Path(out_dir)
        header = [f"Written by harp-trt from {info.stage or 'folder'} artifact {info.path}",
                  "Checked against Triton's model_config.proto (tritonclient model_config_pb2)."]
        body = (self._run_onnx(config, info, out, header) if info.kind == "onnx"
                else self._run_trtllm(config, info, out, header))
        body = {"artifact": {"path": str(info.path), "stage": info.stage, "key": info.manifest.get("key")}, **body}
        report = {"format": "harp-triton/1", "stage": STAGE, "stage_version": self.version,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": config.to_dict(), **body}
        (out / REPO_MANIFEST).write_text(json.dumps(report, indent=2, default=str))
        return body

    def check_postconditions(self, config: TritonRepoConfig, inputs: Mapping[str, Any], out_dir) -> None:
        super().check_postconditions(config, inputs, out_dir)
        validate_repository(Path(out_dir))

    # -- ONNX ------------------------------------------------------------------------------------
    def _run_onnx(self, config, info: ArtifactInfo, out: Path, header: list[str]) -> dict[str, Any]:
        if config.serving == "python":
            return self._run_llm(config, info, out, header)
        from .compat import check_triton_release
        from .llm_repo import check_gpu_graph, graph_dtype
        from .onnx_repo import write_onnx_model

        check_gpu_graph(info.onnx, config.device)
        if graph_dtype(info.onnx) == "bfloat16":
            raise ConfigError(f"{info.path.name} is a bfloat16 graph: Triton's onnxruntime backend does not serve "
                              "bf16 tensors to its clients (numpy and tritonclient have no bfloat16)",
                              "export in float16 for --serving onnx, or use --serving python")
        compat = check_triton_release(config.triton_release, info.onnx, info.engine)
        kind = "KIND_GPU" if config.device == "gpu" else "KIND_CPU"
        header = header + ["max_batch_size 0: every tensor lists its batch dimension; the client keeps the "
                           "KV cache (past_key_values.* in, present.* out)."]
        engine = info.engine or {}
        threads = engine_threads(engine, config.threads) or 0
        providers = [str(x) for x in engine.get("providers") or []]
        if config.device == "gpu" and providers and not any("CUDA" in x or "Tensorrt" in x for x in providers):
            log.warning("ORT engine %s was optimized for %s; ONNX Runtime's saved optimized graphs can hold "
                        "provider-specific nodes, so for KIND_GPU prefer the export/rewrite artifact",
                        info.path, ", ".join(providers))
        summary = write_onnx_model(info.onnx, out, config.model_name, kind, config.instances, threads,
                                   config.link, header)
        summary["engine_providers"] = providers
        if summary["pruned_layers"]:
            log.info("HARP-pruned layers without KV tensors: %s", summary["pruned_layers"])
        tok_files = tokenizer_files(info.path)
        if tok_files:
            (out / config.model_name / "tokenizer").mkdir()
            copy_tokenizer(info.path, out / config.model_name / "tokenizer")
        else:
            log.warning("artifact %s has no tokenizer files; client.py will need --tokenizer", info.path)
        defaults = {"model": config.model_name, "tokenizer": f"{config.model_name}/tokenizer",
                    "url": "localhost:8001", "max_tokens": 32}
        _write_client(out, "ort_client.py", defaults)
        (out / "README.md").write_text(readme_onnx(config, info, {**summary, "compat": compat}, bool(tok_files)))
        return {"kind": "onnx", "serving": "onnx", "device": config.device, "instance_kind": kind, **summary,
                "tokenizer_files": tok_files, "compat": compat}

    def _run_llm(self, config, info: ArtifactInfo, out: Path, header: list[str]) -> dict[str, Any]:
        from .llm_repo import write_llm_model

        summary = write_llm_model(info.onnx, info.engine, info.path, out, config.model_name, config, header)
        defaults = {"model": config.model_name, "url": "localhost:8001", "max_tokens": 32}
        _write_client(out, "llm_client.py", defaults)
        (out / "README.md").write_text(readme_llm(config, info, summary))
        return {"kind": "onnx", "device": config.device,
                "instance_kind": "KIND_GPU" if config.device == "gpu" else "KIND_CPU", **summary}

    # -- TensorRT-LLM ----------------------------------------------------------------------------
    def _tokenizer_source(self, config, info: ArtifactInfo) -> tuple[Path, list[str]]:
        candidates = []
        if config.tokenizer_dir:
            candidates.append(Path(config.tokenizer_dir))
        else:  # the artifact's own tokenizer/ (every trtllm artifact has one), then older layouts
            candidates += [info.path / "tokenizer", info.path / "hf"]
            refs = [(info.manifest.get("model") or {}).get("ref")]
            if (info.path / "plan.json").is_file():
                refs.append(json.loads((info.path / "plan.json").read_text()).get("model_ref"))
            candidates += [Path(r) for r in refs if r]
        for c in candidates:
            if c.is_dir() and (files := tokenizer_files(c)):
                return c, files
        raise PreconditionError(STAGE, f"no tokenizer files found for {info.path.name} (looked in "
                                f"{', '.join(str(c) for c in candidates)})",
                                "pass --tokenizer-dir with the model's tokenizer folder")

    def _run_trtllm(self, config, info: ArtifactInfo, out: Path, header: list[str]) -> dict[str, Any]:
        from .releases import TRTLLM_VERSION, check_trtllm_release
        from .trtllm_repo import check_engine_windows, read_checkpoint_config, trtllm_model_configs, write_trtllm_models

        # the version the checkpoint was written for (artifacts older than the field: this code's target)
        target = (info.manifest.get("tensorrt_llm") or {}).get("version") or TRTLLM_VERSION
        release = check_trtllm_release(config.triton_release, target)
        ckpt = read_checkpoint_config(info.path)
        engine_dir = config.engine_dir or str(info.path / "engine")
        check_engine_windows(engine_dir, (ckpt.get("runtime_defaults") or {}).get("max_attention_window"))
        configs, values = trtllm_model_configs(info.manifest, ckpt, config, engine_dir)
        tok_src, tok_files = self._tokenizer_source(config, info)
        write_trtllm_models(out, configs, tok_src, tok_files, header)
        engine_built = bool((info.manifest.get("engine") or {}).get("built")) or (Path(engine_dir) / "config.json").is_file()
        build = info.manifest.get("config") or {}
        _write_client(out, "trtllm_client.py", {"url": "localhost:8001", "max_tokens": 32,
                                                "decoupled": config.decoupled})
        summary = {"kind": "trtllm", "models": list(configs), "engine_dir": engine_dir,
                   "engine_built": engine_built, "tokenizer_from": str(tok_src), "tokenizer_files": tok_files,
                   "architecture": ckpt.get("architecture"), "world_size": (ckpt.get("mapping") or {}).get(
                       "world_size", ParallelMapping.from_config(build).world_size),
                   "template_values": values, "triton_release": release.release,
                   "tensorrt_llm_version": release.tensorrt_llm, "image": release.image,
                   "image_source": release.source}
        (out / "README.md").write_text(readme_trtllm(config, info, summary))
        return summary


def _write_client(out: Path, asset: str, defaults: dict[str, Any]) -> None:
    src = (Path(__file__).parent / "assets" / asset).read_text()
    marker = "DEFAULTS: dict = {}"
    if marker not in src:
        raise PostconditionError(STAGE, f"client template {asset} lost its DEFAULTS line")
    client = out / "client.py"
    client.write_text(src.replace(marker, f"DEFAULTS: dict = {defaults!r}", 1))
    client.chmod(0o755)


# ---- the entry point --------------------------------------------------------------------------
def write_repository(artifact: str | os.PathLike, out: str | os.PathLike, config: TritonRepoConfig | None = None,
                     force: bool = False, store=None) -> dict[str, Any]:
    """Write a Triton model repository for ``artifact`` at ``out``; returns the report (also saved
    as ``<out>/harp_triton.json``). Bad input raises a ``HarpError`` before anything is written."""
    config = config or TritonRepoConfig()
    info = inspect_artifact(artifact, store)
    out = Path(out).absolute()
    t0 = time.perf_counter()
    TritonRepoStage().write_to(config, {"artifact": info}, out, source=info.path, force=force)
    report = json.loads((out / REPO_MANIFEST).read_text())
    log.info("wrote Triton repository %s in %.2f s", out, time.perf_counter() - t0)
    return {**report, "repository": str(out)}


def deploy_summary(r: dict[str, Any], config: TritonRepoConfig) -> dict[str, Any]:
    """``harp-trt deploy triton``'s result (``--json``, the summary) from ``write_repository``'s report."""
    result = {"repository": r["repository"], "kind": r["kind"], "artifact": r["artifact"]["path"],
              "artifact_stage": r["artifact"]["stage"]}
    if r["kind"] == "onnx" and r.get("serving") == "python":
        result.update({"model": r["model"], "serving": "python", "instance_kind": r["instance_kind"],
                       "inputs": len(r["inputs"]), "weights": r["placed_by"]})
    elif r["kind"] == "onnx":
        result.update({"model": r["model"], "serving": "onnx", "instance_kind": r["instance_kind"],
                       "inputs": len(r["inputs"]), "outputs": len(r["outputs"]), "kv_layers": r["kv_layers"],
                       "pruned_layers": r["pruned_layers"], "weights": r["placed_by"],
                       "triton_onnxruntime": r["compat"]["triton_onnxruntime"]})
    else:
        v = r["template_values"]
        result.update({"models": ", ".join(r["models"]), "engine_dir": r["engine_dir"], "engine_built": r["engine_built"],
                       "max_batch_size": v["triton_max_batch_size"],
                       "max_attention_window_size": v["max_attention_window_size"],
                       "decoupled": v["decoupled_mode"], "triton_release": r["triton_release"],
                       "tensorrt_llm": r["tensorrt_llm_version"], "image": r["image"]})
        result["_tables"] = {"template keys": [{"key": k, "value": "(backend default)" if val is None else val}
                                               for k, val in v.items()]}
    return result
