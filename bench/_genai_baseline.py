"""The onnxruntime-genai int4 baseline: what a user deploying a small LLM on CPU with ONNX Runtime
would pick. ``build_genai_int4`` runs onnxruntime-genai's model builder (``-p int4 -e cpu``:
``MatMulNBits`` int4 weights, ``GroupQueryAttention`` with a float32 KV cache, an int4
``GatherBlockQuantized`` embedding shared with the lm_head when the embeddings are tied) on a
local Hugging Face folder; ``genai_engine`` opens the built folder as the bench's genai engine,
which times prefill and greedy decode through the genai Python API (``og.Model`` / ``og.Generator``)
at a fixed intra-op thread count.

Checked with onnxruntime-genai 0.18.0 on onnxruntime 1.32.0 (``pip install onnxruntime-genai==0.18.0``
leaves onnxruntime and numpy as they are). Things this module handles for its caller:

* The builder's ``create_model`` needs ``config.architectures``; a config saved without it (such
  as SmolLM2 dequantized from GGUF) is staged in a temporary folder of symlinks with the field added.
* The builder imports its sibling modules as top-level ``builders`` / ``builder_config``; this
  repository also has a top-level ``builders`` package, which wins when the builder runs from the
  repository root. The builder therefore runs in a subprocess that puts genai's own folder first
  on ``sys.path``, with a temporary working and cache directory.
* The folder opens as the bench's genai engine, through ``harp_trt.genai_runtime.open_genai_model``
  (shared with the genai deploy stage): threads in ``model.decoder.session_options``
  (intra-op = ``threads``, inter-op = 1), ``clear_providers`` for the CPU.
* ``append_tokens`` runs the prompt's forward; the first ``generate_next_token`` only picks the
  token from those logits; each later one runs one decode forward. The graph computes logits for
  every prompt position (the builder's default; ``prune_lm_head`` is off).
* ``max_length`` (prompt + new tokens) may not exceed the model's ``context_length``
  (``genai_config.json``; 8192 for SmolLM2-135M), and a generator refuses to step past it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harp_trt.errors import PreconditionError, StageError
from harp_trt.genai_runtime import genai_version, import_genai  # shared with builders/genai

__all__ = [
    "GenaiUnavailableError", "GenaiBuildError", "genai_engine", "build_genai_int4",
    "genai_graph_facts", "genai_version", "stage_hf_folder", "BUILDER_MODULE",
    "INSTALL_HINT",
]

BUILDER_MODULE = "onnxruntime_genai.models.builder"
INSTALL_HINT = "pip install onnxruntime-genai==0.18.0   (needs onnxruntime>=1.31; leaves it unchanged)"
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)   # 0: EP default; 1 fp32, 2 fp16, 3 bf16, 4 int8 activations
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "olmo": "OlmoForCausalLM", "granite": "GraniteForCausalLM",
}
# The builder imports its siblings as top-level modules: put genai's own folder first so that a
# top-level ``builders`` package elsewhere on sys.path (this repository has one) cannot shadow it.
_BOOTSTRAP = ("import runpy, sys; import onnxruntime_genai.models as m; "
              "sys.path.insert(0, m.__path__[0]); "
              f"runpy.run_module({BUILDER_MODULE!r}, run_name='__main__', alter_sys=True)")


class GenaiUnavailableError(PreconditionError, ImportError):
    """onnxruntime-genai is not installed (or does not import) in this Python."""

    def __init__(self, message: str, hint: str | None = INSTALL_HINT):
        super().__init__("genai", message, hint)


class GenaiBuildError(StageError, RuntimeError):
    """The onnxruntime-genai model builder failed, timed out or left no model."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__("genai-build", message, hint)


def _require_genai() -> Any:
    """Import and return ``onnxruntime_genai`` or raise ``GenaiUnavailableError``."""
    try:
        return import_genai()
    except PreconditionError as exc:   # missing, or its native library / onnxruntime fails to load
        raise GenaiUnavailableError(f"onnxruntime_genai does not import: {exc.__cause__ or exc}") from exc


def _ort_version() -> str | None:
    try:
        return importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        return None


def stage_hf_folder(hf_folder: str | os.PathLike, stage_dir: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """``(folder to give the builder, config fields added)``. A folder whose ``config.json`` names
    its ``architectures`` is returned as is; otherwise ``stage_dir`` receives symlinks to every file
    and a ``config.json`` with ``architectures`` inferred from ``model_type``."""
    src = Path(hf_folder)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise GenaiBuildError(f"{src} has no config.json", hint="pass a Hugging Face model folder")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("architectures"):
        return src, {}
    model_type = cfg.get("model_type")
    arch = _ARCH_BY_MODEL_TYPE.get(model_type or "")
    if arch is None:
        try:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        except ImportError:
            arch = None
    if arch is None:
        raise GenaiBuildError(f"{cfg_path} has no 'architectures' and model_type {model_type!r} is unknown",
                              hint="add \"architectures\": [\"<Name>ForCausalLM\"] to a copy of the folder")
    stage = Path(stage_dir)
    stage.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not f.name.startswith("."):
            (stage / f.name).symlink_to(f.resolve())
    cfg["architectures"] = [arch]
    (stage / "config.json").write_text(json.dumps(cfg, indent=2))
    return stage, {"architectures": [arch]}


def build_genai_int4(hf_folder: str | os.PathLike, out_dir: str | os.PathLike, *, block_size: int = 32,
                     accuracy_level: int = 4, timeout: float = 1800.0,
                     extra_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the onnxruntime-genai int4 CPU model of the HF folder ``hf_folder`` into ``out_dir``
    with ``python -m onnxruntime_genai.models.builder -i ... -o ... -p int4 -e cpu --extra_options
    block_size=.. accuracy_level=..`` (both shown are the builder's CPU defaults) in a subprocess,
    offline. Returns the settings, the command, the versions, the seconds taken and the files.
    Raises ``GenaiUnavailableError`` without onnxruntime-genai, ``GenaiBuildError`` on failure."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level}")
    version = genai_version()
    if version is None or importlib.util.find_spec("onnxruntime_genai") is None:
        raise GenaiUnavailableError("onnxruntime-genai is not installed; its model builder is needed")
    out = Path(out_dir).resolve()
    options = {"block_size": block_size, "accuracy_level": accuracy_level, **(extra_options or {})}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tempfile.TemporaryDirectory(prefix="genai-build-") as work:
        folder, patched = stage_hf_folder(hf_folder, Path(work) / "hf")
        args = ["-i", str(folder), "-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(Path(work) / "cache"),
                "--extra_options", *(f"{k}={v}" for k, v in options.items())]
        cmd = [sys.executable, "-c", _BOOTSTRAP, *args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise GenaiBuildError(f"the model builder ran past {timeout:.0f} s") from exc
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "")[-2000:].strip()
        raise GenaiBuildError(f"the model builder exited with {proc.returncode}:\n{tail}")
    missing = [n for n in ("model.onnx", "genai_config.json") if not (out / n).is_file()]
    if missing:
        raise GenaiBuildError(f"the model builder left no {', '.join(missing)} in {out}")
    genai_cfg = json.loads((out / "genai_config.json").read_text())
    return {
        "builder": BUILDER_MODULE, "onnxruntime_genai": version, "onnxruntime": _ort_version(),
        "precision": "int4", "execution_provider": "cpu", "block_size": block_size,
        "accuracy_level": accuracy_level, "extra_options": options,
        "input": str(Path(hf_folder).resolve()), "config_patch": patched, "out_dir": str(out),
        "command": ["python", "-m", BUILDER_MODULE, "-i", str(Path(hf_folder).resolve()), *args[2:8],
                    "--extra_options", *(f"{k}={v}" for k, v in options.items())],
        "seconds": seconds, "context_length": genai_cfg["model"].get("context_length"),
        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
    }


def genai_graph_facts(folder: str | os.PathLike) -> dict[str, Any]:
    """What the built ``model.onnx`` holds (read with onnx, weights not loaded): op counts, the
    ``MatMulNBits`` bits / block sizes / accuracy levels, the attention op, the KV-cache dtype and
    whether logits cover every position."""
    import onnx

    model = onnx.load(str(Path(folder) / "model.onnx"), load_external_data=False)
    graph = model.graph

    def attrs(node: Any) -> dict[str, Any]:
        return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def dtype(v: Any) -> str:
        return onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower()

    def dims(v: Any) -> list[Any]:
        return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]

    nbits = [attrs(n) for n in graph.node if n.op_type == "MatMulNBits"]
    gqa = [attrs(n) for n in graph.node if n.op_type == "GroupQueryAttention"]
    past = [v for v in graph.input if v.name.startswith("past_key_values")]
    logits = next((v for v in graph.output if v.name == "logits"), None)
    return {
        "ops": dict(Counter(n.op_type for n in graph.node).most_common()),
        "matmulnbits": {"count": len(nbits), "bits": sorted({a["bits"] for a in nbits}),
                        "block_size": sorted({a["block_size"] for a in nbits}),
                        "accuracy_level": sorted({a.get("accuracy_level", 0) for a in nbits})},
        "embedding_op": next((n.op_type for n in graph.node if "embed_tokens" in n.name
                              and n.op_type.startswith("Gather")), None),
        "attention": {"op": "GroupQueryAttention" if gqa else None, "layers": len(gqa),
                      **({k: gqa[0][k] for k in ("num_heads", "kv_num_heads", "do_rotary") if k in gqa[0]}
                         if gqa else {})},
        "kv_cache_dtype": dtype(past[0]) if past else None,
        "kv_cache_shape": dims(past[0]) if past else None,
        "logits_shape": dims(logits) if logits is not None else None,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
    }


def genai_engine(folder: str | os.PathLike, threads: int, *, warmup_tokens: int = 16) -> Any:
    """The genai-built ``folder`` opened as the bench's genai engine (``bench/stage/engine_genai.py``:
    ``GenaiBenchEngine``, whose ``prefill_seconds`` / ``decode_tokens_per_s`` time whole genai calls)
    on the CPU with ``threads`` intra-op threads; ``warmup_tokens`` > 0 runs one short prefill and
    decode first, so lazy initialisation is not timed."""
    from harp_trt.bench.stage.engine_genai import GenaiBenchEngine

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _require_genai()
    engine = GenaiBenchEngine(Path(folder), "genai", int(threads), headroom=0, max_positions=1 << 30)
    if warmup_tokens > 0:
        engine.decode_tokens_per_s(list(range(100, 100 + warmup_tokens)), 2)
    return engine
