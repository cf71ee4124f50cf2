"""The ORT backend's step conditions, named by its ``harp_trt.registry.Step`` entries as lazy
``"module:function"`` strings (light: no onnx/torch; the pipeline calls them with the step's
``OrtBuildConfig``)."""
from __future__ import annotations

import dataclasses

from .config import OrtBuildConfig

__all__ = ["quantized", "exact", "configure", "preflight"]


def quantized(config: OrtBuildConfig) -> bool:
    """The exact (fp32) engines behind the bench's ``perplexity_fp32`` row are built only when the
    run's ORT engines are quantized (otherwise the engines are already exact)."""
    return config.quant != "none"


def exact(config: OrtBuildConfig) -> OrtBuildConfig:
    """The run's ORT config, unquantized: the exact engine of the same graph."""
    return dataclasses.replace(config, quant="none")


def configure(configs, resolved):
    """A quantized run of a bf16/fp16 checkpoint stores its export and rewrite compactly
    (``harp_trt.compact``: the checkpoint's weights at their width behind an exact Cast), checks
    the rewrite through the plan's probe model (``harp_trt.probe``) and drops consumed
    intermediates: nothing holds the fp32 graph. An fp32 checkpoint keeps the fp32 path."""
    from harp_trt.preflight import read_shapes

    ort, export = configs.get("build-ort"), configs.get("export")
    if ort is None or export is None or ort.quant == "none" or export.storage != "full" or export.dtype != "float32":
        return {}
    if not read_shapes(resolved.folder).half:
        return {}
    return {"export": dataclasses.replace(export, storage="compact")}


def preflight(resolved, configs, cache, keep_intermediates: bool = False) -> dict:
    """Peak memory and cache disk of export -> rewrite -> build from the model's shapes
    (``harp_trt.preflight``); ``ResourceError`` before any work when they do not fit."""
    from harp_trt.preflight import check_fits, estimate_onnx_build, read_shapes

    ort, export = configs["build-ort"], configs["export"]
    spec = ort.quant_spec()
    est = estimate_onnx_build(read_shapes(resolved.folder), spec.bits, spec.block_size,
                              export.storage == "compact", keep_intermediates)
    return check_fits(est, cache, f"building the ORT engine of {resolved.ref}" +
                      (f" ({ort.quant})" if ort.quant != "none" else ""))
