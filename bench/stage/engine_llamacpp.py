"""The llama.cpp engine: a dense and a HARP GGUF (``builders/gguf``: llama.cpp's ``deci``
architecture, whose layers may have no KV heads) run through llama.cpp's C API
(``llama_cpp``, the llama-cpp-python bindings: ``llama_decode`` on a ``llama_batch``), with flash
attention on, in one process. Loading, contexts, batch decode and the log capture are
``harp_trt.llamacpp_runtime``'s (shared with the GGUF deploy stage's checks).

* Each engine keeps one ``llama_context`` per batch size (``n_seq_max`` = B, one KV stream per
  sequence); a prefill clears its memory (``llama_memory_clear``) and decodes the prompts as one
  batch, asking for the last position's logits (``prefill_logits = "last"``); a decode step is one
  token per sequence; ``logits`` decodes each row with every position's logits on.
* The batch-1 context has room for ``max_position_embeddings`` tokens (at most
  ``CONTEXT_CAP``) so lm-eval's long contexts fit; other batch sizes get what their prompts need
  plus ``headroom``. Past the room a context is rebuilt twice as large from the tokens so far.
* ``cache_bytes`` is llama.cpp's own account of the KV cache it allocated for the context: the line
  ``llama_kv_cache: size = X MiB (N cells, L layers, S/M seqs), K (t): .., V (t): ..`` that
  ``llama_kv_cache::llama_kv_cache`` logs (vendor/llama.cpp/src/llama-kv-cache.cpp, from
  ``size_k_bytes() + size_v_bytes()``, the ``ggml_nbytes`` of every layer's K and V tensors), read
  through a ``llama_log_set`` callback while the context is created (``KvAllocation``). It has 0.01 MiB resolution.
  ``cache_tokens`` is the cells it covers (N per stream x streams), so the bench's KV bytes per
  token are bytes per allocated cell. With flash attention a layer without KV heads adds nothing;
  without it llama.cpp pads such a layer's V to full width ([TAG_V_CACHE_VARIABLE] there), which is
  why flash attention is on.
* ``kv_dtype_bytes`` comes from the same line (f16 by default: llama.cpp's ``type_k``/``type_v``;
  ``kv_type="q8_0"`` sets both to q8_0, 34 bytes per 32 elements)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harp_trt.errors import PreconditionError
from harp_trt.llamacpp_runtime import KV_TYPE_BYTES, LlamaContext, LlamaModel, llama_cpp_version
from harp_trt.store import Artifact

from .engines import Engine, EnginePair

__all__ = ["LlamaCppEngine", "load_llamacpp_pair", "gguf_path", "drop_unquantized", "CONTEXT_CAP", "KV_TYPES"]

log = logging.getLogger(__name__)

STAGE = "bench"
GGUF_FILE = "model.gguf"
REPORT = "harp_gguf.json"   # builders/gguf's report (not imported: stages meet through artifacts)
CONTEXT_CAP = 8192   # tokens the batch-1 context holds at most (its KV is allocated up front)
KV_TYPES = ("f16", "q8_0")


@dataclass
class _State:
    context: LlamaContext
    tokens: np.ndarray   # [B, T] every token decoded so far (a rebuilt context replays them)


class LlamaCppEngine(Engine):
    backend = "llamacpp"
    prefill_logits = "last"

    def __init__(self, path: Path, variant: str, threads: int, headroom: int, max_positions: int,
                 kv_type: str = "f16", n_gpu_layers: int = 0):
        if kv_type not in KV_TYPES:
            raise PreconditionError(STAGE, f"KV cache type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        self.kv_type = kv_type
        self.path, self.variant, self.headroom = Path(path), variant, int(headroom)
        self.threads = int(threads or os.cpu_count() or 1)  # 0: every core, as ONNX Runtime's default
        self.model = LlamaModel(self.path, stage=STAGE, n_gpu_layers=n_gpu_layers,
                                hint="pass a GGUF written by `harp-trt deploy gguf` or build --backend gguf")
        self.vocab = self.model.n_vocab
        self._max = int(max_positions)
        self._contexts: dict[int, LlamaContext] = {}
        self.kv_logged_type = self._context(1, 1).kv.k_type   # the type llama.cpp reports it allocated
        self.kv_dtype_bytes = KV_TYPE_BYTES.get(self.kv_logged_type)

    @property
    def max_positions(self) -> int:
        return self._max

    # ---- contexts ------------------------------------------------------------------------------
    def _context(self, n_seq: int, need: int) -> LlamaContext:
        """The context for ``n_seq`` sequences with room for ``need`` tokens each (built or rebuilt)."""
        c = self._contexts.get(n_seq)
        if c is not None and c.cells >= need:
            return c
        if c is not None:
            c.close()
        room = max(need, min(self._max, CONTEXT_CAP) if n_seq == 1 else need + self.headroom)
        if c is not None:
            room = max(room, 2 * c.cells)
        c = self._create(n_seq, room)
        self._contexts[n_seq] = c
        return c

    def _create(self, n_seq: int, room: int) -> LlamaContext:
        """A new context of ``n_seq`` streams of ``room`` cells (a prompt batch is one ``n_batch``)."""
        n = n_seq * room
        return self.model.context(n_ctx=n, n_batch=n, n_ubatch=min(512, n), n_seq=n_seq, threads=self.threads,
                                  flash_attn=True, kv_type=self.kv_type)

    def kv_allocation(self, tokens: int) -> tuple[int, int]:
        """(KV bytes, cells) llama.cpp allocates for a one-sequence context of ``tokens`` positions,
        read from its log as the context is created; the context is freed again."""
        with self._create(1, tokens) as c:
            return c.kv.bytes, c.kv.total_cells

    def _fresh(self, tokens: np.ndarray, all_logits: bool) -> tuple[np.ndarray, _State]:
        b, s = tokens.shape
        c = self._context(b, s + (0 if all_logits else 1))
        c.clear()
        return c.decode(tokens, 0, all_logits), _State(c, tokens)

    # ---- the Engine protocol -------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits, state = self._fresh(ids.numpy().astype(np.int32), False)
        return torch.from_numpy(logits[:, -1]), state

    def written_state(self, batch: int, length: int, seed: int = 0) -> _State:
        """A state as if ``length`` tokens of ``batch`` sequences had been prefilled, the KV cache
        written with N(0, 1) f16 values through llama.cpp's own state reader
        (``LlamaContext.write_sequences``): a 7B prefill of 8192 tokens takes most of an hour on 2
        cores, and a step's cost depends on the cache's length, not on what it holds. The
        tokens a rebuilt context would replay are zeros: the context is made with room for every
        decode step the caller announced (``headroom``), so none is rebuilt."""
        c = self._context(batch, length + self.headroom)
        c.clear()
        c.write_sequences(length, np.random.default_rng(seed))
        return _State(c, np.zeros((batch, length), dtype=np.int32))

    def decode(self, token: torch.Tensor, state: _State) -> tuple[torch.Tensor, Any]:
        tok = token.numpy().astype(np.int32).reshape(-1, 1)
        c, done = state.context, state.tokens.shape[1]
        if done + 1 > c.cells:  # rebuild larger and replay the sequence so far
            self._context(c.n_seq, done + 1)
            _, state = self._fresh(state.tokens, False)
            c = state.context
        logits = c.decode(tok, done, False)
        return torch.from_numpy(logits[:, -1]), _State(c, np.concatenate([state.tokens, tok], axis=1))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids.numpy().astype(np.int32)
        return torch.from_numpy(np.concatenate([self._fresh(x[i: i + 1], True)[0] for i in range(x.shape[0])]))

    def cache_bytes(self, state: _State) -> int:
        return state.context.kv.bytes

    def cache_tokens(self, state: _State) -> int | None:
        return state.context.kv.total_cells

    def close(self) -> None:
        for c in self._contexts.values():
            c.close()
        self._contexts.clear()
        self.model.close()


def gguf_path(source: Any) -> Path:
    """The GGUF of a bench source: a ``.gguf`` file, or a folder (a gguf artifact) holding
    ``model.gguf``: its llama.cpp-quantized file where ``harp_gguf.json`` names one (what a
    ``--gguf-type`` build deploys)."""
    p = source.path if isinstance(source, Artifact) else Path(source)
    if not p.is_dir():
        return p
    report = _report(p)
    return p / (report.get("quantized_file") or report.get("file") or GGUF_FILE)


def drop_unquantized(store, art: Artifact) -> Artifact:
    """A gguf artifact holding a llama.cpp-quantized file, without its unquantized one (verified when it
    was built; ``ArtifactStore.prune`` marks the manifest first): a bench of the quantized file keeps
    4 GB of a 7B model instead of 19. Any other artifact is returned as it is."""
    quantized = _report(art.path).get("quantized_file")
    if not quantized or not (art.path / GGUF_FILE).exists():
        return art
    return store.prune(art, (GGUF_FILE,))


def _report(folder: Path) -> dict[str, Any]:
    f = folder / REPORT
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except ValueError:
        return {}


def load_llamacpp_pair(plan, source, config, kv_type: str = "f16") -> EnginePair:
    """``source``: ``{"dense": ..., "harp": ...}`` GGUF files or folders holding ``model.gguf``. The
    HARP file's layers without KV heads must be the plan's pruned layers. ``kv_type``: the KV
    cache's element type (``KV_TYPES``)."""
    from .gguf_meta import gguf_dims, gguf_tokenizer

    paths = {v: gguf_path(source[v]) for v in ("dense", "harp")}
    for v, p in paths.items():
        if not p.is_file():
            raise PreconditionError(STAGE, f"{v} GGUF {p} does not exist",
                                    "pass GGUF files (or folders with model.gguf) written by harp-trt deploy gguf")
    dims, ctx_len, _ = gguf_dims(paths["dense"])
    _, _, no_kv = gguf_dims(paths["harp"])
    if sorted(no_kv) != sorted(plan.layers):
        raise PreconditionError(STAGE, f"HARP GGUF {paths['harp']} has no KV heads in layers {sorted(no_kv)}; the "
                                f"plan prunes {list(plan.layers)}", "write the HARP GGUF from this plan")
    headroom = max(config.decode_tokens, config.greedy_tokens) + 1
    engines = {v: LlamaCppEngine(p, v, config.threads, headroom, ctx_len, kv_type) for v, p in paths.items()}
    info = {v: {"gguf": str(p), "threads": engines[v].threads, "flash_attention": True,
                "llama_cpp_python": llama_cpp_version(), "kv_type": engines[v].kv_logged_type}
            for v, p in paths.items()}
    log.info("llama.cpp engines: dense %s, harp %s", paths["dense"], paths["harp"])
    model = (_report(paths["dense"].parent).get("model") or {}).get("folder")
    return EnginePair("llamacpp", engines["dense"], engines["harp"], gguf_tokenizer(paths["dense"], model), dims,
                      plan.alpha_map, info)
