"""Library versions recorded in every artifact (and hashed where they change the result), and the
versions of the external runtimes our artifacts are written for."""
from __future__ import annotations

import importlib.metadata as md
import platform

import harp_trt

__all__ = ["library_versions", "TRTLLM_VERSION", "source_commit", "provenance"]

# The TensorRT-LLM our checkpoints and launch files are written for (docs/trtllm-contract.md reads its
# 1.2 source). An engine is built and served by one version: the trtllm manifest and every launch file
# name it, and the Triton image is chosen to carry it (builders/triton/releases.py). Defined here, in
# the core, because both harp_trt.builders.trtllm and harp_trt.builders.triton need it and no stage imports another.
TRTLLM_VERSION = "1.2.1"

DEFAULT_PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "safetensors")


def library_versions(packages: tuple[str, ...] = DEFAULT_PACKAGES) -> dict[str, str]:
    out = {"python": platform.python_version(), "harp-trt": harp_trt.__version__}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def source_commit() -> str | None:
    """The checkout's commit (with ``-dirty`` when tracked files differ from it), or None outside a
    git checkout: what a committed result JSON names as the code it was measured with."""
    import subprocess
    from pathlib import Path

    root = Path(harp_trt.__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def provenance(argv: list[str], packages: tuple[str, ...] = DEFAULT_PACKAGES) -> dict[str, object]:
    """Where a benchmark figure comes from: commit, UTC date, the command line (the script relative to
    the checkout) and library versions."""
    import shlex
    import sys
    import time
    from pathlib import Path

    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(harp_trt.__file__).resolve().parents[1])
    except ValueError:
        pass
    return {"commit": source_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python " + shlex.join([str(script), *argv]), "versions": library_versions(packages)}
