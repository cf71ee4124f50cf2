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

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping

from harp_trt.onnx_io import TOKENIZER_FILES, copy_tokenizer, tokenizer_files
from harp_trt.errors import ConfigError, PostconditionError, PreconditionError
from harp_trt.mapping import ParallelMapping
from harp_trt.stage import Stage
from harp_trt.store import MANIFEST

from .config import TritonRepoConfig
from .pbtxt import STAGE, parse_model_config
from .readme import readme_llm, readme_onnx, readme_trtllm

__all__ = ["TritonRepoStage", "ArtifactInfo", "inspect_artifact", "write_repository",
           "validate_repository", "ONNX_STAGES", "TRTLLM_STAGES", "REPO_MANIFEST"]

log = logging.getLogger(__name__)

ONNX_STAGES = ("export", "rewrite", "build-ort")
TRTLLM_STAGES = ("trtllm",)
REPO_MANIFEST = "harp_triton.json"


@dataclasses.dataclass(frozen=True)
class ArtifactInfo:
    kind: str               # "onnx" or "trtllm"
    path: Path
    stage: str | None       # the manifest's stage, "ort-engine" for an engine.json folder, None for a bare folder
    manifest: dict[str, Any]
    onnx: Path | None = None
    engine: dict[str, Any] | None = None  # engine.json of an ORT engine folder


def inspect_artifact(ref: str | os.PathLike, store=None) -> ArtifactInfo:
    """Classify an artifact folder (or a cache key, looked up in ``store``) for the Triton target."""
    p = Path(ref)
    if not p.is_dir() and store is not None:
        try:
            p = store.open(str(ref)).path
        except Exception:  # CacheError: report below with the Triton wording
            pass
    if not p.is_dir():
        raise PreconditionError(STAGE, f"no artifact folder at {ref}",
                                "pass an export/rewrite/ORT-engine/trtllm artifact folder or its cache key "
                                "(`harp-trt cache ls`)")
    p = p.resolve()
    manifest = json.loads((p / MANIFEST).read_text()) if (p / MANIFEST).is_file() else {}
    stage = manifest.get("stage")
    engine_json = p / "engine.json"
    valid = ", ".join(ONNX_STAGES + TRTLLM_STAGES)
    if stage in TRTLLM_STAGES:
        return ArtifactInfo("trtllm", p, stage, manifest)
    if stage is not None and stage not in ONNX_STAGES and not engine_json.is_file():
        raise PreconditionError(STAGE, f"{p.name} is a {stage!r} artifact; Triton repositories are written from "
                                f"{valid} artifacts or an ORT engine folder",
                                "deploy the plan first (`harp-trt deploy trtllm --plan ...`, or export/rewrite it "
                                "to ONNX), then pass that artifact")
    name = manifest.get("onnx") or "model.onnx"
    engine: Any = None
    if engine_json.is_file():
        try:
            engine = json.loads(engine_json.read_text())
        except ValueError:
            raise PreconditionError(STAGE, f"{engine_json} is not valid JSON") from None
        stage = stage or "ort-engine"
        onnx_name = engine.get("model") if isinstance(engine, dict) else None  # builders/ort engine.json
        name = onnx_name if isinstance(onnx_name, str) and onnx_name.endswith(".onnx") else name
    onnx_path = p / name
    if not onnx_path.is_file():
        what = f"{stage!r} artifact" if stage else "folder"
        raise PreconditionError(STAGE, f"{what} {p} has no {name}",
                                "re-run the stage that writes it; an ONNX Runtime repository needs the graph")
    return ArtifactInfo("onnx", p, stage, manifest, onnx_path,
                        engine if engine_json.is_file() and isinstance(engine, dict) else None)


# ---- validation -------------------------------------------------------------------------------
def validate_repository(repo: Path) -> dict[str, Any]:
    """Parse every ``<model>/config.pbtxt`` into ``ModelConfig`` and check the repository is
    loadable as far as it can be without a server: model name = folder name, a version folder
    ``1/`` exists, no ``${...}`` left in any text file, and every ensemble step names a model of the
    repository, maps only tensors that model has, with matching data types and dims, and reads only
    ensemble inputs or outputs of earlier steps. Returns ``{model name: ModelConfig}``."""
    repo = Path(repo)
    configs = {}
    for cfg_path in sorted(repo.glob("*/config.pbtxt")):
        msg = parse_model_config(cfg_path, where=str(cfg_path.relative_to(repo)))
        folder = cfg_path.parent.name
        if msg.name != folder:
            raise PostconditionError(STAGE, f"{folder}/config.pbtxt names the model {msg.name!r}; Triton needs "
                                     f"the folder name {folder!r}")
        if not (cfg_path.parent / "1").is_dir():
            raise PostconditionError(STAGE, f"model {folder} has no version folder 1/")
        if not msg.input or not msg.output:
            raise PostconditionError(STAGE, f"model {folder} declares no inputs or no outputs")
        configs[folder] = msg
    if not configs:
        raise PostconditionError(STAGE, f"{repo} holds no <model>/config.pbtxt")
    for f in repo.rglob("*"):
        if f.is_file() and f.suffix in (".pbtxt", ".py", ".md", ".json", ".sh") and f.stat().st_size < 1 << 22:
            text = f.read_text(errors="replace")
            if "${" in text and f.name not in TOKENIZER_FILES:
                raise PostconditionError(STAGE, f"{f.relative_to(repo)} still holds a template key "
                                         f"{text[text.index('${'):][:40].splitlines()[0]!r}")
    for name, msg in configs.items():
        if msg.platform == "ensemble":
            _check_ensemble(name, msg, configs)
    return configs


def _tensors(msg, group: str) -> dict[str, Any]:
    return {t.name: t for t in getattr(msg, group)}


def _check_ensemble(name: str, ens, configs: dict[str, Any]) -> None:
    def fail(text: str):
        raise PostconditionError(STAGE, f"ensemble {name}: {text}")

    available = dict(_tensors(ens, "input"))  # tensor name -> spec (data_type, dims)
    for i, step in enumerate(ens.ensemble_scheduling.step):
        model = configs.get(step.model_name)
        if model is None:
            fail(f"step {i} runs model {step.model_name!r}, which is not in the repository")
        if model.max_batch_size < ens.max_batch_size:
            fail(f"max_batch_size {ens.max_batch_size} exceeds {step.model_name}'s {model.max_batch_size}")
        m_in, m_out = _tensors(model, "input"), _tensors(model, "output")
        for key, value in step.input_map.items():
            if key not in m_in:
                fail(f"step {step.model_name} maps input {key!r}, which the model does not have")
            if value not in available:
                fail(f"step {step.model_name} reads {value!r} before any step produces it")
            src, dst = available[value], m_in[key]
            if src.data_type != dst.data_type or list(src.dims) != list(dst.dims):
                fail(f"{value!r} ({src.data_type}, {list(src.dims)}) does not match {step.model_name}.{key} "
                     f"({dst.data_type}, {list(dst.dims)})")
        required = {n for n, t in m_in.items() if not t.optional}
        missing = required - set(step.input_map)
        if missing:
            fail(f"step {step.model_name} leaves required input(s) {sorted(missing)} unmapped")
        for key, value in step.output_map.items():
            if key not in m_out:
                fail(f"step {step.model_name} maps output {key!r}, which the model does not have")
            available[value] = m_out[key]
    for out in ens.output:
        if out.name not in available:
            fail(f"output {out.name!r} is produced by no step")
        src = available[out.name]
        if src.data_type != out.data_type or list(src.dims) != list(out.dims):
            fail(f"output {out.name!r} does not match the step output that produces it")


# ---- the stage --------------------------------------------------------------------------------
class TritonRepoStage(Stage[TritonRepoConfig]):
    """inputs: ``{"artifact": ArtifactInfo | Artifact | path}`` (``"engine"``, ``"onnx"`` and ``"trtllm"``
    are accepted as the key too). Writes a Triton model repository into ``out_dir``. Usable with
    ``Stage.execute`` (the repository then lives in the artifact cache, keyed by the upstream
    artifact and the config) or through :func:`write_repository` (a folder of the user's choice)."""

    name: ClassVar[str] = STAGE
    version: ClassVar[int] = 1
    outputs: ClassVar[tuple[str, ...]] = ("README.md", "client.py", REPO_MANIFEST)
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
        threads = config.threads or int(engine.get("intra_op_threads") or 0)
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
