"""Launch files for a TensorRT-LLM artifact, and the KV memory the 1.2 runtime really gives each
pool (``docs/trtllm-contract.md``, rows kv-*).

Two runtimes, each fed from its own files:

* **engine** (TensorRT backend, ``TRTLLM_VERSION`` 1.2.1: the 1.2 line is the last with ``trtllm-build``):
  ``build_engine.sh`` then ``serve_engine.sh`` (``trtllm-serve <engine> --backend tensorrt``) with
  ``engine_llm_api_options.yaml``; the Triton tensorrtllm model gets the same values.
* both take the tokenizer from the artifact's ``tokenizer/`` (``TOKENIZER_DIR``).
* **pytorch** (TensorRT-LLM's PyTorch backend, where users are going): ``serve_pytorch.sh``
  (``trtllm-serve hf/ --backend pytorch --trust_remote_code``) with ``pytorch_llm_api_options.yaml``,
  Llama / Mistral only (the heterogeneous NemotronNAS model: ``_torch/models/modeling_nemotron_nas.py``
  gives pruned layers 0 KV heads, so ``KVCacheManager`` allocates nothing for them).

Window-1 checkpoints (Qwen2, Gemma2 on the engine route) need two things at run time:
1. our ``max_attention_window`` list. A user list replaces the engine default entirely
   (``KvCacheConfig::fillEmptyFieldsFromRuntimeDefaults`` fills only empty fields), and without it a
   zero-Q/K layer averages V over the whole prefix: every launch file carries the list.
2. memory shares per window size. ``BaseKVCacheManager::calculateMaxNumBlocks`` gives every distinct
   window an *equal* share of the KV pool unless ``TRTLLM_WINDOW_SIZE_SHARES`` (comma-separated,
   ascending window order, normalised) says otherwise; windowed layers also hold the whole prompt
   while it is prefilled (``KVCacheManager::addSequence``) and free blocks only as generation goes
   (``WindowBlockManager::adjustBlocksIfNeeded``). ``window_shares`` sizes each pool for
   ``max_batch_size`` sequences: full-attention layers for ``max_seq_len`` tokens each, windowed
   layers for ``window + 2 blocks`` each plus one step's worth of prefill (``max_num_tokens``)."""
from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

import torch

from harp_trt.dims import ModelDims
from harp_trt.kvcache import kv_cache_bytes

from .checkpoint import DTYPES, LayerKinds
from .config import TRTLLM_VERSION

__all__ = ["window_shares", "kv_runtime", "write_launch_files", "SHARES_ENV", "TOKENIZER_DIR"]

SHARES_ENV = "TRTLLM_WINDOW_SIZE_SHARES"
# Every artifact carries its tokenizer here (the stage writes it for every family and route): the
# engine folder trtllm-build writes holds none, and hf/ exists only on the DeciLM route.
TOKENIZER_DIR = "tokenizer"


def _pool_tokens(window: int, cfg) -> int:
    """Tokens one windowed layer must hold across ``max_batch_size`` sequences (see the docstring)."""
    if window >= cfg.max_seq_len:
        return cfg.max_batch_size * cfg.max_seq_len
    per_seq = min(cfg.max_seq_len, window + 2 * cfg.tokens_per_block)
    return min(cfg.max_batch_size * cfg.max_seq_len, cfg.max_batch_size * per_seq + cfg.max_num_tokens)


def window_shares(lk: LayerKinds, cfg) -> dict[int, float] | None:
    """``{window: share}`` in ascending window order, or None when one window size fits all."""
    windows = lk.window_list()
    if windows is None or len(set(windows)) == 1:
        return None
    layers_per_window: dict[int, int] = {}
    for w in windows:  # one entry per attention layer
        layers_per_window[w] = layers_per_window.get(w, 0) + 1
    need = {w: n * _pool_tokens(w, cfg) for w, n in sorted(layers_per_window.items())}
    total = sum(need.values())
    return {w: round(v / total, 6) for w, v in need.items()}


def kv_runtime(lk: LayerKinds, dims: ModelDims, cfg) -> dict[str, Any]:
    """KV bytes per token of capacity as the runtime allocates them: the pool of the
    full-attention layers bounds how many tokens fit; with shares, that pool gets ``share`` of
    the memory, so each token of capacity costs ``bytes_per_token(full layers) / share``."""
    esize = torch.finfo(DTYPES[cfg.dtype]).bits // 8
    per_layer = kv_cache_bytes(dims.kv_heads, dims.head_dim, esize)
    shares = window_shares(lk, cfg)
    full_layers = sum(1 for k, w in zip(lk.kinds, lk.windows)
                      if k in ("attention", "window1") and (w is None or w >= cfg.max_seq_len))
    share_full = shares[max(shares)] if shares else 1.0
    native_full = sum(1 for w in lk.native if w is None or w >= cfg.max_seq_len)
    out = {"kv_bytes_per_token_capacity": math.ceil(full_layers * per_layer / share_full),
           "kv_bytes_per_token_capacity_unpruned": native_full * per_layer,
           "window_size_shares": ({str(w): s for w, s in shares.items()} if shares else None),
           "shares_env": (f"{SHARES_ENV}={','.join(repr(s) for s in shares.values())}" if shares else None)}
    if shares:
        out["note"] = (f"{SHARES_ENV} must be set when the engine runs (every launch file here sets it); without "
                       f"it each of the {len(shares)} window sizes gets 1/{len(shares)} of the KV memory")
    return out


def _yaml(windows: list[int] | None, cfg, extra: dict[str, Any] | None = None) -> str:
    lines = ["# trtllm-serve --extra_llm_api_options / LLM(**yaml): written by harp-trt",
             f"max_batch_size: {cfg.max_batch_size}", f"max_num_tokens: {cfg.max_num_tokens}",
             f"max_seq_len: {cfg.max_seq_len}", "kv_cache_config:",
             "  free_gpu_memory_fraction: 0.9", "  enable_block_reuse: false"]
    if windows is not None:
        lines.insert(1, "# HARP: pruned layers attend over one token; this list must reach the runtime (a user list "
                        "replaces it)")
        lines.append(f"  max_attention_window: [{', '.join(map(str, windows))}]")
    for k, v in (extra or {}).items():
        lines.append(f"{k}: {str(v).lower() if isinstance(v, bool) else v}")
    return "\n".join(lines) + "\n"


def _script(cmd: list[str], env: dict[str, str], usage: str) -> str:
    q = [a if a.startswith('"') else shlex.quote(a) for a in cmd]
    parts, i = [" ".join(q[:2])], 2  # the command and its positional argument
    while i < len(q):
        pair = q[i + 1] if i + 1 < len(q) and not q[i + 1].startswith("-") else None
        parts.append(f"{q[i]} {pair}" if pair else q[i])
        i += 2 if pair else 1
    body = " \\\n    ".join(parts)
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    return ("#!/usr/bin/env bash\n# Generated by harp-trt. " + usage + "\nset -euo pipefail\n"
            'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n' + exports + body + ' "$@"\n')


def write_launch_files(out: Path, cfg, lk: LayerKinds, dims: ModelDims, hf: dict[str, Any]) -> dict[str, Any]:
    """Write the run-time launch files of both runtimes; returns what was written and why not."""
    windows = lk.window_list()
    kv = kv_runtime(lk, dims, cfg)
    env = {SHARES_ENV: kv["shares_env"].split("=", 1)[1]} if kv["shares_env"] else {}
    par = ["--tp_size", str(cfg.tp_size), "--pp_size", str(cfg.pp_size)]
    files = {}
    (out / "engine_llm_api_options.yaml").write_text(_yaml(windows, cfg))
    serve = ["trtllm-serve", '"${ENGINE:-$HERE/engine}"', "--backend", "tensorrt", "--tokenizer",
             f'"${{TOKENIZER:-$HERE/{TOKENIZER_DIR}}}"', *par,
             "--extra_llm_api_options", '"$HERE/engine_llm_api_options.yaml"']
    (out / "serve_engine.sh").write_text(_script(serve, env, "Serve the engine built by build_engine.sh "
                                                 f"(TensorRT-LLM {TRTLLM_VERSION}, OpenAI-compatible HTTP on :8000)."))
    files["engine"] = ["build_engine.sh", "serve_engine.sh", "engine_llm_api_options.yaml", f"{TOKENIZER_DIR}/"]
    hf_written = bool(hf.get("written"))
    if hf_written:
        (out / "pytorch_llm_api_options.yaml").write_text(_yaml(None, cfg, {"trust_remote_code": True}))
        serve = ["trtllm-serve", '"$HERE/hf"', "--backend", "pytorch", "--tokenizer", f'"$HERE/{TOKENIZER_DIR}"', *par,
                 "--trust_remote_code", "--extra_llm_api_options", '"$HERE/pytorch_llm_api_options.yaml"']
        (out / "serve_pytorch.sh").write_text(_script(serve, {}, f"Serve hf/ with TensorRT-LLM {TRTLLM_VERSION}'s "
                                                      "PyTorch backend (NemotronNAS: no KV cache for pruned layers)."))
        files["pytorch"] = ["serve_pytorch.sh", "pytorch_llm_api_options.yaml", "hf/"]
    for f in ("serve_engine.sh", "serve_pytorch.sh"):
        if (out / f).exists():
            (out / f).chmod(0o755)
    return {"files": files, "kv_runtime": kv, "window_list": windows, "tokenizer": TOKENIZER_DIR,
            "pytorch_backend": ({"available": True} if hf_written else {"available": False, "reason": hf.get("reason")})}
