"""KV capacity measured inside a memory cap: how many sequences at context C a runtime
really decodes when its address space is capped, for a dense and a HARP engine under the same cap.

**How.** Each try is a child process (``probe``: ``python -m harp_trt.bench._long_context_capacity
probe ...``) that loads the engine, warms it up at batch 1 (a short prompt, a few decode steps),
reads its own ``VmSize``/``VmRSS`` (the *base*: weights + runtime), sets ``RLIMIT_AS`` to the cap
(soft and hard; cgroups are not writable where this was written), fills the KV cache of B sequences
at C - steps positions, decodes ``steps`` tokens for all B and prints one JSON line. A try fits when
it completes; a typed failure (``MemoryError``, an ONNX Runtime error, a llama.cpp context that is
not created or a decode that fails) prints ``fits: false`` with the error, and the parent counts a
crash (non-zero exit, a signal) as "does not fit" too, with its return code. ``largest_batch``
searches B from the formula's expectation outward by 1, then by doubling steps, then bisects; it
assumes fitting is monotone in B (a batch holds every smaller batch's buffers and more).
``measure_capacity`` runs it for dense and HARP under one absolute cap and puts the KV formula's
counts beside the measured ones.

**Filling.** ONNX Runtime: a ``StaticCache`` of capacity C is built from zero-length pasts (so only
the final buffers exist: ``np.zeros`` maps untouched pages, no copy), then every K and V buffer is
written in place with a constant (every page touched) and its ``length`` set: a decode step's cost
and memory do not depend on the cached values. A graph without GroupQueryAttention decodes through
``forward`` with filled past arrays, holding past and present for a step, as that runtime does.
llama.cpp: a context of B streams x C cells, configured as the bench's ``LlamaCppEngine._create``
(n_batch = B x C, n_ubatch = min(512, B x C), flash attention, f16 KV). Its constructor allocates
every layer's K and V and clears them (vendor/llama.cpp/src/llama-kv-cache.cpp,
``llama_kv_cache::llama_kv_cache``: ``ggml_backend_alloc_ctx_tensors_from_buft`` then
``ggml_backend_buffer_clear(buf, 0)``: a memset that touches every page), and the context
reserves its compute buffers for the worst case at creation (vendor/llama.cpp/src/llama-context.cpp,
``llama_context::sched_reserve``: ``graph_reserve`` of n_ubatch tokens over ``memory->init_full()``,
the whole cache). So KV and compute buffers exist from creation. The search uses ``fill="short"``:
one prompt token per sequence and the steps, in seconds. Measured (SmolLM2-135M Q4_1, one thread,
1 x 8192 cells, 180 MiB of f16 KV): creating the context raised RSS by 190 MB (the KV, touched) and
VmSize by 339 MB (KV + reserved compute buffers); a prefill of 8189 tokens then added 26.7 MB of RSS
(reserved compute pages, such as the growing attention mask, touched by 512-token ubatches) and 6.0
MB of VmSize (5-8 MB on a tiny model too), the short fill 0.7 and 0.4 MB. A short fill thus needs no
more than a prefill and its answer is an upper bound; ``confirm`` (on by default) retries it with
``fill="prefill"`` (sequence 0 prefilled with C - steps tokens, its stream copied to the others by
``llama_memory_seq_cp``: an in-place buffer copy at the next update, ``llama_kv_cache::update``), one
sequence fewer while it does not fit: the prefill's answer for one or two prefills (90 s each there).
A short fill's attention spans 256 cells (``llama_kv_cache::get_n_kv`` pads used cells to 256): its
*time* is not C's. Where the KV or ``ggml_init`` cannot be allocated llama.cpp refuses the context or
aborts (``GGML_ASSERT``): both count as "does not fit".

**What RLIMIT_AS counts.** Address space, not resident memory: the GGUF's file mapping (weights read
through mmap are part of the base), every thread's stack (8 MiB each by default; threads made during
the warm-up are in the base, their stacks cached by glibc and reused), reserved but untouched
buffers (llama.cpp's compute buffers, ONNX Runtime's arena growth) and glibc's malloc arenas: each
thread's arena reserves 64 MiB of address space, so the child runs with ``MALLOC_ARENA_MAX=2``.
The cap is therefore over VmSize, and the RSS split (weights/runtime = base RSS, KV = RSS after the
fill - base, activations = peak RSS - RSS after the fill) is reported beside it.

**Limits.** One cap, CPU only, llama.cpp with f16 KV; a llama.cpp context also costs ~20 MiB of
ggml graph memory and its compute buffers, ORT's arena grows in powers of two: a fit depends on more
than the KV, which the formula's expectation (KV only) ignores; the base VmSize of one engine varies
by a few MiB between children (3.6 MB seen on SmolLM2); a batch step is 1 / (dense batch) of the
ratio (``granularity``)."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["probe", "largest_batch", "measure_capacity", "status_bytes", "main", "RUNTIMES", "FILLS"]

log = logging.getLogger("long_context")

STAGE = "bench"
FILLS = ("short", "prefill")     # llama.cpp's; ONNX Runtime's cache is always written directly
STEPS = 3                        # decode steps of a try
WARM_PROMPT, WARM_STEPS = 8, 2   # batch-1 warm-up before the base is read
LLAMACPP_WARM_CELLS = 1024       # cells of llama.cpp's warm-up context (its KV per token is read there)
AUTO_SEQUENCES = 10.5            # cap = dense base VmSize + this many dense KV sequences at C
MOST_BATCH = 4096                # the search's ceiling (a cap that fits more is too large to search)
TIMEOUT_S = 1800
# see the module docstring: arenas reserve address space; ggml's abort on a failed allocation would
# otherwise run gdb on the child for a backtrace
ENV = {"MALLOC_ARENA_MAX": "2", "GGML_NO_BACKTRACE": "1"}


def status_bytes() -> dict[str, int]:
    """VmPeak, VmSize, VmHWM, VmRSS of this process from /proc/self/status, in bytes."""
    from harp_trt.memory import proc_kib_fields

    return proc_kib_fields("/proc/self/status", ("VmPeak", "VmSize", "VmHWM", "VmRSS"))


# ---- the child ----------------------------------------------------------------------------------
class _Ort:
    fill_kind: str | None = "direct"   # how the KV is filled (None: the ``fill`` argument's way)

    def __init__(self, path: Path, threads: int, fill: str):
        from onnxruntime.capi import onnxruntime_pybind11_state as C

        from harp_trt.engine_spec import is_engine
        from harp_trt.ort_session import OrtCausalLM

        self.lm = (OrtCausalLM.from_engine(path, intra_op_threads=threads or None) if is_engine(path)
                   else OrtCausalLM(path, intra_op_threads=threads or None))
        self.kv_bytes_per_token = self.lm.kv_bytes_per_token()
        self.static = self.lm.shares_kv_buffer   # reads the graph: before the cap
        self.errors = tuple(v for v in vars(C).values() if isinstance(v, type) and issubclass(v, Exception))
        self.state: Any = None

    def warm_up(self) -> None:
        ids = np.ones((1, WARM_PROMPT), np.int64)
        _, past = self.lm.forward(ids, np.ones_like(ids), np.arange(WARM_PROMPT)[None])
        self._steps(past, 1, WARM_PROMPT, WARM_STEPS)

    def _steps(self, past, batch: int, length: int, steps: int) -> None:
        tok = np.ones((batch, 1), np.int64)
        for i in range(steps):
            mask, pos = np.ones((batch, length + i + 1), np.int64), np.full((batch, 1), length + i, np.int64)
            if self.static:
                if not hasattr(past, "binding"):
                    past = self.lm.static_cache(past, length + steps)
                self.lm.decode_step(past, tok, mask, pos)
            else:
                _, past = self.lm.forward(tok, mask, pos, past)
        self.state = None

    def fill(self, batch: int, length: int, capacity: int) -> tuple[int, dict]:
        from harp_trt.ort_session import StaticCache

        lm = self.lm
        if self.static:
            empty = np.zeros((batch, lm.kv_heads, 0, lm.head_dim), lm.kv_dtype)
            self.state = StaticCache(lm, {i: (empty, empty) for i in lm.kv_layers}, capacity)
            bufs = list(self.state.buffers.values())
            self.state.length = length
        else:
            shape = (batch, lm.kv_heads, length, lm.head_dim)
            self.state = {i: (np.empty(shape, lm.kv_dtype), np.empty(shape, lm.kv_dtype)) for i in lm.kv_layers}
            bufs = list(self.state.values())
        for buf in (b for kv in bufs for b in kv):
            buf.fill(0.5)
        return int(sum(k.nbytes + v.nbytes for k, v in bufs)), {"static_cache": self.static}

    def decode(self, batch: int, length: int, steps: int) -> None:
        self._steps(self.state, batch, length, steps)


class _LlamaCpp:
    fill_kind: str | None = None

    def __init__(self, path: Path, threads: int, fill: str):
        from harp_trt.errors import PreconditionError
        from harp_trt.llamacpp_runtime import LlamaModel

        path = path / "model.gguf" if path.is_dir() else path
        self.model = LlamaModel(path, stage=STAGE)
        self.threads, self.fill_mode = int(threads or os.cpu_count() or 1), fill
        self.errors = (PreconditionError,)
        self.ctx: Any = None
        self.kv_bytes_per_token = 0.0

    def _context(self, n_seq: int, cells: int):
        n = n_seq * cells   # as bench/stage/engine_llamacpp.py's LlamaCppEngine._create
        return self.model.context(n_ctx=n, n_batch=n, n_ubatch=min(512, n), n_seq=n_seq, threads=self.threads,
                                  flash_attn=True, kv_type="f16")

    def warm_up(self) -> None:
        with self._context(1, LLAMACPP_WARM_CELLS) as c:
            self.kv_bytes_per_token = c.kv.bytes / c.kv.total_cells
            c.decode(np.ones((1, WARM_PROMPT), np.int32), 0, False)
            for i in range(WARM_STEPS):
                c.decode(np.ones((1, 1), np.int32), WARM_PROMPT + i, False)

    def fill(self, batch: int, length: int, capacity: int) -> tuple[int, dict]:
        self.ctx = c = self._context(batch, capacity)
        extra = {"kv_cells": c.kv.total_cells, **_after("context")}
        if self.fill_mode == "short":
            c.decode(np.ones((batch, 1), np.int32), 0, False)
            self.start = 1
        else:
            ids = (np.arange(length, dtype=np.int32) % self.model.n_vocab)[None]   # nothing imported under the cap
            for s in range(0, length, 512):
                c.decode(ids[:, s:s + 512], s, False)   # row 0: sequence 0
            lib = self.model.lib
            for s in range(1, batch):
                lib.llama_memory_seq_cp(lib.llama_get_memory(c.ptr), 0, s, -1, -1)
            self.start = length
        return c.kv.bytes, extra

    def decode(self, batch: int, length: int, steps: int) -> None:
        for i in range(steps):
            self.ctx.decode(np.ones((batch, 1), np.int32), self.start + i, False)
        self.ctx.close()


RUNNERS = {"ort": _Ort, "llamacpp": _LlamaCpp}
RUNTIMES = tuple(RUNNERS)


def _after(stage: str) -> dict[str, int]:
    s = status_bytes()
    return {f"vm_after_{stage}": s["VmSize"], f"rss_after_{stage}": s["VmRSS"]}


def _header(runtime: str, engine, context: int, batch: int, cap: int, fill: str) -> dict[str, Any]:
    return {"runtime": runtime, "engine": str(engine), "context": context, "batch": batch, "cap_bytes": cap,
            "fill": RUNNERS[runtime].fill_kind or fill}


def _check(runtime: str, context: int, batch: int, cap: int, steps: int, fill: str) -> None:
    from harp_trt.errors import ConfigError

    if runtime not in RUNTIMES or fill not in FILLS:
        raise ConfigError(f"runtime {runtime!r} / fill {fill!r}: valid are {', '.join(RUNTIMES)} / {', '.join(FILLS)}")
    if batch < 0 or cap < 0 or not 0 < steps < context:
        raise ConfigError(f"need batch >= 0, cap >= 0 and 0 < steps < context; got batch {batch}, cap {cap}, "
                          f"steps {steps}, context {context}")


def run_probe(runtime: str, engine: str | Path, context: int, batch: int, cap: int, threads: int,
              steps: int = STEPS, fill: str = "short") -> dict[str, Any]:
    """The child's work (module docstring); run it in a process of its own: it caps that process's
    address space for good. Returns the JSON line's fields."""
    _check(runtime, context, batch, cap, steps, fill)
    t0 = time.perf_counter()
    e = RUNNERS[runtime](Path(engine), threads, fill)
    e.warm_up()
    s = status_bytes()
    out = {**_header(runtime, engine, context, batch, cap, fill), "steps": steps, "base_vm": s["VmSize"],
           "base_rss": s["VmRSS"], "kv_bytes_per_token": e.kv_bytes_per_token, "fits": True, "error": None}
    if cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if batch:
        try:
            out["kv_bytes"], extra = e.fill(batch, context - steps, context)
            out.update(extra, **_after("kv"))
            e.decode(batch, context - steps, steps)
        except (MemoryError, *e.errors) as exc:
            out.update(fits=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        e.state = e.ctx = None   # the filled cache, freed before the report
    s = status_bytes()
    # VmHWM is read from per-thread RSS counters the kernel syncs in batches: a peak below a reading
    # taken before is that lag, so the peak is the largest of it and those readings. Not getrusage's
    # ru_maxrss: Linux keeps it across fork and exec, so a child reports its parent's peak
    hwm = max([s["VmHWM"], *(v for k, v in out.items() if k.startswith("rss_"))])
    out.update(peak_vm=s["VmPeak"], peak_rss=hwm, seconds=time.perf_counter() - t0)
    return out


# ---- the parent ---------------------------------------------------------------------------------
def _child_env() -> dict[str, str]:
    """This environment plus ``ENV``; a checkout's root goes first on PYTHONPATH so that the child
    imports this harp_trt (an installed package's root is site-packages: left where it is)."""
    import harp_trt

    env = {**os.environ, **ENV}
    root = Path(harp_trt.__file__).resolve().parents[1]
    if (root / "bench" / "__init__.py").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


def probe(runtime: str, engine: str | Path, context: int, batch: int, cap: int, threads: int,
          steps: int = STEPS, fill: str = "short", timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """One try in a child process: its JSON line, or ``fits: false`` with the return code (and the
    signal's name) and the tail of its stderr where it crashed. ``wall_s``: the child's, as seen here."""
    from harp_trt.errors import PreconditionError

    _check(runtime, context, batch, cap, steps, fill)   # a bad argument is an error, not a try that does not fit
    cmd = [sys.executable, "-m", "harp_trt.bench._long_context_capacity", "probe", "--runtime", runtime,
           "--engine", str(engine), "--context", str(context), "--batch", str(batch), "--cap", str(int(cap)),
           "--threads", str(threads), "--steps", str(steps), "--fill", fill]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PreconditionError(STAGE, f"the capacity try of {batch} x {context} on {engine} ran past {timeout} s",
                                "give a longer timeout (a prefill fill at a long context takes minutes)") from None
    seconds = time.perf_counter() - t0
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode == 0 and last.startswith("{"):
        return {**json.loads(last), "returncode": 0, "wall_s": seconds}
    why = f"signal {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit {p.returncode}"
    return {**_header(runtime, engine, context, batch, cap, fill), "fits": False, "returncode": p.returncode,
            "error": f"{why}: {p.stderr.strip()[-400:]}", "wall_s": seconds}


def rss_split(p: dict[str, Any]) -> dict[str, int]:
    """Weights/runtime, KV and activations of a fitting try, from its RSS figures (and VmSize's);
    ``kv_allocated``: the runtime's KV bytes (llama.cpp's RSS "kv" also holds compute pages touched)."""
    return {"weights_runtime": p["base_rss"], "kv": p["rss_after_kv"] - p["base_rss"], "kv_allocated": p["kv_bytes"],
            "activations": p["peak_rss"] - p["rss_after_kv"], "vm_kv": p["vm_after_kv"] - p["base_vm"],
            "vm_activations": p["peak_vm"] - p["vm_after_kv"]}


def largest_batch(runtime: str, engine: str | Path, context: int, cap: int, threads: int,
                  expected: int | None, *, steps: int = STEPS, fill: str = "short", confirm: bool = True,
                  timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """The largest B whose try fits ``cap`` bytes of address space: tries ``expected`` (at least 1),
    then outward by 1, 2, 4, ... until the answer is bracketed, then bisects. Assumes monotone fits.
    ``confirm`` (llama.cpp, short fill): the answer is retried with a prefill fill, one fewer while it
    does not fit (``confirmed``).
    Returns the batch, every try (by B) and the RSS split of the largest fitting one."""
    from harp_trt.errors import ConfigError, PreconditionError

    if cap <= 0:
        raise ConfigError(f"largest_batch needs a cap in bytes > 0, got {cap}")
    tries: dict[int, dict[str, Any]] = {}

    def fits(b: int) -> bool:
        if b not in tries:
            tries[b] = probe(runtime, engine, context, b, cap, threads, steps, fill, timeout)
            log.info("capacity %s %s: %d x %d in %.0f MiB: %s", runtime, Path(engine).name, b, context,
                     cap / 2 ** 20, "fits" if tries[b]["fits"] else f"does not fit ({tries[b]['error']})"[:200])
        return tries[b]["fits"]

    b, step = max(1, int(expected or 1)), 1
    if fits(b):
        lo, hi = b, None
        while hi is None:
            if lo + step > MOST_BATCH:
                raise PreconditionError(STAGE, f"{cap} bytes hold more than {MOST_BATCH} sequences of {context}",
                                        "give a smaller cap")
            if fits(lo + step):
                lo, step = lo + step, 2 * step
            else:
                hi = lo + step
    else:
        lo, hi = None, b
        while lo is None:
            if hi == 1:
                lo = 0
            elif fits(max(1, hi - step)):
                lo = max(1, hi - step)
            else:
                hi, step = max(1, hi - step), 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    best, confirmed = tries.get(lo), []
    while confirm and RUNNERS[runtime].fill_kind is None and fill == "short" and lo:
        # the short fill's answer is an upper bound (module docstring): the prefill's, one fewer while it fails
        best = probe(runtime, engine, context, lo, cap, threads, steps, "prefill", timeout)
        confirmed.append(best)
        if best["fits"]:
            break
        lo -= 1
    return {"batch": lo, "cap_bytes": cap, "expected": expected, "fill": fill, "steps": steps,
            "kv_bytes": best.get("kv_bytes") if lo else 0, "rss_split": rss_split(best) if lo else None,
            "tries": [tries[k] for k in sorted(tries)], "confirmed": confirmed}


def measure_capacity(runtime: str, engines: dict[str, str | Path], context: int, cap: int | None, threads: int,
                     kv_bytes_per_token: dict[str, float] | None = None, *, ideal: float | None = None,
                     steps: int = STEPS, fill: str = "short", confirm: bool = True,
                     timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Dense and HARP batches at ``context`` inside one absolute cap. ``cap`` None: the dense base
    VmSize + ``AUTO_SEQUENCES`` dense KV sequences at ``context`` (the formula's), so a batch step is
    <= 10 % of dense. ``kv_bytes_per_token``: {"dense": x, "harp": y} (None: the runtime's, read by
    each base try). ``ideal``: L/(L-P) (None: dense/harp KV per token). The formula's expectation of
    each engine is (cap - its base VmSize) // (its KV per token x context)."""
    from harp_trt.errors import PreconditionError

    base = {v: probe(runtime, engines[v], context, 0, 0, threads, steps, fill, timeout) for v in ("dense", "harp")}
    for v, p in base.items():
        if not p["fits"]:
            raise PreconditionError(STAGE, f"the {v} engine's base try on {engines[v]} failed: {p['error']}")
    kvpt = {v: float((kv_bytes_per_token or {}).get(v) or base[v]["kv_bytes_per_token"]) for v in base}
    per_seq = {v: kvpt[v] * context for v in base}
    rule = "given"
    if cap is None:
        cap = int(base["dense"]["base_vm"] + AUTO_SEQUENCES * per_seq["dense"])
        rule = f"dense base VmSize + {AUTO_SEQUENCES} x dense KV bytes per sequence at {context} (formula)"
    expected = {v: max(0, math.floor((cap - base[v]["base_vm"]) / per_seq[v])) for v in base}
    out: dict[str, Any] = {"runtime": runtime, "cap_bytes": cap, "cap_rule": rule, "context": context,
                           "kv_bytes_per_token": kvpt, "expected": expected,
                           "base": {v: {k: base[v][k] for k in ("base_vm", "base_rss")} for v in base}}
    for v in ("dense", "harp"):
        out[v] = largest_batch(runtime, engines[v], context, cap, threads, expected[v], steps=steps, fill=fill,
                               confirm=confirm, timeout=timeout)
    d, h = out["dense"]["batch"], out["harp"]["batch"]
    out["ideal"] = ideal if ideal is not None else kvpt["dense"] / kvpt["harp"]
    out["ratio"] = h / d if d else None
    out["granularity"] = 1 / d if d else None   # one batch step, as a fraction of dense
    out["fraction_of_ideal"] = out["ratio"] / out["ideal"] if d else None
    return out


# ---- command line -------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harp_trt.bench._long_context_capacity",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    one = sub.add_parser("probe", help="one try (the child): prints one JSON line")
    one.add_argument("--engine", required=True, help="ORT engine folder, or a .gguf (a folder holding model.gguf)")
    one.add_argument("--batch", type=int, required=True, help="sequences (0: the base only)")
    one.add_argument("--cap", type=int, default=0, help="RLIMIT_AS in bytes (0: none)")
    both = sub.add_parser("measure", help="measure_capacity: dense and HARP under one cap")
    both.add_argument("--dense", required=True)
    both.add_argument("--harp", required=True)
    both.add_argument("--cap", default="auto", help="bytes, or auto (dense base + 10.5 dense KV sequences)")
    both.add_argument("--timeout", type=float, default=TIMEOUT_S)
    both.add_argument("--no-confirm", dest="confirm", action="store_false",
                      help="llama.cpp: keep the short fill's answers (no prefill retry)")
    for q in (one, both):
        q.add_argument("--runtime", choices=RUNTIMES, required=True)
        q.add_argument("--context", type=int, required=True)
        q.add_argument("--threads", type=int, default=0, help="0: the runtime's default")
        q.add_argument("--steps", type=int, default=STEPS)
        q.add_argument("--fill", choices=FILLS, default="short", help="llama.cpp's KV fill (module docstring)")
    return p


def main(argv: list[str] | None = None) -> int:
    from harp_trt.errors import HarpError

    args = _parser().parse_args(argv)
    try:
        if args.command == "probe":
            out = run_probe(args.runtime, args.engine, args.context, args.batch, args.cap, args.threads,
                            args.steps, args.fill)
        else:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            out = measure_capacity(args.runtime, {"dense": args.dense, "harp": args.harp}, args.context,
                                   None if args.cap == "auto" else int(args.cap), args.threads, steps=args.steps,
                                   fill=args.fill, confirm=args.confirm, timeout=args.timeout)
    except HarpError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
