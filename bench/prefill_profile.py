"""Prefill on the CPU, where the time goes and against whom: our ORT engines (fp32, int4,
int8, w8a8) before and after the generator's prefill path, PyTorch eager fp32 (sdpa) and onnxruntime-genai's
int4 model, one process, the same threads, interleaved.

    python bench/prefill_profile.py [--model smollm2-135m | --shape qwen2-7b-4layers] [--lengths 512,2048,8192]
        [--threads 2] [--repeats 3] [--engines none,int4,int8,w8a8] [--quant-block-size 32] [--one-call none]
        [--genai [--genai-block-size 32]] [--out FILE.json]

Sides, each timed as a generator's prefill (the prompt in, the last position's logits out):

* ``ort_<quant>_one_call``: the path before chunked prefill: one graph call over the whole prompt, every
  position's logits (``OrtCausalLM.forward``, ``logits_to_keep`` 0), then the last row;
* ``ort_<quant>``: ``OrtCausalLM.prefill`` as ``generate`` runs it: chunks of ``--chunk`` tokens into
  the static KV cache, the LM head over the last position only (``logits_to_keep`` 1);
* ``torch``: the Hugging Face model, fp32, sdpa, ``logits_to_keep=1`` (what its ``generate`` passes);
* ``genai_int4`` (``--genai``): onnxruntime-genai's model builder int4 (block ``--genai-block-size``,
  its default 32; accuracy level 4), its generator's prefill (``bench/_genai_baseline.py``).

Every repeat runs each side once, the order rotating; each figure is the median, and our sides'
speed-ups over PyTorch carry 95 % intervals from the paired repeats (``paired_speedup``), each next to
its ceiling: PyTorch's time over the prefill's time at the best GEMM rates this CPU reached in this run
(``gemm_peak``: one MLP-shaped GEMM, M = the prompt; or a side's own profiled GEMMs, where they ran
faster: ``ceiling_gemm_flops``): the weight GEMMs at the rate of the engine's
weight kernel, attention (fp32 in every engine) at the fp32 rate, since no part runs faster than that. One profiled call per side and length (ORT's own profiler, PyTorch's
``torch.profiler``) splits the time into the LM head, the other GEMMs, attention and the rest, each
against its FLOPs. Decode ms/token (``--decode-steps`` after a 512-token prompt) shows what the
prefill path left unchanged. The CPU's features (``harp_trt.machine``) go with every figure. Peak RSS
beside the seconds. The last stdout line is the JSON object (also written to ``--out``)."""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from harp_trt.bench._gemm_peak import gemm_peak  # noqa: E402
from harp_trt.bench._shapes import SHAPES  # noqa: E402
from harp_trt.bench._torch_side import TorchSide as _TorchBase  # noqa: E402
from harp_trt.machine import describe  # noqa: E402

__all__ = ["main", "flop_parts", "ort_profile_parts", "CATEGORIES"]

log = logging.getLogger("prefill_profile")
PACKAGES = ("onnxruntime", "onnxruntime-genai", "torch", "transformers")
CATEGORIES = ("lm_head", "gemm", "attention", "other")
REFERENCE = "torch"     # the side every speed-up is over
_GEMM_OPS = {"MatMul", "MatMulNBits", "FusedMatMul", "Gemm", "MatMulInteger", "MatMulIntegerToFloat",
             "DynamicQuantizeMatMul"}
_ATTN_OPS = {"GroupQueryAttention", "Attention", "MultiHeadAttention", "Softmax"}


# -- FLOPs ------------------------------------------------------------------------------------------
def flop_parts(cfg: dict[str, Any], seq: int, kept: int) -> dict[str, int]:
    """FLOPs of a causal prefill of ``seq`` tokens, by part (a multiply-add = 2): the LM head over
    ``kept`` positions, the decoder's weight GEMMs, and attention's scores and AV over the causal
    triangle (sum of keys 1..seq), as ``harp_trt/flops.py`` counts them."""
    h, layers, inter, vocab = (int(cfg[k]) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                     "vocab_size"))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    q, kv = heads * hd, kv_heads * hd
    per_token = 2 * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    keys = seq * (seq + 1) // 2
    return {"lm_head": 2 * h * vocab * kept, "gemm": layers * per_token * seq,
            "attention": layers * 2 * 2 * q * keys, "other": 0}


# -- profiles ---------------------------------------------------------------------------------------
def ort_profile_parts(profile_json: str | Path, lm_head: str | None) -> dict[str, float]:
    """Seconds per category of one ORT profile (``enable_profiling``'s JSON): node events by op type,
    the LM head by its node name (``engine.json``'s ``logits_to_keep.lm_head``, as ORT may rename it
    after fusing, any node whose name starts with it)."""
    parts: dict[str, float] = collections.defaultdict(float)
    for e in json.loads(Path(profile_json).read_text()):
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op, node = e["args"].get("op_name", ""), e["name"][: -len("_kernel_time")]
        if lm_head and node.startswith(lm_head):
            cat = "lm_head"
        elif op in _GEMM_OPS:
            cat = "gemm"
        elif op in _ATTN_OPS:
            cat = "attention"
        else:
            cat = "other"
        parts[cat] += e["dur"] / 1e6
    return {c: round(parts.get(c, 0.0), 6) for c in CATEGORIES}


def torch_profile_parts(prof: Any, vocab: int) -> dict[str, float]:
    """Seconds per category of a ``torch.profiler`` run (self CPU time): GEMMs by op name, the LM head
    as the GEMM whose output width is the vocabulary, attention as sdpa's kernels."""
    parts: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm"):
            shapes = [s for s in (e.input_shapes or []) if s]
            cat = "lm_head" if len(shapes) > 1 and shapes[1][-1] == vocab else "gemm"
        elif "scaled_dot_product" in e.name or "softmax" in e.name:
            cat = "attention"
        else:
            cat = "other"
        parts[cat] += e.self_cpu_time_total / 1e6
    return {c: round(parts.get(c, 0.0), 6) for c in CATEGORIES}


# -- sides ------------------------------------------------------------------------------------------
class OrtSide:
    """An ORT engine's prefill: ``chunked`` = ``OrtCausalLM.prefill`` (the generate path), else one
    call with every position's logits (the path before)."""

    def __init__(self, folder: Path, threads: int, chunked: bool, chunk: int, profile_dir: Path | None = None):
        from harp_trt.engine_spec import read_engine_spec
        from harp_trt.ort_session import OrtCausalLM

        self.lm = OrtCausalLM.from_engine(folder, intra_op_threads=threads)
        self.lm.prefill_chunk = chunk if chunked else 0
        spec = read_engine_spec(folder)
        self.chunked, self.quant = chunked, (spec.get("quant") or {}).get("mode", "none")
        self.lm_head = (spec.get("logits_to_keep") or {}).get("lm_head")
        self.folder, self.threads, self.chunk, self.profile_dir = folder, threads, chunk, profile_dir

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        mask, pos = np.ones_like(ids), np.arange(ids.shape[1])[None]
        if self.chunked:
            return self.lm.prefill(ids, mask, pos, ids.shape[1] + 1)[0][:, -1]
        return self.lm.forward(ids, mask, pos)[0][:, -1]

    def profile(self, ids: np.ndarray) -> dict[str, float]:
        from harp_trt.ort_session import OrtCausalLM

        prefix = str(self.profile_dir / f"ort_{os.getpid()}")
        lm = OrtCausalLM.from_engine(self.folder, intra_op_threads=self.threads, profile_prefix=prefix)
        lm.prefill_chunk = self.lm.prefill_chunk
        mask, pos = np.ones_like(ids), np.arange(ids.shape[1])[None]
        (lm.prefill(ids, mask, pos, ids.shape[1] + 1) if self.chunked else lm.forward(ids, mask, pos))
        path = lm.session.end_profiling()
        parts = ort_profile_parts(path, self.lm_head)
        Path(path).unlink(missing_ok=True)
        return parts

    def decode_ms(self, ids: np.ndarray, steps: int) -> float:
        _, t = self.lm.timed_generate(ids, max_new_tokens=steps + 1)
        return 1e3 * t["decode_s"] / (t["new_tokens"] - 1)


class TorchSide(_TorchBase):
    """The Hugging Face model, fp32, sdpa (``bench/_torch_side.py``, as ``ort_vs_torch.py`` times it), prefilling as its
    ``generate`` does (``logits_to_keep=1``)."""

    def __init__(self, resolved: Any, threads: int):
        super().__init__(resolved, threads)
        self.vocab = int(self.model.config.vocab_size)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        x = self.torch.from_numpy(ids)
        with self.torch.inference_mode():
            out = self.model(input_ids=x, attention_mask=self.torch.ones_like(x), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].numpy()

    def profile(self, ids: np.ndarray) -> dict[str, float]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            self.prefill(ids)
        return torch_profile_parts(prof, self.vocab)

    def decode_ms(self, ids: np.ndarray, steps: int) -> float:
        return 1e3 * statistics.median(self.decode(ids, steps))


class GenaiSide:
    def __init__(self, folder: Path, threads: int):
        from harp_trt.bench._genai_baseline import genai_engine

        self.engine = genai_engine(folder, threads)
        self.quant = "int4"

    def prefill(self, ids: np.ndarray) -> None:
        self.engine.prefill_seconds([int(t) for t in ids[0]])


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- engines ----------------------------------------------------------------------------------------
def build_engines(model: str, quants: list[str], store: Any, block: int = 32) -> tuple[Any, dict[str, Path]]:
    from harp_trt.builders.ort.builder import OrtBuildStage
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.export.config import ExportConfig
    from harp_trt.export.export import ExportStage
    from harp_trt.models import resolve_model

    resolved = resolve_model(model, store.root)
    export = ExportStage().execute(store, ExportConfig(), {"model": resolved})
    return resolved, {q: OrtBuildStage().execute(store, OrtBuildConfig(quant=q, quant_block_size=block),
                                                 {"onnx": export}).path for q in quants}


def heldout_perplexity(sides: dict[str, Any], quants: list[str], resolved: Any, store: Any, tokens: int) -> dict:
    """Perplexity of PyTorch and each ORT engine on the same held-out Wikipedia windows of 512 tokens
    (``harp_trt.data``, ``harp_trt.ppl``): the accuracy side of each engine's speed."""
    import torch
    from transformers import AutoTokenizer

    from harp_trt.data import load_corpus, token_windows
    from harp_trt.ppl import model_ids, perplexity, perplexity_from_logits_fn

    tok = AutoTokenizer.from_pretrained(str(resolved.folder))
    windows = token_windows(tok, load_corpus("wiki", store.root), "heldout", 512, tokens)
    out = {"tokens": int(windows.numel()), "seq_len": 512, REFERENCE: perplexity(sides[REFERENCE].model, windows)}
    for q in quants:
        lm = sides[f"ort_{q}"].lm

        def logits(i: int, ids: torch.Tensor, lm=lm) -> torch.Tensor:
            x = model_ids(ids).numpy()
            return torch.from_numpy(lm.forward(x, np.ones_like(x), np.arange(x.shape[1])[None])[0])

        out[f"ort_{q}"] = perplexity_from_logits_fn(logits, windows)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def measure_length(sides: dict[str, Any], ids: np.ndarray, cfg: dict[str, Any], quants: list[str], threads: int,
                   repeats: int, block: int = 32) -> dict[str, Any]:
    """One prompt length: a warm-up each, ``repeats`` interleaved timed prefills (order rotating), the
    GEMM peaks, then one profiled call per side; every side's figures and speed-up over PyTorch."""
    from harp_trt.bench.stage.latency import paired_speedup, rotation

    n, names = ids.shape[1], list(sides)
    flops, flops_all = flop_parts(cfg, n, 1), flop_parts(cfg, n, n)
    for name in names:          # warm-up: arena growth, first-call allocations
        sides[name].prefill(ids)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in rotation(names, r):
            times[name].append(_timed(lambda: sides[name].prefill(ids)))
    probe = {q: gemm_peak(n, int(cfg["hidden_size"]), int(cfg["intermediate_size"]), q, threads, block)
             for q in dict.fromkeys(("none", *quants))}
    row: dict[str, Any] = {"flops": flops, "flops_one_call": flops_all,
                           "gemm_peak_flops": {q: round(v) for q, v in probe.items()}, "sides": {}}
    figs: dict[str, dict[str, Any]] = {}
    peaks = dict(probe)
    for name in names:
        fig = figs[name] = {"seconds": round(statistics.median(times[name]), 4),
                            "samples": [round(t, 4) for t in times[name]]}
        if hasattr(sides[name], "profile"):
            fig["profile_s"] = sides[name].profile(ids)
            f = flops_all if name.endswith("_one_call") else flops
            fig["gflops_per_s"] = {c: round(f[c] / 1e9 / s, 1) for c, s in fig["profile_s"].items()
                                   if f.get(c) and s > 0}
            # a rate a side's own GEMMs reached in this run is one the CPU reached: the one-GEMM probe can
            # draw low on a shared machine (at 8192 tokens it once gave fp32 234 GFLOP/s where both
            # profiled fp32 sides' GEMMs ran at 246-252), and a ceiling below a measured time is no ceiling
            q = getattr(sides[name], "quant", "none")
            if fig["profile_s"].get("gemm"):
                peaks[q] = max(peaks.get(q, 0.0), f["gemm"] / fig["profile_s"]["gemm"])
    row["ceiling_gemm_flops"] = {q: round(v) for q, v in peaks.items()}
    # no engine's weight GEMMs beat its kernel's peak, and attention runs in fp32 in every engine
    ideal_s = {q: (flops["lm_head"] + flops["gemm"]) / v + flops["attention"] / peaks["none"] for q, v in peaks.items()}
    for name in names:
        side, fig = sides[name], figs[name]
        if side is not sides[REFERENCE]:
            sp = paired_speedup(times[REFERENCE], times[name])
            sp["ceiling"] = statistics.median(times[REFERENCE]) / ideal_s.get(side.quant, ideal_s["none"])
            fig["speedup_vs_torch"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sp.items()}
        row["sides"][name] = fig
        log.warning("prefill %d %s: %.3f s", n, name, fig["seconds"])
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2-135m")
    src.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight model of these real shapes "
                     "(bench/_shapes.py, SmolLM2's tokenizer) instead of --model; speed only (give --ppl-tokens 0)")
    p.add_argument("--tokenizer", default="smollm2-135m", help="model whose tokenizer --shape borrows")
    p.add_argument("--quant-block-size", type=int, default=32, help="int4/int8 engines' weights per scale "
                   "(build --quant-block-size; the GEMM peaks use it too)")
    p.add_argument("--workdir", default=None, help="artifact cache (default ~/.cache/harp-trt)")
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="none,int4,int8,w8a8", help="our ORT engines by --quant")
    p.add_argument("--one-call", default=None, help="engines (by --quant) also timed on the path before issue "
                                                    "36, one call with every position's logits (default: --engines)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default OrtCausalLM's)")
    p.add_argument("--genai", action="store_true", help="onnxruntime-genai's int4 model too")
    p.add_argument("--genai-block-size", type=int, default=32,
                   help="weights per scale of genai's int4 model (its builder's default 32)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--ppl-tokens", type=int, default=16384,
                   help="held-out Wikipedia tokens for each side's perplexity, windows of 512 (0: none)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = _parser()
    args = p.parse_args(argv)
    if args.shape and args.ppl_tokens:
        p.error("--shape is a random-weight model: its perplexity means nothing; give --ppl-tokens 0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    from harp_trt.memory import peak_rss_bytes
    from harp_trt.ort_session import PREFILL_CHUNK
    from harp_trt.store import ArtifactStore
    from harp_trt.versions import provenance

    chunk = args.chunk or PREFILL_CHUNK
    store = ArtifactStore(args.workdir)
    quants = [q for q in args.engines.split(",") if q]
    model = args.model
    if args.shape:
        from harp_trt.bench._pipeline_engines import shape_model

        model = str(shape_model(args.shape, args.tokenizer, 0, store.root))
    resolved, engines = build_engines(model, quants, store, args.quant_block_size)
    cfg = json.loads((resolved.folder / "config.json").read_text())
    profile_dir = Path(tempfile.mkdtemp(prefix="prefill_profile_"))
    sides: dict[str, Any] = {}
    before = quants if args.one_call is None else [q for q in args.one_call.split(",") if q]
    for q in quants:
        if q in before:
            sides[f"ort_{q}_one_call"] = OrtSide(engines[q], args.threads, False, chunk, profile_dir)
        sides[f"ort_{q}"] = OrtSide(engines[q], args.threads, True, chunk, profile_dir)
    sides[REFERENCE] = TorchSide(resolved, args.threads)
    genai_facts = None
    if args.genai:
        from harp_trt.bench._genai_baseline import build_genai_int4, genai_version

        block = args.genai_block_size
        gdir = store.root / (f"genai-int4-{resolved.digest[:16]}" + ("" if block == 32 else f"-b{block}"))
        if not (gdir / "genai_config.json").is_file():
            build_genai_int4(resolved.folder, gdir, block_size=block, accuracy_level=4)
        sides["genai_int4"] = GenaiSide(gdir, args.threads)
        genai_facts = {"folder": str(gdir), "version": genai_version(), "block_size": block}
    vocab = int(cfg["vocab_size"])
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        "issue": 36, "provenance": provenance(sys.argv[1:] if argv is None else argv, PACKAGES),
        "model": args.shape or args.model, "random_weights": bool(args.shape), "quant_block_size": args.quant_block_size,
        "machine": {**describe(args.threads), "load_avg_start": list(os.getloadavg())},
        "threads": args.threads, "repeats": args.repeats, "chunk": chunk, "engines": {q: str(e) for q, e in engines.items()},
        "genai": genai_facts, "lengths": {}}
    for n in [int(x) for x in args.lengths.split(",") if x]:
        ids = rng.integers(3, min(vocab, 20000), (1, n))
        out["lengths"][str(n)] = measure_length(sides, ids, cfg, quants, args.threads, args.repeats,
                                                args.quant_block_size)
    prompt = rng.integers(3, min(vocab, 20000), (1, 512))
    decode = {}
    for name in [f"ort_{q}" for q in quants] + [REFERENCE]:
        sides[name].decode_ms(prompt, 2)
        decode[name] = round(statistics.median(sides[name].decode_ms(prompt, args.decode_steps)
                                               for _ in range(args.repeats)), 3)
    out["decode_ms_per_token_at_512"] = decode
    if args.ppl_tokens:
        out["heldout_perplexity"] = heldout_perplexity(sides, quants, resolved, store, args.ppl_tokens)
    out["machine"]["load_avg_end"] = list(os.getloadavg())
    out["peak_rss_gb"] = round(peak_rss_bytes() / 1e9, 2)
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    sys.stdout.write(text + "\n")
    return out


if __name__ == "__main__":
    main()
