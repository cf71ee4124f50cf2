"""The text-in / text-out Triton model for an ORT engine: a Python-backend model that generates
inside the server (``assets/ort_llm_model.py``), with the I/O of Triton's vLLM backend.

``<repo>/<name>/config.pbtxt``: backend python, decoupled (streaming), ``max_batch_size 0`` (the
model batches concurrent requests itself, continuously); ``<repo>/<name>/1/model.py`` and
``1/engine/`` (the graph hard-linked or copied, ``engine.json``, tokenizer files). The version
folder is never empty, so a git copy of the repository keeps it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from harp_trt.engine_spec import engine_threads, write_engine_spec
from harp_trt.errors import ConfigError
from harp_trt.onnx_io import folder_adds_bos, parse_kv_name, tokenizer_files

from .onnx_repo import external_data_files, place_file
from .pbtxt import Enum, render_pbtxt

__all__ = ["write_llm_model", "check_gpu_graph", "graph_dtype", "LLM_INPUTS", "LLM_OUTPUTS"]

LLM_INPUTS = [
    {"name": "text_input", "data_type": Enum("TYPE_STRING"), "dims": [1]},
    {"name": "stream", "data_type": Enum("TYPE_BOOL"), "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": Enum("TYPE_STRING"), "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": Enum("TYPE_BOOL"), "dims": [1], "optional": True},
]
LLM_OUTPUTS = [{"name": "text_output", "data_type": Enum("TYPE_STRING"), "dims": [-1]}]


def _uses_gqa(onnx_path: Path) -> bool:
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    return any(n.op_type == "GroupQueryAttention" for n in m.graph.node)


def graph_dtype(onnx_path: Path) -> str:
    """numpy name of the graph's KV-cache element type (its first ``past_key_values`` input; float32 without one)."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    for i in m.graph.input:
        if (kv := parse_kv_name(i.name)) and kv.direction == "past":
            return onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
    return "float32"


def check_gpu_graph(onnx_path: Path, device: str) -> None:
    """ONNX Runtime's CUDA GroupQueryAttention kernel takes float16/bfloat16 only: an fp32 GQA
    graph on a GPU silently runs attention on the CPU provider (with copies each layer)."""
    if device == "gpu" and _uses_gqa(onnx_path) and graph_dtype(onnx_path) == "float32":
        raise ConfigError(f"{onnx_path.parent.name} is an fp32 GroupQueryAttention graph: ONNX Runtime's CUDA "
                          "kernel for it takes float16/bfloat16 only, so attention would fall back to the CPU",
                          "export in half precision for GPU engines (ExportConfig dtype float16), or use --device cpu")


def _eos_ids(folder: Path) -> list[int]:
    """The stop tokens `harp-trt generate` uses: the tokenizer's eos plus generation_config.json's."""
    from transformers import AutoTokenizer

    ids: set[int] = set()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
    except (OSError, ValueError):
        pass
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    return sorted(ids)


def write_llm_model(onnx_path: Path, engine: dict[str, Any] | None, source: Path, repo: Path, name: str,
                    config, header: list[str]) -> dict[str, Any]:
    """Write the Python-backend generation model; returns a summary for the report."""
    check_gpu_graph(onnx_path, config.device)
    mdir = repo / name
    edir = mdir / "1" / "engine"
    edir.mkdir(parents=True)
    how = place_file(onnx_path, edir / onnx_path.name, config.link)
    files = [onnx_path.name]
    for loc in external_data_files(onnx_path):
        place_file(onnx_path.parent / loc, edir / loc, config.link)
        files.append(loc)
    spec = dict(engine or {})
    spec["model"] = onnx_path.name
    write_engine_spec(edir, spec)
    tok = tokenizer_files(source)
    if not tok:
        raise ConfigError(f"{source} has no tokenizer files: the text-in/text-out model needs them",
                          "pass an artifact built by harp-trt (export/rewrite/ORT engine), or --serving onnx")
    for f in tok:
        shutil.copy2(source / f, edir / f)
    asset = Path(__file__).parent / "assets" / "ort_llm_model.py"
    shutil.copy2(asset, mdir / "1" / "model.py")
    meta_cfg = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else {}
    max_seq = int(config.max_seq_len or meta_cfg.get("max_position_embeddings") or 4096)
    max_active = config.max_active or (0 if config.kv_budget else 8)  # 0: the KV budget decides
    params = {"engine_dir": "engine", "max_active": str(max_active), "kv_budget": config.kv_budget,
              "max_seq_len": str(max_seq),
              "max_input_len": str(min(config.max_input_len or max_seq, max_seq)),
              "intra_op_threads": str(engine_threads(engine, config.threads) or 0),
              "providers": "CUDAExecutionProvider,CPUExecutionProvider" if config.device == "gpu" else "CPUExecutionProvider",
              # as `harp-trt generate` tokenizes: BOS first where the model's tokenizer adds one, nothing else
              "add_special_tokens": "true" if folder_adds_bos(source) else "false",
              "eos_token_ids": ",".join(map(str, _eos_ids(source)))}
    cfg = {
        "name": name, "backend": "python", "max_batch_size": 0,
        "model_transaction_policy": {"decoupled": True},
        "input": LLM_INPUTS, "output": LLM_OUTPUTS,
        "instance_group": [{"count": 1, "kind": Enum("KIND_GPU" if config.device == "gpu" else "KIND_CPU")}],
        "parameters": [{"key": k, "value": {"string_value": v}} for k, v in params.items()],
    }
    (mdir / "config.pbtxt").write_text(render_pbtxt(cfg, header + [
        "Text in, text out (Triton vLLM-backend I/O); generation, KV cache and continuous batching run",
        "inside this model (1/model.py, harp_trt.serving). Needs harp-trt, onnxruntime and transformers",
        "in the Python environment of the Python backend."]))
    return {"model": name, "serving": "python", "files": files, "placed_by": how, "tokenizer_files": tok,
            "parameters": params, "admission": admission(config, (engine or {}).get("kv") or {}, max_seq, max_active),
            "inputs": [t["name"] for t in LLM_INPUTS], "outputs": ["text_output"]}


def admission(config, kv: dict, max_seq: int, max_active: int) -> list[dict]:
    """Sequences the served model admits at once at a few prompt + max_tokens lengths, this engine
    and the dense model of the same shape (``engine.json``'s ``kv``), under a fixed ``--kv-budget``
    size; a share of free memory is resolved by the server at load (its log says)."""
    from harp_trt.memory import kv_budget_bytes, memory_share, sequences_admitted

    per, dense = int(kv.get("bytes_per_token") or 0), int(kv.get("dense_bytes_per_token") or 0)
    fixed = config.kv_budget and memory_share(config.kv_budget) is None
    budget = kv_budget_bytes(config.kv_budget) if fixed else None
    rows = []
    for tokens in sorted({t for t in (1024 + 128, 4096 + 1024, max_seq) if t <= max_seq}):
        row = {"tokens": tokens, "max_active": max_active or None}
        for key, b in (("admits", per), ("dense_admits", dense)):
            row[key] = sequences_admitted(tokens, b, budget if b else None, max_active or None)
        rows.append(row)
    return rows
