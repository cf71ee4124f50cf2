"""Running a genai folder: greedy tokens from ``og.Generator`` and the resident memory a generator
allocates (its KV cache), measured in a fresh process. Folders are opened through
``harp_trt.genai_runtime`` (the import order genai 0.18 needs, CPU, threads), shared with the bench.

Memory: genai 0.18 reports no allocation figures through its Python API, so ``measure_kv_rss``
reads the process's resident set (``/proc/self/statm``) after ``og.Model`` loads and after a
generator with ``max_length`` tokens has run its first forward (with ``past_present_share_buffer``
the KV buffers are allocated at ``max_length`` and zero-filled then, so they are resident). The
delta is the KV cache plus the prompt's activations; ``python -m harp_trt.builders.genai.probe FOLDER
MAX_LENGTH [BATCH]`` prints it as JSON. A fresh process per measurement keeps one folder's freed
memory from being reused by the next."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from harp_trt.genai_runtime import genai_version, import_genai, open_genai_model

__all__ = ["genai_version", "import_genai", "genai_greedy", "measure_kv_rss"]


def genai_greedy(folder: str | os.PathLike, prompt: Sequence[int], n_new: int, threads: int = 0) -> list[int]:
    """The ``n_new`` tokens ``og.Generator`` picks greedily after ``prompt`` (EOS does not stop it)."""
    og = import_genai()
    model = open_genai_model(folder, threads)
    params = og.GeneratorParams(model)
    total = len(prompt) + n_new
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(list(prompt))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(prompt):]]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _probe(folder: Path, max_length: int, batch: int) -> dict[str, Any]:
    og = import_genai()
    model = open_genai_model(folder, threads=1)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, batch_size=batch, do_sample=False)
    before = _rss()
    gen = og.Generator(model, params)
    gen.append_tokens([[1, 2, 3]] * batch if batch > 1 else [1, 2, 3])
    gen.generate_next_token()
    after = _rss()
    return {"rss_before": before, "rss_after": after, "delta_bytes": after - before,
            "max_length": max_length, "batch": batch}


def measure_kv_rss(folder: str | os.PathLike, max_length: int, batch: int = 1, timeout: float = 600) -> dict[str, Any]:
    """Resident bytes a generator of ``max_length`` tokens (batch ``batch``) adds over the loaded
    model, measured in a fresh Python process (see the module docstring)."""
    cmd = [sys.executable, "-m", "harp_trt.builders.genai.probe", str(folder), str(max_length), str(batch)]
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"probe of {folder} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(_probe(Path(args[0]), int(args[1]), int(args[2]) if len(args) > 2 else 1)))
