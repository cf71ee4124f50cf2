"""Running llama.cpp: the one place that imports ``llama_cpp`` (llama-cpp-python's low-level ctypes
bindings) and owns the log capture, the KV-size log line, context creation and batch decode. The
GGUF deploy stage's checks (``builders/gguf/probe.py``) and the bench's llama.cpp engine
(``bench/stage/engine_llamacpp.py``) both run GGUFs through it; it lives in the core because no
stage may import another. Everything here runs the real library, on the CPU (``n_gpu_layers`` 0).

* **Log.** One ctypes callback, set once per process with ``llama_log_set``
  (vendor/llama.cpp/src/llama-impl.cpp), replaces llama-cpp-python's, which prints every line to
  stderr: lines go to this module's logger (ERROR as a warning, the rest at debug level: llama.cpp
  warns about what this package does on purpose, such as V padding without flash attention or
  dummy tokens of a vocab-only file) and, inside ``captured_log``, to the caller.
* **KV bytes** are llama.cpp's own accounting: the ``llama_kv_cache`` constructor
  (vendor/llama.cpp/src/llama-kv-cache.cpp, ``llama_kv_cache::llama_kv_cache``) logs
  ``size = X MiB (N cells, L layers, S/M seqs), K (t): a MiB, V (t): b MiB`` from
  ``size_k_bytes() + size_v_bytes()``, the ``ggml_nbytes`` of every layer's K and V tensors, where
  N is the cells per stream and M the streams. A context is refused where that line is missing
  (``KvAllocation``). MiB to two decimals: up to 5243 bytes off the total.
* **Decode** is one ``llama_batch`` of B sequences x n tokens (row b is sequence b), read back with
  ``llama_get_logits`` (vendor/llama.cpp/src/llama-context.cpp: ``llama_context::get_logits``
  reorders the outputs to batch order first).
* **Written KV** (``LlamaContext.write_sequences``): a sequence's cache of N cells written with random
  f16 values through ``llama_state_seq_set_data``, so a long-context decode step can be timed without
  a prefill of N tokens (a step's cost depends on the cache's length, not its values). The bytes
  follow ``llama_context::state_seq_get_data`` (vendor/llama.cpp/src/llama-context.cpp: a magic and the
  sequence id) and ``llama_kv_cache::state_write`` (src/llama-kv-cache.cpp): n_stream, then per
  stream its cell count, each cell's (pos, n_seq_id = 1, seq_id), then every layer's K rows and V rows
  (each: type, row size, the rows). The layout is read from llama.cpp's own state of one decoded
  token of the same sequence (``state_layout``), N cells are written in it, and llama.cpp's reader
  (``state_read``) checks the count, types and sizes as it loads them (0 bytes read: refused)."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import PreconditionError
from .extras import require

__all__ = ["import_llama_cpp", "llama_cpp_version", "captured_log", "KV_LINE", "KV_TYPE_BYTES", "KvAllocation",
           "LlamaModel", "LlamaContext", "StateLayout", "state_layout", "written_state"]

log = logging.getLogger(__name__)

KV_LINE = re.compile(r"llama_kv_cache: size = *(?P<total_mib>[\d.]+) MiB \( *(?P<cells>\d+) cells, *(?P<layers>\d+) "
                     r"layers, *(?P<seqs>\d+)/(?P<streams>\d+) seqs\), K \((?P<k_type>\w+)\): *(?P<k_mib>[\d.]+) MiB, "
                     r"V \((?P<v_type>\w+)\): *(?P<v_mib>[\d.]+) MiB")
# bytes per cached element of llama.cpp's KV types (q8_0: blocks of 32 int8 values + one f16 scale,
# 34 bytes per 32 elements: vendor/llama.cpp/ggml/src/ggml-common.h, block_q8_0)
KV_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}
_TAIL = 600  # characters of llama.cpp's log quoted in an error


def import_llama_cpp() -> Any:
    """``llama_cpp``; ``MissingDependencyError`` naming the ``gguf`` extra where it does not import."""
    return require("llama_cpp", "llama.cpp writes, checks and quantizes the GGUF")


def llama_cpp_version() -> str:
    return import_llama_cpp().__version__


_sink: list[str] | None = None  # where llama.cpp's log lines go while a capture is open
_callback = None                # the ctypes callback: it must outlive every call into llama.cpp


def _route_log(level: int, text: bytes, user_data) -> None:  # noqa: ARG001
    line = text.decode("utf-8", "replace")
    if _sink is not None:
        _sink.append(line)
    if level >= 3 and level != 5 and line.strip():  # WARN, ERROR (vendor/llama.cpp/ggml/include/ggml.h: ggml_log_level)
        (log.warning if level == 4 else log.debug)("llama.cpp: %s", line.rstrip())


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """Every line llama.cpp logs inside the block (the callback is set on first use)."""
    global _sink, _callback
    if _callback is None:
        lib = import_llama_cpp()
        _callback = lib.llama_log_callback(_route_log)
        lib.llama_log_set(_callback, ctypes.c_void_p(0))
    lines: list[str] = []
    _sink = lines
    try:
        yield lines
    finally:
        _sink = None


@dataclass(frozen=True)
class KvAllocation:
    """The KV cache one context allocated, as llama.cpp logged it (see the module docstring)."""

    total_mib: float
    cells: int        # per stream
    layers: int
    streams: int
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float
    line: str

    @classmethod
    def from_log(cls, text: str) -> "KvAllocation | None":
        m = KV_LINE.search(text)
        if m is None:
            return None
        g = m.groupdict()
        return cls(float(g["total_mib"]), int(g["cells"]), int(g["layers"]), int(g["streams"]), g["k_type"],
                   float(g["k_mib"]), g["v_type"], float(g["v_mib"]), m.group(0))

    @property
    def bytes(self) -> int:
        return round(self.total_mib * 2 ** 20)

    @property
    def total_cells(self) -> int:
        """Cells the bytes cover: per stream x streams."""
        return self.cells * self.streams


class _Freed:
    """Holds a llama.cpp pointer ``ptr``: ``close`` (or the end of a ``with`` block) frees it once."""

    ptr: Any = None

    def _free(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.ptr:
            self._free()
        self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LlamaModel(_Freed):
    """A GGUF loaded by llama.cpp (``vocab_only``: its vocabulary alone); errors name ``stage``."""

    def __init__(self, path: str | Path, *, stage: str, vocab_only: bool = False, hint: str | None = None,
                 n_gpu_layers: int = 0, extra_bufts: bool = False):
        """``extra_bufts``: llama.cpp's extra CPU buffer types (weight repacking, AMX), off by default:
        on a CPU with AMX tiles llama-cpp-python 0.3.36 segfaults decoding a q8_0 model whose rows are
        64 wide (tests/test_gguf_deploy.py::test_q8_0_gguf_generates); the plain CPU buffers run
        every type (``llama_model_params.use_extra_bufts``)."""
        self.lib = lib = import_llama_cpp()
        self.path, self.stage = Path(path), stage
        lib.llama_backend_init()
        with captured_log() as lines:
            params = lib.llama_model_default_params()
            # n_gpu_layers: layers offloaded to a GPU backend, -1 all (bench/gpu_*.py); 0 on the CPU
            params.vocab_only, params.n_gpu_layers = vocab_only, int(n_gpu_layers)
            params.use_extra_bufts = bool(extra_bufts)
            self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise PreconditionError(stage, f"llama.cpp cannot load {self.path}: {''.join(lines)[-_TAIL:]}", hint)
        self.log = "".join(lines)
        self.vocab = lib.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))

    def context(self, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq: int = 1, threads: int = 1,
                flash_attn: bool = True, kv_type: str = "f16") -> "LlamaContext":
        return LlamaContext(self, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq=n_seq, threads=threads,
                            flash_attn=flash_attn, kv_type=kv_type)

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """``llama_tokenize`` with the GGUF's vocabulary; ``parse_special``: special-token text
        (``<|im_end|>``) becomes its token, as Hugging Face tokenizers do by default."""
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (self.lib.llama_token * cap)()
        n = self.lib.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise PreconditionError(self.stage, f"llama_tokenize needs {-n} tokens for {len(raw)} bytes")
        return [int(buf[i]) for i in range(n)]

    def _free(self) -> None:
        self.lib.llama_model_free(self.ptr)


class LlamaContext(_Freed):
    """One ``llama_context`` of ``n_seq`` sequences (``n_seq_max``, one KV stream each) on ``model``,
    with the KV cache it allocated (``kv``, from llama.cpp's log as it was created)."""

    def __init__(self, model: LlamaModel, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq: int, threads: int,
                 flash_attn: bool, kv_type: str):
        self.model, self.n_seq = model, n_seq
        self.lib = lib = model.lib
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq
        p.n_threads = p.n_threads_batch = threads
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = getattr(lib, f"GGML_TYPE_{kv_type.upper()}")
        with captured_log() as lines:
            self.ptr = lib.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise PreconditionError(model.stage, f"llama.cpp could not create a context of {n_seq} x {n_ctx // n_seq} "
                                    f"tokens for {model.path.name}: {''.join(lines)[-_TAIL:]}")
        kv = KvAllocation.from_log("".join(lines))
        if kv is None:
            self.close()
            raise PreconditionError(model.stage, f"llama.cpp logged no KV cache size for {model.path.name}",
                                    "this llama.cpp's log format differs from the one KV_LINE reads")
        self.kv: KvAllocation = kv
        self.n_ctx = int(lib.llama_n_ctx(self.ptr))

    @property
    def cells(self) -> int:
        """Positions each sequence has room for."""
        return self.n_ctx // self.n_seq

    def clear(self) -> None:
        """Forget every sequence (``llama_memory_clear`` with its data)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ptr), True)

    def decode(self, tokens: np.ndarray, start: int = 0, all_logits: bool = True) -> np.ndarray:
        """Decode ``tokens [B, n]`` at positions ``start..`` as one batch (row b is sequence b);
        logits ``[B, n, V]`` (``all_logits``) or of the last position ``[B, 1, V]``, float32."""
        lib = self.lib
        b, n = tokens.shape
        tok = np.ascontiguousarray(tokens.reshape(-1), dtype=np.int32)
        pos = np.tile(np.arange(start, start + n, dtype=np.int32), b)
        n_seq = np.ones(b * n, dtype=np.int32)
        seq = np.arange(b, dtype=np.int32)
        seq_ptr = (seq.ctypes.data + seq.itemsize * np.repeat(np.arange(b), n)).astype(np.uintp)
        want = np.ones(b * n, dtype=np.int8) if all_logits else np.tile((np.arange(n) == n - 1).astype(np.int8), b)
        batch = lib.llama_batch()
        batch.n_tokens = b * n
        batch.token = tok.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        batch.pos = pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        batch.n_seq_id = n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = seq_ptr.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id)))
        batch.logits = want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        rc = lib.llama_decode(self.ptr, batch)
        if rc != 0:
            raise PreconditionError(self.model.stage, f"llama_decode returned {rc} on {self.model.path.name} "
                                    f"({b} x {n} tokens at {start})")
        out, vocab = int(want.sum()), self.model.n_vocab
        logits = np.ctypeslib.as_array(lib.llama_get_logits(self.ptr), shape=(out, vocab))
        return np.array(logits, dtype=np.float32).reshape(b, out // b, vocab)

    def sequence_state(self, seq: int) -> bytes:
        """llama.cpp's saved state of sequence ``seq`` (``llama_state_seq_get_data``)."""
        lib = self.lib
        size = lib.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        got = lib.llama_state_seq_get_data(self.ptr, buf, size, seq)
        if got == 0:
            raise PreconditionError(self.model.stage, f"llama_state_seq_get_data wrote nothing for sequence {seq}")
        return bytes(buf[:got])

    def write_sequences(self, cells: int, rng: np.random.Generator) -> None:
        """Every sequence holds ``cells`` positions (0..cells-1) of random f16 K and V (module
        docstring): the layouts from one token decoded into each, then ``llama_state_seq_set_data``."""
        self.decode(np.zeros((self.n_seq, 1), dtype=np.int32), 0, False)
        layouts = [state_layout(self.sequence_state(s), self.model.stage) for s in range(self.n_seq)]
        self.clear()
        for seq, layout in enumerate(layouts):
            data = written_state(layout, cells, seq, rng)
            src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            del data
            with captured_log() as lines:
                got = self.lib.llama_state_seq_set_data(self.ptr, src, len(src), seq)
            if got != len(src):
                raise PreconditionError(self.model.stage, f"llama.cpp read {got} of the {len(src)} bytes of a "
                                        f"written {cells}-cell state of sequence {seq}: {''.join(lines)[-_TAIL:]}")

    def _free(self) -> None:
        self.lib.llama_free(self.ptr)


@dataclass(frozen=True)
class StateLayout:
    """What a sequence state says: its stream among ``n_stream``, its ``cells``, ``v_trans``, and
    each K then V tensor's (ggml type, row bytes) in the order ``state_write_data`` writes them."""

    magic: int
    cells: int
    n_stream: int
    stream: int
    v_trans: int
    n_layer: int
    rows: tuple[tuple[int, int], ...]


_GGML_F16 = 1   # ggml_type GGML_TYPE_F16 (vendor/llama.cpp/ggml/include/ggml.h)


def state_layout(data: bytes, stage: str) -> StateLayout:
    """The layout of a llama.cpp sequence state (``state_write``) of one stream, with no cell extension
    and an f16 cache with V not transposed (flash attention on); PreconditionError else."""
    def bad(why: str) -> PreconditionError:
        return PreconditionError(stage, f"a llama.cpp sequence state this package cannot write: {why}",
                                 "--kv-fill written needs flash attention and an f16 KV cache")

    off = 0

    def take(fmt: str):
        nonlocal off
        v = np.frombuffer(data, dtype=fmt, count=1, offset=off)[0]
        off += np.dtype(fmt).itemsize
        return int(v)

    magic, _seq = take("<u4"), take("<i4")   # llama_context::state_seq_get_data's io_magic, the sequence
    n_stream, stream, cells = take("<u4"), None, 0
    for s in range(n_stream):
        count = take("<u4")
        if count == 0:
            continue
        if stream is not None:
            raise bad("cells in more than one stream")
        stream, cells = s, count
        meta = np.frombuffer(data, "<i4", count=3 * count, offset=off).reshape(count, 3)
        off += meta.nbytes
        if (meta[:, 1] != 1).any():   # pos, n_seq_id, seq_id: an extension would shift the columns
            raise bad("a cell with other than one sequence id, or a cell extension")
        v_trans, n_layer = take("<u4"), take("<u4")
        if v_trans:
            raise bad("V is stored transposed")
        rows = []
        for _ in range(2 * n_layer):   # K of every layer, then V of every layer
            kind, row = take("<i4"), take("<u8")
            if kind != _GGML_F16:
                raise bad(f"a cache tensor of ggml type {kind}, not f16")
            rows.append((kind, row))
            off += count * row
    if stream is None or off != len(data):
        raise bad(f"{len(data)} bytes, {off} understood")
    return StateLayout(magic, cells, n_stream, stream, v_trans, n_layer, tuple(rows))


def written_state(layout: StateLayout, cells: int, seq: int, rng: np.random.Generator) -> bytes:
    """A sequence state of ``cells`` positions in ``layout``: the stream's cells at positions
    0..cells-1 of ``seq``, every K and V row random N(0, 1) f16."""
    parts = [np.array([layout.magic], "<u4").tobytes(), np.array([seq, layout.n_stream], "<i4").tobytes()]
    for s in range(layout.n_stream):
        if s != layout.stream:
            parts.append(np.array([0], "<u4").tobytes())
            continue
        parts.append(np.array([cells], "<u4").tobytes())
        meta = np.zeros((cells, 3), "<i4")
        meta[:, 0], meta[:, 1], meta[:, 2] = np.arange(cells), 1, seq
        parts += [meta.tobytes(), np.array([layout.v_trans, layout.n_layer], "<u4").tobytes()]
        for kind, row in layout.rows:
            parts += [np.array([kind], "<i4").tobytes(), np.array([row], "<u8").tobytes(),
                      rng.standard_normal(cells * row // 2, dtype=np.float32).astype("<f2").tobytes()]
    return b"".join(parts)
