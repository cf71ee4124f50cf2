"""Keep freed tensor memory from piling up in the C heap.

glibc serves allocations above ``M_MMAP_THRESHOLD`` with their own memory maps and returns them to
the system on free, but it *raises* that threshold (up to 32 MB) each time such a block is freed.
A stage that loads a layer, frees it and loads the next (sequential calibration, streamed
checkpoints) then gets its 10-30 MB weight tensors from the heap, which fragments and does not
shrink: measured on a Qwen2-1.5B-shaped model, peak RSS grew by one layer per layer (0.9 -> 3.2 GB)
until the threshold was pinned. ``tune_allocator`` pins it at 1 MiB (which also stops the dynamic
adjustment) once per process; elsewhere than glibc it does nothing."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re
from typing import Callable

__all__ = ["tune_allocator", "peak_rss_bytes", "children_peak_rss_bytes", "proc_kib_fields", "proc_kib", "parse_bytes", "host_available",
           "memory_share", "kv_budget_bytes", "sequences_admitted"]

log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_done = False


def tune_allocator(mmap_threshold: int = 1 << 20) -> bool:
    """Pin glibc's mmap threshold (and trim threshold); True when applied."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * mmap_threshold)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    _done = ok
    log.debug("glibc mmap threshold pinned at %d bytes: %s", mmap_threshold, ok)
    return ok


def proc_kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The ``Key:  N kB`` lines of a /proc file (``/proc/self/status``, ``/proc/meminfo``) named in
    ``keys``, in bytes; OSError where the file is absent (not Linux)."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                out[key] = int(rest.split()[0]) * 1024
    return out


def proc_kib(path: str, key: str) -> int | None:
    """One ``proc_kib_fields`` field in bytes, or None where the file (not Linux) or the field is absent."""
    try:
        return proc_kib_fields(path, (key,)).get(key)
    except OSError:
        return None


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far, 0 where it is unknown. Linux: ``VmHWM`` of
    /proc/self/status, which starts afresh at exec; not ``getrusage``'s ``ru_maxrss``, which Linux
    keeps across fork and exec, so a benchmark run as a child of a larger process would report that
    process's peak. Elsewhere ``getrusage``'s (read as KiB)."""
    hwm = proc_kib("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else _ru_maxrss_bytes("RUSAGE_SELF")


def children_peak_rss_bytes() -> int:
    """The largest peak resident set of this process's waited-for children (``getrusage``'s
    ``RUSAGE_CHILDREN``), 0 where it is unknown. To measure one command alone, run it from a small
    process that reads this (``bench/scale_probe.py``): Linux carries ``ru_maxrss`` across fork and
    exec, so a command forked from a large process would report at least that process's size."""
    return _ru_maxrss_bytes("RUSAGE_CHILDREN")


def _ru_maxrss_bytes(who: str) -> int:
    """``getrusage(who).ru_maxrss`` in bytes (Linux counts it in KiB), the one reading of it."""
    try:
        import resource

        return int(resource.getrusage(getattr(resource, who)).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def parse_bytes(text: str, flag: str = "--kv-budget") -> int:
    """``2GiB``, ``512MiB``, ``64KiB`` or a plain byte count; ConfigError names ``flag``."""
    from .errors import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not m:
        raise ConfigError(f"{flag} takes a size like 2GiB, 512MiB or a byte count, got {text!r}")
    scale = {"B": 1, None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    return int(float(m.group(1)) * scale)


def host_available() -> int:
    """Bytes of host memory free for new allocations: MemAvailable, else the free pages."""
    import os

    avail = proc_kib("/proc/meminfo", "MemAvailable")
    if avail is not None:
        return avail
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def memory_share(text: str) -> float | None:
    """The share of free memory a ``--kv-budget`` of ``0.4`` or ``40%`` asks for; None for a size."""
    from .errors import ConfigError

    t = text.strip()
    m = re.fullmatch(r"(\d*\.?\d+)\s*%", t) or re.fullmatch(r"(\d*\.\d+|0)", t)
    if not m:
        return None
    share = float(m.group(1)) / (100 if t.endswith("%") else 1)
    if not 0 < share <= 1:
        raise ConfigError(f"--kv-budget as a share of free memory must lie in (0, 100%], got {text!r}")
    return share


def kv_budget_bytes(text: str, available: Callable[[], int] | None = None) -> int:
    """A KV budget: a size (``2GiB``, ``512MiB``, bytes) or a share of the memory free now
    (``0.4`` or ``40%`` of MemAvailable, read when the server loads the model)."""
    from .errors import ConfigError

    share = memory_share(text)
    if share is not None:
        return int(share * (available or host_available)())
    n = parse_bytes(text.strip(), "--kv-budget")
    if n <= 0:
        raise ConfigError(f"--kv-budget must be positive, got {text!r}")
    return n


def sequences_admitted(tokens: int, kv_bytes_per_token: int, kv_budget: int | None = None,
                       max_active: int | None = None) -> int | None:
    """The admission rule of ``harp_trt.serving.BatchedGenerator``: how many sequences of ``tokens``
    tokens each (prompt + max_tokens) are admitted at once, as many as their KV at the longest fits
    in ``kv_budget`` and at most ``max_active``; None when neither bounds them."""
    by_kv = None if kv_budget is None else kv_budget // max(1, tokens * kv_bytes_per_token)
    caps = [c for c in (by_kv, max_active) if c is not None]
    return min(caps) if caps else None
