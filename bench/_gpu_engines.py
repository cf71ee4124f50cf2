"""``--engine genai|llamacpp`` of ``bench/gpu_check.py`` and ``bench/gpu_prefill.py``: the same
prefill and decode timing, dense vs HARP, on onnxruntime-genai (CUDA provider) or llama.cpp (every
layer offloaded, ``n_gpu_layers=-1``) instead of PyTorch.

:func:`probe` runs first and refuses (:class:`harp_trt.bench._gpu_common.Refused`, exit 2) where the runtime
does not import, or, without ``--dry-run``, has no GPU support: onnxruntime-genai must be the
``onnxruntime-genai-cuda`` build (``og.is_cuda_available()``), llama-cpp-python a CUDA build
(``llama_supports_gpu_offload()``, llama.cpp's ``llama_supports_gpu_offload`` in
vendor/llama.cpp/src/llama.cpp). A ``--dry-run`` takes the CPU builds and runs the same code on
the CPU.

:func:`build_engines` writes the random-weight model of the shape (``bench/_random_model.py``, seed 0,
stored in bf16: the export reads it back in fp32) as a Hugging Face folder, makes the plan (the top ``layers`` at
alpha 1: latency does not depend on alpha) and builds the dense and HARP artifacts with the
pipeline's own stages, as ``bench/long_context.py`` does (``bench/_pipeline_engines.build_sources``: genai = export,
rewrite, build-ort, genai; llamacpp = the deci GGUF). At the 8B shapes disk, not the GPU, is the
limit: :func:`disk_needed` estimates it (bf16 folder, then f16 GGUFs for llama.cpp or fp32 ONNX
graphs for genai) and :func:`probe` refuses up front where the work folder has less free space.
Building takes minutes to tens of minutes at 8B and is not bounded by ``--budget-s``."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harp_trt.bench._gpu_common import Refused, prefill_row
from harp_trt.bench._shapes import DRY_RUN, SHAPES, head_dim

__all__ = ["ENGINES", "GPU_RUNTIMES", "WEIGHTS", "probe", "engine_info", "add_engine_options", "shape_params", "disk_needed", "build_engines",
           "time_engine_prefill",
           "time_engine_decode", "close"]

ENGINES = ("torch", "genai", "llamacpp")
# beside the bf16 folder: two f16 GGUFs (llamacpp); the fp32 export, its rewrite and an engine of each (genai)
_ARTIFACT_BYTES_PER_PARAM = {"llamacpp": 2 * 2, "genai": 4 * 4}
WEIGHTS = {"genai": "float32 (the exported graph's)", "llamacpp": "float16 (builders/gguf's default)"}
_CUDA_HINT = {"genai": "pip install onnxruntime-genai-cuda (it brings onnxruntime-gpu)",
              "llamacpp": "CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python==0.3.36 (built with nvcc)"}


def _genai_info(where: str) -> dict[str, Any]:
    from harp_trt.errors import PreconditionError
    from harp_trt.genai_runtime import genai_version, import_genai

    try:
        og = import_genai("bench")
    except PreconditionError as e:
        raise Refused(f"{where} needs onnxruntime-genai, which does not import here ({e.__cause__}); "
                      f"{_CUDA_HINT['genai']}") from None
    return {"runtime": "onnxruntime-genai", "version": genai_version(), "gpu": bool(og.is_cuda_available())}


def _llamacpp_info(where: str) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError as e:
        raise Refused(f"{where} needs llama-cpp-python, which does not import here ({e}); "
                      f"{_CUDA_HINT['llamacpp']}") from None
    return {"runtime": "llama-cpp-python", "version": llama_cpp.__version__,
            "gpu": bool(llama_cpp.llama_supports_gpu_offload())}


def _genai_engines(sources: dict, max_pos: int, dry_run: bool, headroom: int) -> dict:
    from harp_trt.bench.stage.engine_genai import GenaiBenchEngine

    provider = "cpu" if dry_run else "cuda"
    return {v: GenaiBenchEngine(sources[v].path, v, 0, headroom, max_pos, provider=provider) for v in ("dense", "harp")}


def _llamacpp_engines(sources: dict, max_pos: int, dry_run: bool, headroom: int) -> dict:
    from harp_trt.bench.stage.engine_llamacpp import LlamaCppEngine, gguf_path

    # n_gpu_layers=-1: every layer offloaded (a CPU build, as in --dry-run, keeps them on the CPU)
    return {v: LlamaCppEngine(gguf_path(sources[v]), v, 0, headroom, max_pos, n_gpu_layers=-1)
            for v in ("dense", "harp")}


# engine -> (its runtime's version and GPU support, its dense and HARP engines of built sources)
_RUNTIMES = {"genai": (_genai_info, _genai_engines), "llamacpp": (_llamacpp_info, _llamacpp_engines)}
GPU_RUNTIMES = tuple(_RUNTIMES)


def probe(engine: str, script: str, dry_run: bool, shape: str = DRY_RUN, workdir: str = "") -> dict[str, Any]:
    """The runtime's version and GPU support; :class:`Refused` where it does not import, where it
    has no GPU support and this is not a ``--dry-run``, or where ``workdir`` (default: the temporary
    folder) has less free disk than ``shape``'s artifacts need."""
    where = f"bench/{script} --engine {engine}"
    if engine not in _RUNTIMES:
        raise Refused(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    info = {**_RUNTIMES[engine][0](where), "weights": WEIGHTS[engine]}
    if not info["gpu"] and not dry_run:
        raise Refused(f"{where} needs a GPU build of {info['runtime']}: {info['version']} here has no CUDA support; "
                      f"{_CUDA_HINT[engine]}, or pass --dry-run to run it on the CPU at tiny shapes")
    from harp_trt.preflight import free_disk

    folder = Path(workdir or tempfile.gettempdir())
    need, free = disk_needed(engine, shape), free_disk(folder)
    if need > free and not (workdir and (Path(workdir) / f"random-{shape}").is_dir()):
        raise Refused(f"{where} at {shape} writes about {need / 2**30:.0f} GiB of artifacts; {folder} has "
                      f"{free / 2**30:.0f} GiB free: pass --workdir on a larger disk")
    return info


def add_engine_options(ap, timed: str) -> None:
    """``--engine`` (what runs ``timed``) and ``--workdir``, the same in both GPU scripts."""
    ap.add_argument("--engine", default="torch", choices=list(ENGINES),
                    help=f"runtime of {timed}: PyTorch (default), onnxruntime-genai on CUDA or llama.cpp with every "
                         "layer on the GPU (bench/_gpu_engines.py; refused where missing)")
    ap.add_argument("--workdir", default="", help="keep the --engine artifacts here (default: a temporary folder)")


def engine_info(args, script: str) -> dict[str, Any] | None:
    """``probe`` of ``args.engine`` where it names a GPU runtime (refused before any work), else
    None: the script's own PyTorch path."""
    if args.engine not in _RUNTIMES:
        return None
    return probe(args.engine, script, args.dry_run, args.shape, args.workdir)


def shape_params(shape: str) -> int:
    """Parameters of a ``SHAPES`` entry (untied embeddings; attention biases, where a family has
    them, left out: 0.002 % of Qwen2-7B, nothing for a disk estimate)."""
    c = SHAPES[shape]
    h, hd, inter = c["hidden_size"], head_dim(c), c["intermediate_size"]
    attn = 2 * h * c["num_attention_heads"] * hd + 2 * h * c["num_key_value_heads"] * hd
    return 2 * c["vocab_size"] * h + c["num_hidden_layers"] * (attn + 3 * h * inter + 2 * h) + h


def disk_needed(engine: str, shape: str) -> int:
    """Bytes the artifacts take: the bf16 folder, then two f16 GGUFs (llamacpp), or the fp32 export,
    its rewrite and the ORT engine built from each (genai; its folders hard-link the graphs)."""
    n = shape_params(shape)
    return 2 * n + _ARTIFACT_BYTES_PER_PARAM[engine] * n


def build_engines(engine: str, shape: str, layers: int, workdir: Path, dry_run: bool, headroom: int) -> dict:
    """``{"dense": Engine, "harp": Engine}`` of the shape on ``engine``, on the GPU unless ``dry_run``."""
    from harp_trt.bench._pipeline_engines import build_sources
    from harp_trt.bench._random_model import random_model
    from harp_trt.families import family_of
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    from transformers import AutoConfig

    store = ArtifactStore(Path(workdir))
    folder = random_model(shape, Path(workdir) / f"random-{shape}")
    resolved = resolve_model(str(folder), store.root)
    cfg = AutoConfig.from_pretrained(folder)
    n = cfg.num_hidden_layers
    plan = Plan(model_ref=resolved.ref, model_digest=resolved.digest, family=family_of(cfg).name, num_layers=n,
                strategy="top", layers=tuple(range(n - layers, n)), alphas=(1.0,) * layers)
    sources = build_sources(engine, plan, resolved, None, store, SimpleNamespace(quant="none", gguf_type="none"))
    return _RUNTIMES[engine][1](sources, int(cfg.max_position_embeddings), dry_run, headroom)


def time_engine_prefill(engines: dict, seq_lens, repeats: int, warmup: int, vocab: int) -> list[dict]:
    """Prefill rows as ``harp_trt.bench._gpu_torch.time_prefill`` writes them, dense and HARP interleaved
    (the order flips every repeat); each runtime returns when its logits are on the host."""
    import torch

    rows = []
    g = torch.Generator().manual_seed(0)
    for seq in seq_lens:
        ids = torch.randint(0, vocab, (1, seq), generator=g)
        samples: dict[str, list[float]] = {v: [] for v in engines}
        for r in range(warmup + repeats):
            for v in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                t0 = time.perf_counter()
                engines[v].prefill(ids)
                if r >= warmup:
                    samples[v].append(time.perf_counter() - t0)
        rows += [prefill_row(v, seq, xs) for v, xs in samples.items()]
        print(f"prefill {seq:>6}: " + "  ".join(f"{r['variant']} {r['mean_s']:.4f} s" for r in rows[-2:]),
              file=sys.stderr)
    return rows


def time_engine_decode(engines: dict, context: int, steps: int, vocab: int) -> list[dict]:
    """Greedy decode of ``steps`` tokens after a ``context``-token prompt, one sequence (the
    runtimes' batch-1 path; the PyTorch path also fills batches): tokens/s and the KV bytes per
    token the runtime holds (its own account: ``Engine.cache_bytes`` over ``cache_tokens``, the
    positions it allocated, or the tokens held)."""
    import torch

    rows, batch = [], 1
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(1))
    for v, e in engines.items():
        logits, state = e.prefill(ids)
        tok = logits.argmax(-1, keepdim=True)
        logits, state = e.decode(tok, state)  # warm-up step
        tok = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, state = e.decode(tok, state)
            tok = logits.argmax(-1, keepdim=True)
        dt = time.perf_counter() - t0
        tokens = e.cache_tokens(state) or (context + steps + 1)
        rows.append({"variant": v, "batch": batch, "kind": "engine", "context": context, "steps": steps,
                     "ms_per_step": dt / steps * 1e3, "tokens_per_s": batch * steps / dt,
                     "kv_bytes_per_token": int(round(e.cache_bytes(state) / tokens))})
        print(f"decode {v:>5} batch {batch:>4}: {rows[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    return rows


def close(engines: dict) -> None:
    """Free both engines' runtime resources."""
    for e in engines.values():
        e.close()


def engine_figures(args, info: dict) -> tuple[list[dict], list[dict], dict, str]:
    """(prefill rows, decode rows, batches, runtime label) of ``args.engine`` (decode at batch 1): the
    figures ``bench/_gpu_torch.py`` gives for PyTorch, from :func:`build_engines`."""
    vocab = SHAPES[args.shape]["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="gpu_engines_") as tmp:
        engines = build_engines(args.engine, args.shape, args.layers, Path(args.workdir or tmp), args.dry_run,
                                   headroom=args.warmup + args.decode_steps + 2)
        try:
            pre = time_engine_prefill(engines, args.seq_lens, args.repeats, args.warmup, vocab)
            dec = time_engine_decode(engines, args.decode_context, args.decode_steps, vocab)
        finally:
            close(engines)
    return pre, dec, {"dense": 1, "harp": 1}, f"{info['runtime']} {info['version']}"
