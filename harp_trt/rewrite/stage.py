"""``RewriteStage``: dense ONNX graph + plan -> HARP graph (arXiv 2507.01900, Eq. 4-5), checked.

inputs (``Stage.execute``):
  ``plan``   a ``Plan`` (required);
  ``export`` the export stage's ``Artifact`` (its ``model.onnx``), or
  ``onnx``   a path to a user's own graph (optimum, onnxruntime-genai, ...);
  ``model``  the ``ResolvedModel`` for the PyTorch reference and tokenizer files (default: the
             export manifest's model, else the plan's ``model_ref``).

Writes ``model.onnx`` (+ ``model.onnx.data`` when large), ``plan.json``, ``rewrite_report.json``
and the tokenizer files. The key hashes the stage version, the config, the export artifact key
(or the user graph's content digest) and the plan. Any failure (digest mismatch, unrecognised
block, checker, verification) raises a typed error and leaves no artifact."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import onnx

from ..models import TOKENIZER_FILES
from ..config import StageConfig, digest_of
from ..errors import ConfigError, GraphError, PostconditionError, PreconditionError
from ..plan import Plan
from ..stage import Stage
from ..store import Artifact
from .graph import STAGE, load_graph, save_graph
from .passes import HarpRewritePass
from .verify import VerifyConfig, verify_rewrite

__all__ = ["RewriteConfig", "RewriteStage", "rewrite_onnx", "file_digest", "REPORT", "TOKENIZER_FILES"]

log = logging.getLogger(__name__)
REPORT = "rewrite_report.json"
EXPORT_META_KEY = "harp_trt.export"


@dataclass(frozen=True)
class RewriteConfig(StageConfig):
    """``verify``: run the ORT-vs-PyTorch check. ``rtol``: logits tolerance relative to
    ``max(1, max|logits|)``. ``decode_steps`` / ``greedy_steps``: decode steps whose logits /
    greedy tokens are compared. ``external_data_mb``: initializers above this total go to
    ``model.onnx.data`` (protobuf cannot exceed 2 GB)."""

    VERSION = 1
    verify: bool = True
    rtol: float = 1e-4
    decode_steps: int = 16
    greedy_steps: int = 32
    external_data_mb: int = 1900

    def validate(self) -> None:
        if not 0 < self.rtol < 1:
            raise ConfigError(f"RewriteConfig.rtol must lie in (0, 1), got {self.rtol}")
        if self.decode_steps < 0 or self.greedy_steps < 0:
            raise ConfigError("RewriteConfig.decode_steps and greedy_steps must be >= 0")
        if not 0 < self.external_data_mb <= 2000:
            raise ConfigError(f"RewriteConfig.external_data_mb must lie in (0, 2000], got {self.external_data_mb}")

    def verify_config(self) -> VerifyConfig:
        return VerifyConfig(rtol=self.rtol, decode_steps=self.decode_steps, greedy_steps=self.greedy_steps)


def file_digest(path: Path) -> str:
    """sha256 over an ONNX file and its external-data files (by content, not path)."""
    h = hashlib.sha256()
    path = Path(path)
    files = [path] + sorted(p for p in path.parent.glob(path.name + ".data*") if p.is_file())
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _graph_meta(path: Path) -> dict[str, Any]:
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends: not a model at all
        raise GraphError(STAGE, f"{path} is not a readable ONNX model ({type(e).__name__})",
                         "re-export the model; the file may be truncated") from None
    for p in m.metadata_props:
        if p.key == EXPORT_META_KEY:
            try:
                return json.loads(p.value)
            except ValueError:
                return {}
    return {}


def check_plan_matches(plan: Plan, meta: Mapping[str, Any], export_manifest: Mapping[str, Any] | None) -> None:
    """The plan must belong to the graph's model: same weights digest where the export recorded
    one, same model type and depth where the graph's metadata has them."""
    recorded = (meta.get("model_digest")
                or ((export_manifest or {}).get("model") or {}).get("digest"))
    if recorded and recorded != plan.model_digest:
        raise PreconditionError(STAGE, f"the plan is for weights {plan.model_digest[:16]}... but the graph "
                                       f"was exported from {recorded[:16]}...",
                                "calibrate the model this graph was exported from, or export the plan's model")
    if meta.get("num_layers") is not None and int(meta["num_layers"]) != plan.num_layers:
        raise PreconditionError(STAGE, f"the plan is for a {plan.num_layers}-layer model but the graph "
                                       f"has {meta['num_layers']} layers")
    if meta.get("harp_alphas"):
        raise PreconditionError(STAGE, "the graph was exported from an already HARP-pruned model "
                                       f"(layers {sorted(meta['harp_alphas'])})",
                                "rewrite the dense export instead")


def rewrite_onnx(src: Path, plan: Plan, out_path: Path, external_data_mb: int = 1900,
                 head_dim: int | None = None) -> dict[str, Any]:
    """Load ``src`` (with external data), apply the HARP pass for ``plan``, save to ``out_path``
    and run ``onnx.checker`` (full) and strict shape inference on the result. Returns the report."""
    model = load_graph(src)
    meta_raw = model.metadata_props.get(EXPORT_META_KEY)
    meta = json.loads(meta_raw) if meta_raw else {}
    head_dim = head_dim or meta.get("head_dim")
    result = HarpRewritePass(plan.alpha_map, plan.num_layers, head_dim=head_dim)(model)
    if meta:
        meta = {**meta, "kv_layers": [i for i in meta.get("kv_layers", range(plan.num_layers))
                                      if i not in plan.alpha_map],
                "harp_alphas": {str(k): v for k, v in plan.alpha_map.items()}}
        model.metadata_props[EXPORT_META_KEY] = json.dumps(meta)
    model.metadata_props["harp_trt.plan"] = json.dumps(
        {"model_digest": plan.model_digest, "layers": list(plan.layers), "alphas": list(plan.alphas)})
    external = save_graph(model, out_path, external_threshold_bytes=external_data_mb * (1 << 20))
    try:
        onnx.checker.check_model(str(out_path), full_check=True)
        onnx.shape_inference.infer_shapes_path(str(out_path), str(out_path) + ".shapes", strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise PostconditionError(STAGE, f"rewritten graph fails the ONNX checker: {str(e).splitlines()[0][:300]}") from None
    finally:
        Path(str(out_path) + ".shapes").unlink(missing_ok=True)
    report = result.to_dict()
    report["external_data"] = external
    report["kv_inputs"] = sum(1 for v in model.graph.inputs if "past" in v.name)
    return report


class RewriteStage(Stage[RewriteConfig]):
    name = "rewrite"
    version = 1
    outputs = ("model.onnx", "plan.json", REPORT)

    # -- inputs ---------------------------------------------------------------------------------
    @staticmethod
    def _source(inputs: Mapping[str, Any]) -> Path:
        if isinstance(inputs.get("export"), Artifact):
            art = inputs["export"]
            return art.path / art.manifest.get("onnx", "model.onnx")
        if inputs.get("onnx") is not None:
            return Path(inputs["onnx"])
        raise PreconditionError(STAGE, "needs inputs {'plan': Plan, 'export': Artifact} or {'plan': Plan, 'onnx': path}")

    def key_material(self, config: RewriteConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
        base = super().key_material(config, inputs)
        plan = inputs.get("plan")
        base["plan"] = digest_of(plan.to_dict()) if isinstance(plan, Plan) else None
        if not isinstance(inputs.get("export"), Artifact) and inputs.get("onnx") is not None:
            p = Path(inputs["onnx"])
            base["onnx_digest"] = file_digest(p) if p.is_file() else str(p)
        return base

    def check_preconditions(self, config: RewriteConfig, inputs: Mapping[str, Any]) -> None:
        plan = inputs.get("plan")
        if not isinstance(plan, Plan):
            raise PreconditionError(STAGE, "needs inputs['plan'] (a harp_trt.plan.Plan)",
                                    "run `harp-trt calibrate` or pass --plan plan.json")
        src = self._source(inputs)
        if not src.is_file():
            raise PreconditionError(STAGE, f"no ONNX graph at {src}")
        export = inputs.get("export")
        check_plan_matches(plan, _graph_meta(src), export.manifest if isinstance(export, Artifact) else None)
        resolved = inputs.get("model")
        if resolved is not None and getattr(resolved, "digest", None) and resolved.digest != plan.model_digest:
            raise PreconditionError(STAGE, f"--model {resolved.ref!r} has weights {resolved.digest[:16]}... but "
                                           f"the plan is for {plan.model_digest[:16]}...",
                                    "pass the model the plan was calibrated on")
        if not plan.layers:
            raise PreconditionError(STAGE, "the plan prunes no layers; there is nothing to rewrite")

    # -- run --------------------------------------------------------------------------------------
    def run(self, config: RewriteConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        plan: Plan = inputs["plan"]
        out_dir = Path(out_dir)
        src = self._source(inputs)
        report = rewrite_onnx(src, plan, out_dir / "model.onnx", config.external_data_mb)
        resolved = self._resolved(inputs, plan, required=config.verify)
        verify = None
        if config.verify:  # the reference is read layer by layer from the weights: bounded memory
            verify = verify_rewrite(out_dir / "model.onnx", Path(resolved.folder), plan.alpha_map,
                                    config.verify_config()).to_dict()
        report["verification"] = verify if verify is not None else {"skipped": "config.verify is false"}
        report["plan"] = {"layers": list(plan.layers), "alphas": list(plan.alphas),
                          "model_digest": plan.model_digest}
        (out_dir / REPORT).write_text(json.dumps(report, indent=2, default=str))
        plan.save(out_dir / "plan.json")
        copied = self._copy_tokenizer(inputs, resolved, out_dir)
        return {
            "model": resolved.to_dict() if resolved is not None else {"ref": plan.model_ref},
            "source": str(src), "onnx": "model.onnx", "external_data": report["external_data"],
            "layers": list(plan.layers), "alphas": list(plan.alphas), "kv_inputs": report["kv_inputs"],
            "kv_inputs_removed": [n for r in report["layers"] for n in r["kv_inputs_removed"]],
            "removed_params": report["params_removed"],
            "max_abs_diff": verify["max_abs_diff"] if verify else None,
            "tolerance": verify["tolerance"] if verify else None, "files": copied,
        }

    @staticmethod
    def _resolved(inputs: Mapping[str, Any], plan: Plan, required: bool = True):
        if inputs.get("model") is not None:
            return inputs["model"]
        from ..models import ResolvedModel

        export = inputs.get("export")
        m = (export.manifest.get("model") if isinstance(export, Artifact) else None) or {}
        if m.get("folder") and Path(m["folder"]).is_dir():
            return ResolvedModel(m.get("ref", plan.model_ref), Path(m["folder"]), m.get("digest", ""),
                                 m.get("source", "folder"))
        folder = Path(plan.model_ref)
        if folder.is_dir():
            return ResolvedModel(plan.model_ref, folder, plan.model_digest, "folder")
        if not required:
            return None
        raise PreconditionError(STAGE, f"cannot find the model {plan.model_ref!r} for the PyTorch reference",
                                "pass --model (the folder or preset the plan was calibrated on)")

    @staticmethod
    def _copy_tokenizer(inputs, resolved, out_dir: Path) -> list[str]:
        sources = []
        if resolved is not None:
            sources.append(Path(resolved.folder))
        if isinstance(inputs.get("export"), Artifact):
            sources.append(inputs["export"].path)
        copied = []
        for name in TOKENIZER_FILES:
            for folder in sources:
                if (folder / name).is_file():
                    shutil.copy2(folder / name, out_dir / name)
                    copied.append(name)
                    break
        return copied

    def check_postconditions(self, config: RewriteConfig, inputs: Mapping[str, Any], out_dir) -> None:
        super().check_postconditions(config, inputs, out_dir)
        plan: Plan = inputs["plan"]
        m = onnx.load(str(Path(out_dir) / "model.onnx"), load_external_data=False)
        names = {i.name for i in m.graph.input}
        left = sorted(n for n in names for l in plan.layers if n.startswith(f"past_key_values.{l}."))
        if left:
            raise PostconditionError(STAGE, f"rewritten graph still has KV inputs {left}")
