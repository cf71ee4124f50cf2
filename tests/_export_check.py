"""The tests' check of a dense export against PyTorch on the same inputs (ONNX Runtime, CPU): the
export stage itself verifies with ``harp_trt.verify``; this compares the raw graph, present
KV outputs included, on hand-made shapes (prefill and a step with a past)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from harp_trt.errors import VerificationError
from harp_trt.export.export import _example, _FlatKV, kv_layers_of
from harp_trt.onnx_io import input_names

__all__ = ["verify_export"]

log = logging.getLogger(__name__)


def verify_export(model: nn.Module, onnx_path: Path, atol: float = 1e-4,
                  shapes: tuple[tuple[int, int, int], ...] = ((1, 7, 0), (2, 3, 4))) -> dict[str, float]:
    """Run the ONNX graph in ORT (CPU) and the PyTorch model on the same inputs, for each
    (batch, seq, past) in ``shapes``; returns max |diff| per output kind and raises
    ``VerificationError`` if logits differ by more than ``atol * max(1, max|logits|)``."""
    import numpy as np
    import onnxruntime as ort

    kv_layers = kv_layers_of(model)
    wrapper = _FlatKV(model, kv_layers, model.config.num_hidden_layers).eval()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    names = input_names(kv_layers)
    report = {"logits": 0.0, "present": 0.0, "tolerance": 0.0}
    for b, s, p in shapes:
        args = _example(model, kv_layers, b, s, p, seed=1 + b + s + p)
        with torch.no_grad():
            ref = wrapper(*args)
        flat = [args[0], args[1], args[2], *args[3]]
        got = sess.run(None, {n: t.numpy() for n, t in zip(names, flat)})
        tol = atol * max(1.0, float(ref[0].abs().max()))
        report["tolerance"] = max(report["tolerance"], tol)
        report["logits"] = max(report["logits"], float(np.abs(got[0] - ref[0].numpy()).max()))
        for g_, r_ in zip(got[1:], ref[1:]):
            report["present"] = max(report["present"], float(np.abs(g_ - r_.numpy()).max()))
    log.info("export check: logits max|diff| %.3g, present max|diff| %.3g (tolerance %.3g)",
             report["logits"], report["present"], report["tolerance"])
    if not (report["logits"] <= report["tolerance"] and report["present"] <= report["tolerance"]):
        raise VerificationError(
            "export", f"ONNX differs from PyTorch: logits max|diff| {report['logits']:.3g}, present "
            f"max|diff| {report['present']:.3g}, tolerance {report['tolerance']:.3g}",
            "report this with the model type; try another opset")
    return report
