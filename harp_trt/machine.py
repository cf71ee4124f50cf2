"""What machine a figure was measured on: the CPU's model and the instruction sets that decide how
fast its kernels can run (the same engine prefilled 2048 tokens at 0.55x PyTorch's time on
one CPU and 1.46x on another with AMX). Every benchmark records ``describe()`` beside its figures."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["CPU_FEATURES", "cpu_model", "cpu_features", "describe"]

# /proc/cpuinfo flags that change which kernels ONNX Runtime, PyTorch and llama.cpp pick: vector width
# (AVX2, AVX-512), int8 dot products (VNNI), bf16/fp16 arithmetic, and the AMX matrix tiles
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""


def cpu_model() -> str:
    """The first ``model name`` of /proc/cpuinfo, else what ``platform`` says."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The ``CPU_FEATURES`` this CPU reports (in that order; empty where /proc/cpuinfo is absent)."""
    flags: set[str] = set()
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return [f for f in CPU_FEATURES if f in flags]


def describe(threads: int | None = None) -> dict[str, Any]:
    """CPU model, features, cores, the threads a measurement used (None: not fixed) and the OS."""
    return {"cpu": cpu_model(), "cpu_features": cpu_features(), "cores": os.cpu_count(), "threads": threads,
            "system": platform.system()}
