"""What a Triton release's ONNX Runtime backend can load (``docs/trtllm-contract.md``, rows ort-*).

Triton's onnxruntime backend links the ONNX Runtime of its release, usually older than ours:
* release -> ORT version: ``build.py`` ``TRITON_VERSION_MAP`` of triton-inference-server/server
  (24.10: 1.19.2 ... 25.10: 1.23.1, 26.04: 1.24.4; the table is ``releases.TRITON_ORT``);
* ORT version -> newest ONNX opset it runs: onnxruntime ``docs/Versioning.md`` (1.19/1.20: 21,
  1.21: 22, 1.22 and 1.23: 23);
* GroupQueryAttention attributes/inputs by the first ORT that knows them (read from each wheel's
  ``contrib_ops`` schema: ``smooth_softmax`` 1.19.2, ``softcap`` 1.20.0, ``position_ids`` /
  ``attention_bias`` inputs 1.22.0, ``qk_output`` 1.23.0); an older ORT refuses the model
  ("Unrecognized attribute");
* a graph saved by ORT's optimizer (an ORT engine artifact) may hold fused contrib nodes of that
  ORT version: only an ORT at least as new is sure to load it.
``required_ort`` gives a graph's minimum ORT; ``check_triton_release`` refuses (exit 2) a target
release whose ORT is older."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harp_trt.errors import ConfigError

from .pbtxt import STAGE
from .releases import TRITON_ORT  # the release tables (and the default release) live there

__all__ = ["required_ort", "check_triton_release"]

_ORT_MAX_OPSET = {(1, 19): 21, (1, 20): 21, (1, 21): 22, (1, 22): 23, (1, 23): 23}
# GroupQueryAttention: attribute or input -> first ORT version that accepts it
_GQA_SINCE = {"smooth_softmax": "1.19.2", "softcap": "1.20.0", "qk_output": "1.23.0"}
_GQA_INPUT_SINCE = {9: "1.22.0", 10: "1.22.0", 11: "1.23.0"}  # position_ids, attention_bias, head_sink


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:3] if x.isdigit())


def _min_ort_for_opset(opset: int) -> str:
    for (major, minor), top in sorted(_ORT_MAX_OPSET.items()):
        if top >= opset:
            return f"{major}.{minor}.0"
    return "9999"


def required_ort(onnx_path: Path, engine: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """(minimum ORT version, reasons) to load the graph at ``onnx_path``."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    reasons: list[tuple[str, str]] = []
    opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
    reasons.append((_min_ort_for_opset(opset), f"ONNX opset {opset}"))
    for node in m.graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            for a in node.attribute:
                if a.name in _GQA_SINCE:
                    reasons.append((_GQA_SINCE[a.name], f"GroupQueryAttention attribute {a.name}"))
            for idx, since in _GQA_INPUT_SINCE.items():
                if len(node.input) > idx and node.input[idx]:
                    reasons.append((since, f"GroupQueryAttention input {idx}"))
    ort_saved = ((engine or {}).get("versions") or {}).get("onnxruntime")
    if ort_saved:
        reasons.append((ort_saved, f"graph optimized and saved by ONNX Runtime {ort_saved}"))
    need = max(reasons, key=lambda r: _v(r[0]))[0]
    return need, sorted({why for v, why in reasons if _v(v) == _v(need)})


def check_triton_release(release: str, onnx_path: Path, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    if release not in TRITON_ORT:
        raise ConfigError(f"unknown Triton release {release!r}; known: {', '.join(TRITON_ORT)}",
                          "pass --triton-release YY.MM of the tritonserver image you will run")
    have = TRITON_ORT[release]
    need, why = required_ort(onnx_path, engine)
    if _v(have) < _v(need):
        raise ConfigError(
            f"[{STAGE}] Triton {release} ships ONNX Runtime {have}, but {onnx_path.parent.name}/{onnx_path.name} "
            f"needs ONNX Runtime >= {need} ({'; '.join(why)})",
            "serve it with the Python-backend model (--serving python, runs this ONNX Runtime), pass the "
            "rewrite artifact (standard ops) instead of an ORT engine, or target a newer --triton-release")
    return {"triton_release": release, "triton_onnxruntime": have, "graph_needs_onnxruntime": need}
