"""``OrtCausalLM``: run an exported (dense, HARP-rewritten or ORT-built) causal LM graph in ONNX
Runtime with a KV cache, from numpy.

The graph follows ``harp_trt.export.export``'s I/O contract. The KV layers are discovered from
the session's inputs (``past_key_values.{i}.key``), so a HARP graph whose pruned layers lost their
KV I/O just works and the cache is allocated for kept layers only. Generation supports batches
with left padding (``attention_mask`` 0 on the left), greedy or sampled (temperature, top-k,
top-p, seeded), stop tokens and a per-step streamer callback. CUDA is used when onnxruntime-gpu
is installed, otherwise the CPU provider.

Decode on an engine whose every KV layer runs ``com.microsoft::GroupQueryAttention`` uses a
``StaticCache``: KV buffers of fixed capacity bound (IO binding) as both the past input and the
present output, so GQA appends the new token's K/V in place (ORT's past/present buffer sharing)
instead of copying the whole cache into a new present tensor every step. Same logits (the kernel
reads the same values); at a 512-token context on SmolLM2-135M int4 it is ~1.35x faster per step."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .errors import ConfigError, GraphError
from .extras import require
from .kvcache import kv_cache_bytes
from .decoding import Past, StaticCache, sample_next
from .engine_spec import engine_model, engine_threads, is_engine
from .onnx_io import (EXPORT_META_KEY, LOGITS_KEEP_NONE, LOGITS_TO_KEEP, LOGITS_TO_KEEP_META_KEY,
                      kv_layers_of_names, past_name, present_name)

__all__ = ["OrtCausalLM", "StaticCache", "default_providers", "sample_next"]

log = logging.getLogger(__name__)

STAGE = "ort"
_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": np.float32}


_KEEP_ALL, _KEEP_LAST, _KEEP_NONE = (np.array([k], np.int64) for k in (0, 1, LOGITS_KEEP_NONE))
# prompt tokens per call of a chunked prefill (``OrtCausalLM.prefill``): SmolLM2-135M, 2048 tokens,
# 2 threads: 256 beat 64, 128, 512, 1024 and the whole prompt (bench/prefill_profile.py)
PREFILL_CHUNK = 256


def default_providers() -> list[str]:
    """CUDA (then CPU as fallback) when onnxruntime-gpu is installed, else CPU."""
    ort = require("onnxruntime", "ONNX Runtime sessions need it")

    avail = ort.get_available_providers()
    return (["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in avail
            else ["CPUExecutionProvider"])


class OrtCausalLM:
    """An ONNX causal LM with KV cache. ``onnx_path``: a ``model.onnx`` or an engine folder holding
    ``engine.json``. ``intra_op_threads``: ORT's intra-op pool size (None: ORT's default)."""

    def __init__(self, onnx_path: str | Path, providers: Sequence[str] | None = None,
                 intra_op_threads: int | None = None, graph_optimization_level: str = "all",
                 session_config: dict[str, str] | None = None, kv_hint: tuple[int, int, int] | None = None,
                 profile_prefix: str | None = None):
        ort = require("onnxruntime", "ONNX Runtime sessions need it")
        path = Path(onnx_path)
        if path.is_dir():
            path = engine_model(path, _read_engine_json(path) if is_engine(path) else {})
        if not path.is_file():
            raise GraphError(STAGE, f"no ONNX model at {path}",
                             "pass a model.onnx or an engine folder (harp-trt build / rewrite output)")
        levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
                  "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        if graph_optimization_level not in levels:
            raise ConfigError(f"unknown graph_optimization_level {graph_optimization_level!r}; "
                              f"valid: {', '.join(levels)}")
        if intra_op_threads is not None and intra_op_threads < 0:
            raise ConfigError(f"intra_op_threads must be >= 0, got {intra_op_threads}")
        so = _session_options(ort, levels[graph_optimization_level], intra_op_threads, session_config, profile_prefix)
        self.path = path
        self.providers = list(providers) if providers else default_providers()
        try:
            self.session = ort.InferenceSession(str(path), so, providers=self.providers)
        except Exception as e:  # ORT raises InvalidProtobuf, Fail, NoSuchFile... as distinct types
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise GraphError(STAGE, f"ONNX Runtime cannot load {path}: {msg}",
                             "the file (or its .data) may be truncated; rebuild it") from None
        self.intra_op_threads = intra_op_threads
        ins = {i.name: i for i in self.session.get_inputs()}
        outs = [o.name for o in self.session.get_outputs()]
        missing = [n for n in ("input_ids", "attention_mask") if n not in ins]
        if missing or "logits" not in outs:
            raise GraphError(STAGE, f"{path.name} does not follow the causal-LM I/O contract "
                             f"(missing {', '.join(missing + ([] if 'logits' in outs else ['logits']))})",
                             "export it with harp_trt.export.export.export_dense")
        self.kv_layers: list[int] = kv_layers_of_names(ins)
        for i in self.kv_layers:
            for name in (past_name(i, "value"), present_name(i, "key"), present_name(i, "value")):
                if name not in ins and name not in outs:
                    raise GraphError(STAGE, f"{path.name} has {past_name(i, 'key')} but no {name}")
        # graphs other exporters wrote may take no position_ids (onnxruntime-genai's GQA reads
        # positions from attention_mask, as if right-padded): fed only where the graph takes it
        self.takes_positions = "position_ids" in ins
        # the ORT build's logits_to_keep input (builders/ort/logits_to_keep.py): graphs without it
        # (exports, rewrites, engines built before it) compute every position's logits, sliced here
        self.takes_logits_to_keep = LOGITS_TO_KEEP in ins
        custom = dict(self.session.get_modelmeta().custom_metadata_map)
        # and those built since it keep no row at LOGITS_KEEP_NONE: a chunked prefill's non-final chunks
        self.keeps_none = self.takes_logits_to_keep and LOGITS_TO_KEEP_META_KEY in custom
        meta = _export_meta(custom)
        hint = kv_hint or (None, None, None)  # (kv_heads, head_dim, vocab) for symbolic dims
        if not meta and hint[0]:
            meta = {"kv_heads": hint[0], "head_dim": hint[1], "vocab_size": hint[2]}
        self.num_layers: int = int(meta.get("num_layers") or (max(self.kv_layers) + 1 if self.kv_layers else 0))
        self.kv_heads, self.head_dim, self.kv_dtype = self._kv_layout(ins, meta)
        self.vocab_size = _static(self.session.get_outputs()[outs.index("logits")].shape, 2) or meta.get("vocab_size")
        self._output_names = outs
        self._rowwise = False  # set when the kernel (GQA on CPU) refuses batch>1 chunks with a past
        self.static_cache_enabled = True  # decode through a StaticCache where the graph allows it
        # a multi-token call (a prefill) hands its arena memory back when it ends (ORT's
        # memory.enable_memory_arena_shrinkage): else each session keeps its longest prefill's
        # buffers (an 8192-token SmolLM2 prefill: 1.6 GB of logits alone) for its lifetime
        self.shrink_after_prefill = False
        self._shrink = ort.RunOptions()
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._gqa_kv: bool | None = None
        # prompt tokens per graph call of a batch-1 prefill through a StaticCache (0: the whole
        # prompt in one call); see ``prefill``
        self.prefill_chunk = PREFILL_CHUNK
        log.info("loaded %s: KV for %d of %d layers, providers %s", path, len(self.kv_layers),
                 self.num_layers, self.session.get_providers())

    @classmethod
    def from_engine(cls, folder: str | Path, providers: Sequence[str] | None = None,
                    intra_op_threads: int | None = None, profile_prefix: str | None = None) -> "OrtCausalLM":
        """Open an engine folder built by ``harp_trt.builders.ort``; ``intra_op_threads`` as
        ``harp_trt.engine_spec.engine_threads`` reads it (0 or None: the engine's recorded count)."""
        folder = Path(folder)
        spec = _read_engine_json(folder)
        threads = engine_threads(spec, intra_op_threads)
        return cls(engine_model(folder, spec), providers=providers, intra_op_threads=threads,
                   profile_prefix=profile_prefix)

    # -- layout ---------------------------------------------------------------------------------
    def _kv_layout(self, ins, meta) -> tuple[int, int, type]:
        if not self.kv_layers:
            return int(meta.get("kv_heads") or 0), int(meta.get("head_dim") or 0), np.float32
        arg = ins[past_name(self.kv_layers[0], "key")]
        heads = _static(arg.shape, 1) or meta.get("kv_heads")
        hd = _static(arg.shape, 3) or meta.get("head_dim")
        if not heads or not hd:
            raise GraphError(STAGE, "cannot tell kv_heads/head_dim: past_key_values dims 1 and 3 are "
                             "symbolic and the graph has no harp_trt.export metadata",
                             "pass kv_hint=(kv_heads, head_dim, vocab) from the model's config")
        return int(heads), int(hd), _NP_DTYPES.get(arg.type, np.float32)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one sequence occupies (kept layers only, K and V)."""
        itemsize = np.dtype(self.kv_dtype).itemsize
        return kv_cache_bytes(self.kv_heads, self.head_dim, itemsize, layers=len(self.kv_layers))

    def empty_past(self, batch: int) -> Past:
        z = np.zeros((batch, self.kv_heads, 0, self.head_dim), self.kv_dtype)
        return {i: (z, z) for i in self.kv_layers}

    # -- one step -------------------------------------------------------------------------------
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: Past | None = None, logits_to_keep: int = 0) -> tuple[np.ndarray, Past]:
        """One graph call. Shapes: ids/positions [B, S], mask [B, P+S], past {layer: (k, v)} with
        [B, kv_heads, P, head_dim] (None: empty). Returns (logits [B, S, V], present); with
        ``logits_to_keep`` k > 0, the last k positions' logits [B, k, V] only (transformers' argument:
        the graph's LM head runs over those rows where the engine takes the input)."""
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        attention_mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        position_ids = np.ascontiguousarray(position_ids, dtype=np.int64)
        b, s = input_ids.shape
        past = self.empty_past(b) if past is None else past
        p = next(iter(past.values()))[0].shape[2] if past else attention_mask.shape[1] - s
        if attention_mask.shape != (b, p + s) or position_ids.shape != (b, s):
            raise ConfigError(f"shape mismatch: input_ids {input_ids.shape}, attention_mask "
                              f"{attention_mask.shape} (want {(b, p + s)}), position_ids {position_ids.shape}")
        if set(past) != set(self.kv_layers):
            raise ConfigError(f"past has layers {sorted(past)}, the graph wants {self.kv_layers}")
        if logits_to_keep < 0:
            raise ConfigError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        if self._rowwise and b > 1 and s > 1 and p > 0:
            return self._forward_rows(input_ids, attention_mask, position_ids, past, logits_to_keep)
        feed = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.takes_positions:
            feed["position_ids"] = position_ids
        if self.takes_logits_to_keep:
            feed[LOGITS_TO_KEEP] = np.array([logits_to_keep], np.int64)
        for i, (k, v) in past.items():
            feed[past_name(i, "key")] = k
            feed[past_name(i, "value")] = v
        try:
            shrink = self._shrink if self.shrink_after_prefill and s > 1 else None
            outs = self.session.run(self._output_names, feed, shrink)
        except Exception as e:
            if b > 1 and s > 1 and p > 0 and "batch_size must be 1" in str(e):
                # ORT's CPU GroupQueryAttention takes multi-token chunks after a past only for batch 1
                self._rowwise = True
                return self._forward_rows(input_ids, attention_mask, position_ids, past, logits_to_keep)
            raise
        res = dict(zip(self._output_names, outs))
        present = {i: (res[present_name(i, "key")], res[present_name(i, "value")]) for i in self.kv_layers}
        logits = res["logits"]
        if logits_to_keep and logits.shape[1] > logits_to_keep:  # an engine without the input
            logits = logits[:, -logits_to_keep:]
        return logits, present

    def _forward_rows(self, ids, mask, pos, past, logits_to_keep=0):
        parts = [self.forward(ids[r:r + 1], mask[r:r + 1], pos[r:r + 1],
                              {i: (k[r:r + 1], v[r:r + 1]) for i, (k, v) in past.items()}, logits_to_keep)
                 for r in range(ids.shape[0])]
        logits = np.concatenate([p[0] for p in parts])
        present = {i: (np.concatenate([p[1][i][0] for p in parts]), np.concatenate([p[1][i][1] for p in parts]))
                   for i in self.kv_layers}
        return logits, present

    # -- in-place KV cache ----------------------------------------------------------------------
    @property
    def shares_kv_buffer(self) -> bool:
        """True when every KV layer's present output comes from a GroupQueryAttention node (which
        can append in place) and the session runs on the CPU provider (buffers are host memory)."""
        if self._gqa_kv is None:
            import onnx

            ok = bool(self.kv_layers) and self.session.get_providers()[0] == "CPUExecutionProvider"
            if ok:
                g = onnx.load(str(self.path), load_external_data=False).graph
                producer = {o: n for n in g.node for o in n.output}
                ok = all((n := producer.get(present_name(i, kv))) is not None and n.op_type == "GroupQueryAttention"
                         and n.domain == "com.microsoft" for i in self.kv_layers for kv in ("key", "value"))
            self._gqa_kv = ok
        return self._gqa_kv and self.static_cache_enabled

    def static_cache(self, past: Past, capacity: int) -> "StaticCache":
        """A ``StaticCache`` holding ``past`` (from ``forward``) with room for ``capacity`` tokens."""
        if not self.shares_kv_buffer:
            raise ConfigError(f"{self.path.name}: a static KV cache needs GroupQueryAttention on every KV layer "
                              "and the CPU provider", "use forward() with a growing past instead")
        return StaticCache(self, past, capacity)

    def decode_step(self, cache: "StaticCache", input_ids: np.ndarray, attention_mask: np.ndarray,
                    position_ids: np.ndarray) -> np.ndarray:
        """One token per row through ``cache`` (appended in place); returns logits [B, 1, V].
        ``attention_mask`` covers the cached tokens plus this one: [B, cache.length + 1]."""
        b = input_ids.shape[0]
        if input_ids.shape != (b, 1) or attention_mask.shape != (b, cache.length + 1):
            raise ConfigError(f"decode_step takes input_ids [B, 1] and attention_mask [B, {cache.length + 1}], "
                              f"got {input_ids.shape} and {attention_mask.shape}")
        cache.reserve(cache.length + 1)
        logits = self.bind_step(cache.binding, input_ids, attention_mask, position_ids)
        cache.length += 1
        return logits

    def bind_step(self, bind, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """One call through an IO binding whose KV buffers are bound as both past and present
        (``StaticCache``, ``BatchKV``): the token inputs bound, every position's logits returned."""
        bind.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        bind.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        if self.takes_positions:
            bind.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        if self.takes_logits_to_keep:
            bind.bind_cpu_input(LOGITS_TO_KEEP, _KEEP_ALL)
        bind.bind_output("logits", "cpu")
        self.session.run_with_iobinding(bind)
        return bind.get_outputs()[-1].numpy()  # logits is bound last

    def prefill(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                capacity: int) -> tuple[np.ndarray, "StaticCache | Past"]:
        """A generator's prefill: the last position's logits [B, 1, V] and the cache to decode from
        (a ``StaticCache`` with room for ``capacity`` tokens where the engine shares KV buffers, else
        a ``forward``-style past). All of ``prefill_chunks`` at once."""
        for out in self.prefill_chunks(input_ids, attention_mask, position_ids, capacity):
            pass
        return out

    def prefill_chunks(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                       capacity: int) -> Iterator["tuple[np.ndarray, StaticCache | Past] | None"]:
        """``prefill`` one graph call at a time: yields None after every call but the last, then
        ``(logits, cache)``. A server runs decode steps of other sequences between the calls
        (chunked prefill: a long prompt then stalls them one chunk, not its whole prefill).

        Batch 1 on a shared-buffer engine runs in chunks of ``prefill_chunk`` tokens straight into the
        static cache: each call's GroupQueryAttention scores its chunk against the keys so far, so
        the S x S score matrix ORT's CPU kernel fills per head (the upper triangle computed, then
        masked) shrinks to about S^2/2 + S*chunk/2 entries in chunk-row slices, and the padding bias
        to [1, 1, chunk, S]. Same numbers per row: each position attends to the same keys
        (tests/test_ort_prefill.py). Batches go in one call (ORT's CPU kernel takes a multi-token
        chunk after a past only for batch 1)."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        pos = np.ascontiguousarray(position_ids, dtype=np.int64)
        b, s = ids.shape
        if mask.shape != (b, s) or pos.shape != (b, s):
            raise ConfigError(f"prefill takes input_ids, attention_mask and position_ids of one shape [B, S], got "
                              f"{ids.shape}, {mask.shape}, {pos.shape}")
        chunk = self.prefill_chunk
        if not (b == 1 and self.shares_kv_buffer and 0 < chunk < s):
            logits, past = self.forward(ids, mask, pos, None, logits_to_keep=1)
            yield logits, (self.static_cache(past, capacity) if self.shares_kv_buffer else past)
            return
        cache = StaticCache(self, self.empty_past(1), max(capacity, s))
        bind = cache.binding
        for start in range(0, s, chunk):
            end = min(s, start + chunk)
            if self.takes_logits_to_keep:   # the LM head for the last chunk's last row only
                bind.bind_cpu_input(LOGITS_TO_KEEP, _KEEP_LAST if end == s or not self.keeps_none else _KEEP_NONE)
            bind.bind_cpu_input("input_ids", ids[:, start:end].copy())
            bind.bind_cpu_input("attention_mask", mask[:, :end].copy())
            if self.takes_positions:
                bind.bind_cpu_input("position_ids", pos[:, start:end].copy())
            bind.bind_output("logits", "cpu")
            self.session.run_with_iobinding(bind)
            cache.length = end
            if end < s:
                yield None
        logits = bind.get_outputs()[-1].numpy()
        yield logits[:, -1:], cache

    # -- generation -----------------------------------------------------------------------------
    def generate(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
                 max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stop_token_ids: Iterable[int] | None = None, pad_token_id: int = 0,
                 streamer: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Prefill then decode ``max_new_tokens`` tokens; returns [B, S + n] (prompt + new tokens,
        n <= max_new_tokens). Left padding is read from ``attention_mask``. Rows that emitted a stop
        token continue with ``pad_token_id`` until every row has stopped. ``streamer(tokens[B])``
        is called once per step."""
        ids = np.atleast_2d(np.asarray(input_ids, dtype=np.int64))
        mask = (np.ones_like(ids) if attention_mask is None
                else np.atleast_2d(np.asarray(attention_mask, dtype=np.int64)))
        if mask.shape != ids.shape:
            raise ConfigError(f"attention_mask {mask.shape} must match input_ids {ids.shape}")
        if ids.shape[1] == 0:
            raise ConfigError("empty prompt: generate needs at least one token")
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if do_sample and not temperature > 0:
            raise ConfigError(f"temperature must be > 0 when sampling, got {temperature}")
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {top_p}")
        if (mask.sum(1) == 0).any():
            raise ConfigError("a row of attention_mask is all zeros (empty prompt in the batch)")
        rng = np.random.default_rng(seed)
        stops = np.array(sorted(set(stop_token_ids or ())), dtype=np.int64)
        b = ids.shape[0]
        pos = np.cumsum(mask, axis=1) - 1
        pos[mask == 0] = 1  # HF's convention for padded positions (they are masked anyway)
        out = [ids]
        if max_new_tokens == 0:
            return ids
        logits, cache = self.prefill(ids, mask, pos, mask.shape[1] + max_new_tokens)
        past = None if isinstance(cache, StaticCache) else cache
        cache = cache if isinstance(cache, StaticCache) else None
        next_pos = pos[:, -1:] + 1
        done = np.zeros(b, dtype=bool)
        for step in range(max_new_tokens):
            tok = sample_next(logits[:, -1, :], do_sample, temperature, top_k, top_p, rng)
            tok = np.where(done, pad_token_id, tok)
            out.append(tok[:, None])
            if streamer is not None:
                streamer(tok)
            if stops.size:
                done |= np.isin(tok, stops)
            if done.all() or step == max_new_tokens - 1:
                break
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
            if cache is not None:
                logits = self.decode_step(cache, tok[:, None], mask, next_pos)
            else:
                logits, past = self.forward(tok[:, None], mask, next_pos, past)
            next_pos = next_pos + 1
        return np.concatenate(out, axis=1)

    def timed_generate(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
                       **kwargs) -> tuple[np.ndarray, dict[str, float]]:
        """``generate`` plus figures: prefill seconds, decode seconds, new tokens, tokens/s."""
        marks: list[float] = []
        user = kwargs.pop("streamer", None)

        def tick(tok):
            marks.append(time.perf_counter())
            if user is not None:
                user(tok)

        t0 = time.perf_counter()
        seq = self.generate(input_ids, attention_mask, streamer=tick, **kwargs)
        t1 = time.perf_counter()
        n = seq.shape[1] - np.atleast_2d(input_ids).shape[1]
        prefill = (marks[0] - t0) if marks else t1 - t0
        decode = (t1 - marks[0]) if marks else 0.0
        return seq, {"prefill_s": prefill, "decode_s": decode, "seconds": t1 - t0, "new_tokens": int(n),
                     "tokens_per_s": (n / (t1 - t0)) if t1 > t0 else 0.0}


def _session_options(ort, level, intra_op_threads, session_config, profile_prefix):
    """Sequential, one inter-op thread, ``intra_op_threads`` (None: ORT's default), the config entries
    and ORT's profiler where ``profile_prefix`` is given."""
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    if intra_op_threads:
        so.intra_op_num_threads = int(intra_op_threads)
    so.log_severity_level = 3
    for k, v in (session_config or {}).items():  # e.g. session.disable_prepacking: no packed weight copies
        so.add_session_config_entry(k, v)
    if profile_prefix:  # ORT's profiler: session.end_profiling() writes the JSON (bench/prefill_profile.py)
        so.enable_profiling, so.profile_file_prefix = True, profile_prefix
    return so


def _static(shape, dim: int) -> int | None:
    try:
        v = shape[dim]
    except (IndexError, TypeError):
        return None
    return int(v) if isinstance(v, int) else None


def _export_meta(custom: dict[str, str]) -> dict:
    try:
        return json.loads(custom.get(EXPORT_META_KEY) or "{}")
    except ValueError:
        return {}


def _read_engine_json(folder: Path) -> dict:
    from .engine_spec import ENGINE_JSON, read_engine_spec

    if not is_engine(folder):
        raise GraphError(STAGE, f"{folder} has no {ENGINE_JSON}", "build one with `harp-trt build` (harp_trt.builders.ort)")
    try:
        return read_engine_spec(folder)
    except ValueError as e:
        raise GraphError(STAGE, str(e), "rebuild the engine") from None
