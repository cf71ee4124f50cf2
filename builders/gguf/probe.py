"""llama.cpp at run time for the GGUF deploy stage: logits of a token sequence, greedy tokens,
tokenization, the KV cache llama.cpp allocates, quantization with llama.cpp's own quantizer, and the
version. Loading, contexts, decode and the log go through ``harp_trt.llamacpp_runtime`` (shared with
the bench's llama.cpp engine); everything here runs the real library on a GGUF file.

KV bytes are llama.cpp's own accounting, the line the ``llama_kv_cache`` constructor logs
(``src/llama-kv-cache.cpp``, read by ``harp_trt.llamacpp_runtime.KvAllocation``). The log prints
MiB to two decimals (an error of up to 5243 bytes on the total), so with ``cells = 16384`` the bytes
per cell are exact after rounding (error <= 0.32 byte)."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from harp_trt.llamacpp_runtime import LlamaContext, LlamaModel, captured_log, import_llama_cpp, llama_cpp_version

__all__ = ["llama_cpp_version", "logits", "greedy", "tokenize", "kv_cache", "quantize", "KV_CELLS"]

log = logging.getLogger(__name__)
STAGE = "gguf"
KV_CELLS = 16384  # see the module docstring: exact bytes per cell from a two-decimal MiB figure


def _threads(threads: int | None) -> int:
    """llama.cpp threads: ``threads``, default 1. The checks here are correctness checks, not timings;
    on a shared machine llama.cpp's spinning worker threads make a 2-thread decode up to 10x slower
    than a 1-thread one (SmolLM2 f32, 2 cores at load 8: 0.1 s vs 0.5-10 s per token)."""
    return max(1, int(threads or 1))


@contextlib.contextmanager
def _context(path: str | Path, *, n_ctx: int, n_batch: int, kv_type: str, flash_attn: bool,
             threads: int | None = None) -> Iterator[LlamaContext]:
    """One sequence's context on the GGUF at ``path`` (``n_ubatch`` = ``n_batch``: a prompt is one
    micro-batch), freed with its model after the block."""
    with LlamaModel(path, stage=STAGE) as model:
        with model.context(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, threads=_threads(threads),
                           flash_attn=flash_attn, kv_type=kv_type) as ctx:
            yield ctx


def logits(path: str | Path, tokens: Sequence[int], *, kv_type: str = "f32", flash_attn: bool = False,
           threads: int | None = None) -> np.ndarray:
    """``[len(tokens), vocab]`` logits of one forward pass over ``tokens`` (positions 0...)."""
    n = max(32, len(tokens))
    with _context(path, n_ctx=max(256, n), n_batch=n, kv_type=kv_type, flash_attn=flash_attn, threads=threads) as ctx:
        return ctx.decode(np.asarray([tokens]))[0]


def greedy(path: str | Path, prompt: Sequence[int], n_new: int, *, kv_type: str = "f32",
           flash_attn: bool = False, threads: int | None = None) -> list[int]:
    """``n_new`` greedy tokens after ``prompt``: one prefill, then one token per decode (KV cache)."""
    n = len(prompt) + n_new
    with _context(path, n_ctx=max(256, n), n_batch=max(32, len(prompt)), kv_type=kv_type, flash_attn=flash_attn,
                  threads=threads) as ctx:
        out: list[int] = []
        last = ctx.decode(np.asarray([prompt]), all_logits=False)[0, -1]
        for step in range(n_new):
            out.append(int(np.argmax(last)))
            if step + 1 < n_new:
                last = ctx.decode(np.asarray([out[-1:]]), start=len(prompt) + step, all_logits=False)[0, -1]
        return out


def tokenize(path: str | Path, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """llama.cpp's tokenization of ``text`` with the GGUF's own vocabulary (a vocab-only load;
    ``LlamaModel.tokenize``). A file llama.cpp cannot load raises ``PreconditionError``."""
    with LlamaModel(path, stage=STAGE, vocab_only=True) as model:
        return model.tokenize(text, add_special, parse_special)


def kv_cache(path: str | Path, *, flash_attn: bool, kv_type: str = "f16", cells: int = KV_CELLS) -> dict[str, Any]:
    """The KV cache llama.cpp allocates for ``cells`` tokens of one sequence, from its own log line;
    ``bytes_per_token``: K + V bytes per cell (exact, see the module docstring)."""
    with _context(path, n_ctx=cells, n_batch=32, kv_type=kv_type, flash_attn=flash_attn) as ctx:
        kv = ctx.kv
    return {"cells": kv.cells, "layers": kv.layers, "k_type": kv.k_type, "v_type": kv.v_type,
            "k_mib": kv.k_mib, "v_mib": kv.v_mib, "total_mib": kv.total_mib, "flash_attn": flash_attn,
            "bytes_per_token": int(round(kv.total_mib * 2 ** 20 / kv.cells)), "log_line": kv.line}


def quantize(src: str | Path, dst: str | Path, gguf_type: str) -> None:
    """``llama_model_quantize`` (llama.cpp's quantizer, ``src/llama-quant.cpp``) to ``gguf_type``
    (``LLAMA_FTYPE_MOSTLY_<TYPE>``)."""
    lib = import_llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    params.nthread = os.cpu_count() or 1
    with captured_log() as lines:
        rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({gguf_type}) returned {rc}: {''.join(lines)[-600:]}")
