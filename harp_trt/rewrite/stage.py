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

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import onnx

from ..compact import compact, expand
from ..config import digest_of
from ..dims import attention_dims
from ..errors import GraphError, PostconditionError, PreconditionError
from ..graph_rules import run_passes
from ..onnx_io import (EXPORT_META_KEY, EXTERNAL_DATA_THRESHOLD, MODEL_FILE, PLAN_META_KEY, check_plan_weights, copy_tokenizer, file_digest,
                       parse_kv_name, read_export_meta)
from ..plan import Plan
from ..stage import CompactIntermediates, Stage
from ..store import Artifact
from .config import RewriteConfig
from .graph import STAGE, check_onnx, fix_constant_shapes, load_graph, save_graph
from .fold import fitted_weights
from .passes import HarpRewritePass
from ..verify import verify_rewrite

__all__ = ["RewriteStage", "rewrite_onnx", "check_plan_graph", "check_foreign_graph", "graph_facts", "REPORT"]

log = logging.getLogger(__name__)
REPORT = "rewrite_report.json"


def check_plan_graph(plan: Plan, meta: Mapping[str, Any], export_manifest: Mapping[str, Any] | None) -> None:
    """The plan must belong to the graph's model: same weights digest where the export recorded
    one, same depth where the graph's metadata has it, and a dense (not already pruned) graph."""
    recorded = (meta.get("model_digest")
                or ((export_manifest or {}).get("model") or {}).get("digest"))
    check_plan_weights(plan.model_digest, recorded, STAGE, "the graph's model",
                       "calibrate the model this graph was exported from, or export the plan's model")
    if meta.get("num_layers") is not None and int(meta["num_layers"]) != plan.num_layers:
        raise PreconditionError(STAGE, f"the plan is for a {plan.num_layers}-layer model but the graph "
                                       f"has {meta['num_layers']} layers")
    if meta.get("harp_alphas"):
        raise PreconditionError(STAGE, "the graph was exported from an already HARP-pruned model "
                                       f"(layers {sorted(meta['harp_alphas'])})",
                                "rewrite the dense export instead")


def graph_facts(graph, head_dim: int | None = None) -> dict[str, Any]:
    """What a graph without harp-trt metadata tells about its model: the number of attention
    layers, and from layer 0's matched block (its V/o_proj weights and core) the hidden size,
    heads, KV heads and head size. Keys whose value cannot be read are absent."""
    from .passes import count_attention_layers

    n = count_attention_layers(graph)
    facts: dict[str, Any] = {"num_layers": n}
    if n:
        try:
            m = HarpRewritePass({}, n, head_dim=head_dim).match_layer(graph, 0)
        except GraphError as e:  # the pass names the pruned layers that fail; here it is only a hint
            log.info("graph facts: layer 0 not matched (%s)", e.message)
            return facts
        shape = m.w_o.const_value.shape if m.w_o.const_value is not None else None
        if shape is not None:
            facts["hidden_size"] = int(shape[1])
        facts.update(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    return facts


def check_foreign_graph(plan: Plan, facts: Mapping[str, Any], model_config: Mapping[str, Any] | None,
                        model_ref: str | None = None) -> None:
    """A graph harp-trt did not export records no weights digest. The plan fits it when the
    graph's attention-layer count is the plan's depth and, given the model the plan is verified
    against (``--model``, whose digest the stage has checked against the plan), the graph's
    depth, hidden size and heads are that model's."""
    if facts.get("num_layers") != plan.num_layers:
        raise PreconditionError(STAGE, f"the graph has {facts.get('num_layers', 0)} attention layers but the "
                                       f"plan is for a {plan.num_layers}-layer model",
                                "the plan belongs to a different model than this graph" if facts.get("num_layers")
                                else "no attention block was recognised: see `harp-trt rewrite --help`")
    if not model_config:
        return
    cfg = model_config.get("text_config", model_config)
    heads, kv_heads, head_dim = attention_dims(cfg) or (None, None, None)
    want = {"num_layers": cfg.get("num_hidden_layers"), "hidden_size": cfg.get("hidden_size"),
            "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}
    bad = [f"{k} {facts[k]} (model: {v})" for k, v in want.items()
           if v is not None and facts.get(k) is not None and int(facts[k]) != int(v)]
    if bad:
        raise PreconditionError(STAGE, f"the graph is not an export of {model_ref or 'the model'}: graph has "
                                       + ", ".join(bad),
                                "pass the --model this graph was exported from (and a plan calibrated on it)")


def rewrite_onnx(src: Path, plan: Plan, out_path: Path, external_data_mb: int = EXTERNAL_DATA_THRESHOLD >> 20,
                 head_dim: int | None = None, model_config: Mapping[str, Any] | None = None,
                 model_ref: str | None = None, fitted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load ``src`` (with external data), apply the HARP pass for ``plan``, save to ``out_path``
    and run ``onnx.checker`` (full) and strict shape inference on the result. Returns the report.
    A graph without harp-trt's export metadata (optimum, onnxruntime-genai, ...) is first checked
    against the plan and ``model_config`` (the reference model's ``config.json``) by
    ``check_foreign_graph``. ``fitted`` (checkpoint names -> tensors; default the plan's
    ``fitted_tensors``) are the fitted maps of the plan's fitted layers: ``rrr``'s two GEMMs or
    ``lmmse``'s one GEMM and bias (``rules/base.py``)."""
    fitted = fitted_weights(plan.fitted_tensors() if fitted is None else fitted, plan.family)
    model = load_graph(src)
    expand(model)  # a compact export's weights as fp32 initializers again, lazily (harp_trt.compact)
    meta_raw = model.metadata_props.get(EXPORT_META_KEY)
    meta = json.loads(meta_raw) if meta_raw else {}
    head_dim = head_dim or meta.get("head_dim")
    facts = None
    if not meta:
        facts = graph_facts(model.graph, head_dim)
        check_foreign_graph(plan, facts, model_config, model_ref)
    model, reports = run_passes([HarpRewritePass(plan.alpha_map, plan.num_layers, head_dim=head_dim, fitted=fitted)],
                                model)
    if meta:
        meta = {**meta, "kv_layers": [i for i in meta.get("kv_layers", range(plan.num_layers))
                                      if i not in plan.alpha_map],
                "harp_alphas": {str(k): v for k, v in plan.alpha_map.items()}}
        model.metadata_props[EXPORT_META_KEY] = json.dumps(meta)
    shapes_fixed = fix_constant_shapes(model.graph)
    model.metadata_props[PLAN_META_KEY] = json.dumps(
        {"model_digest": plan.model_digest, "layers": list(plan.layers), "alphas": list(plan.alphas)})
    if meta.get("storage") == "compact":
        compact(model)  # the weights read from the checkpoint back at its width; folded ones fp32
    external = save_graph(model, out_path, external_threshold_bytes=external_data_mb * (1 << 20))
    report = dict(reports["harp"])
    report["external_data"] = external
    report["shape_annotations_fixed"] = shapes_fixed
    report["source"] = {"harp_export": bool(meta), **({"graph_facts": facts} if facts is not None else {})}
    report["storage"] = meta.get("storage", "full")
    report["kv_inputs"] = sum(1 for v in model.graph.inputs if (k := parse_kv_name(v.name)) and k.direction == "past")
    del model  # the checker loads the saved file again: one copy of the weights at a time
    try:
        check_onnx(out_path, full_check=True, strict_shapes=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise PostconditionError(STAGE, f"rewritten graph fails the ONNX checker: {str(e).splitlines()[0][:300]}") from None
    return report


class RewriteStage(CompactIntermediates, Stage[RewriteConfig]):
    name = "rewrite"
    version = 1
    outputs = ("model.onnx", "plan.json", REPORT)
    intermediate = ("model.onnx",)

    def requirements(self, config: RewriteConfig) -> tuple[tuple[str, str], ...]:
        return (("onnxruntime", "the rewrite's check against PyTorch needs it (or --no-verify)"),) if config.verify else ()

    # -- inputs ---------------------------------------------------------------------------------
    @staticmethod
    def _source(inputs: Mapping[str, Any]) -> Path:
        if isinstance(inputs.get("export"), Artifact):
            art = inputs["export"]
            return art.path / art.manifest.get("onnx", MODEL_FILE)
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
        check_plan_graph(plan, read_export_meta(src, STAGE), export.manifest if isinstance(export, Artifact) else None)
        resolved = inputs.get("model")
        if resolved is not None:
            check_plan_weights(plan.model_digest, getattr(resolved, "digest", None), STAGE, f"--model {resolved.ref!r}")
        if not plan.layers:
            raise PreconditionError(STAGE, "the plan prunes no layers; there is nothing to rewrite")

    # -- run --------------------------------------------------------------------------------------
    def run(self, config: RewriteConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        plan: Plan = inputs["plan"]
        out_dir = Path(out_dir)
        src = self._source(inputs)
        resolved = self._resolved(inputs, plan, required=config.verify)
        cfg_file = Path(resolved.folder) / "config.json" if resolved is not None else None
        model_config = json.loads(cfg_file.read_text()) if cfg_file is not None and cfg_file.is_file() else None
        probe, probe_check = inputs.get("probe"), None
        if config.verify and isinstance(probe, Artifact) and probe.manifest.get("probe"):
            # a graph too large for one ORT session: its probe (checked first, its rewrite removed
            # before the full one is written), then the full graph's structure (harp_trt.probe)
            from .probe_check import check_probe

            probe_check = check_probe(probe, plan, config.verify_config(), out_dir / ".probe", rewrite_onnx)
        report = rewrite_onnx(src, plan, out_dir / MODEL_FILE, config.external_data_mb,
                              model_config=model_config, model_ref=resolved.ref if resolved is not None else None)
        verify = None
        if probe_check is not None:
            verify = probe_check.structure(out_dir / MODEL_FILE, plan)
        elif config.verify:  # the reference is read layer by layer from the weights: bounded memory
            verify = {**verify_rewrite(out_dir / MODEL_FILE, Path(resolved.folder), plan.alpha_map,
                                       config.verify_config(), fitted=plan.fitted_tensors()).to_dict(),
                      "path": "whole graph"}
        report["verification"] = verify if verify is not None else {"skipped": "config.verify is false"}
        report["plan"] = {"layers": list(plan.layers), "alphas": list(plan.alphas),
                          "model_digest": plan.model_digest}
        (out_dir / REPORT).write_text(json.dumps(report, indent=2, default=str))
        plan.save(out_dir / "plan.json")
        copied = self._copy_tokenizer(inputs, resolved, out_dir)
        return {
            "model": resolved.to_dict() if resolved is not None else {"ref": plan.model_ref},
            "source": str(src), "onnx": MODEL_FILE, "external_data": report["external_data"],
            "layers": list(plan.layers), "alphas": list(plan.alphas), "kv_inputs": report["kv_inputs"],
            "kv_inputs_removed": [n for r in report["layers"] for n in r["kv_inputs_removed"]],
            "removed_params": report["params_removed"],
            "max_abs_diff": verify["max_abs_diff"] if verify else None,
            "verify_path": verify["path"] if verify else None, "storage": report.get("storage"),
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
        return copy_tokenizer(sources, out_dir)

    def check_postconditions(self, config: RewriteConfig, inputs: Mapping[str, Any], out_dir) -> None:
        super().check_postconditions(config, inputs, out_dir)
        plan: Plan = inputs["plan"]
        m = onnx.load(str(Path(out_dir) / MODEL_FILE), load_external_data=False)
        left = sorted(i.name for i in m.graph.input if (k := parse_kv_name(i.name)) and k.layer in plan.alpha_map)
        if left:
            raise PostconditionError(STAGE, f"rewritten graph still has KV inputs {left}")
