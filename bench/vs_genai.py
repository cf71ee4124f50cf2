"""Our int4 engines against onnxruntime-genai's int4 CPU model of the same weights.

    pip install -e '.[genai]'
    python bench/vs_genai.py [--model smollm2-135m] [--layers 4] [--threads 2] [--repeats 3]

A user deploying a small LLM on CPUs with ONNX Runtime would pick onnxruntime-genai's int4 model
(its model builder, ``-p int4 -e cpu``). This script builds it from the same Hugging Face folder
(``bench/_genai_baseline.py``), builds our dense and HARP engines with ``--quant int4`` (the same
MatMulNBits settings: block 32, symmetric, accuracy level 4), and times the three in one process at
the same thread count, interleaved (every repeat runs each engine once, the order rotating):
prefill of 512 and 2048 tokens (seconds to the first token) and greedy decode (tokens/s of
``--decode-tokens`` steps after a 512-token prompt). Medians over the repeats.

``ideal_speedup`` is the plan's byte ideal for decode: the bytes one decode step reads (quantized
weights: packed values, scales, zero points; plus the KV cache at the decode context) of the dense
int4 engine over the HARP int4 engine, read from the two built graphs.

The last stdout line is one JSON object::

    {"threads": n, "ideal_speedup": x, "genai_int4": E, "dense_int4": E, "harp_int4": E, ...}

with each E = ``{"prefill_512_s", "prefill_2048_s", "decode_tokens_per_s"}``. Targets: dense_int4
decode >= 0.9 x genai's; harp_int4 decode >= genai's x ideal_speedup."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PREFILLS = (512, 2048)
DECODE_CONTEXT = 512


def _graph_bytes(folder: Path) -> int:
    """Bytes of the MatMulNBits weights (packed values, scales, zero points) of an engine graph."""
    import onnx

    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    sizes = {}
    for t in m.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        sizes[t.name] = n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return sum(sizes.get(i, 0) for node in m.graph.node if node.op_type == "MatMulNBits" for i in node.input[1:])


def _byte_ideal(dense: Path, harp: Path, context: int) -> dict:
    from harp_trt.engine_spec import read_engine_spec

    spec = {k: read_engine_spec(f) for k, f in (("dense", dense), ("harp", harp))}
    out = {}
    for k, f in (("dense", dense), ("harp", harp)):
        out[k] = {"weight_bytes": _graph_bytes(f), "kv_bytes": spec[k]["kv"]["bytes_per_token"] * context}
        out[k]["bytes_per_step"] = out[k]["weight_bytes"] + out[k]["kv_bytes"]
    out["ideal_speedup"] = round(out["dense"]["bytes_per_step"] / out["harp"]["bytes_per_step"], 4)
    return out


class _Ours:
    """Our ORT engine behind the same measurements as the genai engine (``_genai_baseline.genai_engine``)."""

    def __init__(self, folder: Path, threads: int):
        from harp_trt.ort_session import OrtCausalLM

        self.lm = OrtCausalLM.from_engine(folder, intra_op_threads=threads)

    def _prefill(self, ids):
        import numpy as np

        x = np.asarray(ids, np.int64)[None]   # generate's prefill: chunked, the last position's logits
        logits, cache = self.lm.prefill(x, np.ones_like(x), np.arange(x.shape[1])[None], x.shape[1] + 1)
        return logits[:, -1].argmax(-1)[:, None], cache

    def prefill_seconds(self, ids) -> float:
        t = time.perf_counter()
        self._prefill(ids)
        return time.perf_counter() - t

    def decode_tokens_per_s(self, ids, n: int) -> float:
        """``OrtCausalLM.generate`` (the product's decode loop: in-place KV on GQA engines), greedy,
        no stop tokens: ``n`` steps after the first token, timed between the streamer's ticks."""
        import numpy as np

        _, t = self.lm.timed_generate(np.asarray(ids, np.int64)[None], max_new_tokens=n + 1)
        return (t["new_tokens"] - 1) / t["decode_s"]

    def close(self) -> None:
        self.lm = None


def _engines(args, store):
    """(plan, dense int4 engine folder, HARP int4 engine folder, genai folder, build facts)."""
    from harp_trt.bench._genai_baseline import build_genai_int4, genai_graph_facts
    from harp_trt.builders.ort.builder import OrtBuildStage
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.calib.config import CalibrateConfig
    from harp_trt.models import resolve_model
    from harp_trt.pipeline import run_build

    resolved = resolve_model(args.model, store.root)
    calib = CalibrateConfig.from_dict({"layers": args.layers, "tokens": args.tokens, "seq_len": args.seq_len,
                                       "alpha_grid": tuple(float(a) for a in args.alpha_grid.split(","))})
    quant = OrtBuildConfig(quant="int4", quant_block_size=32, quant_symmetric=True, quant_accuracy_level=4)
    res = run_build(args.model, calib, store, backend="ort", configs={"build-ort": quant})
    harp = res.artifact("build")
    dense = OrtBuildStage().execute(store, quant, {"onnx": res.artifact("export")})
    genai_dir = store.root / f"genai-int4-{resolved.digest[:16]}"
    facts = {}
    if not (genai_dir / "genai_config.json").is_file():
        facts["build"] = build_genai_int4(resolved.folder, genai_dir, block_size=32, accuracy_level=4)
    facts["graph"] = genai_graph_facts(genai_dir)
    return res.plan, dense.path, harp.path, genai_dir, facts


def _peak_rss_bytes() -> int:
    from harp_trt.memory import peak_rss_bytes  # the one reading of getrusage into bytes

    return peak_rss_bytes()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=4, help="P: layers HARP prunes (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=2048, help="calibration tokens (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--alpha-grid", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    import numpy as np

    from harp_trt.bench._genai_baseline import GenaiUnavailableError, genai_engine, genai_version
    from harp_trt.store import ArtifactStore

    if genai_version() is None:
        print(json.dumps({"error": "onnxruntime-genai is not installed",
                          "hint": "pip install -e '.[genai]'"}))
        return 2
    store = ArtifactStore(args.workdir)
    try:
        plan, dense_dir, harp_dir, genai_dir, facts = _engines(args, store)
    except GenaiUnavailableError as e:
        print(json.dumps({"error": str(e)}))
        return 2
    ideal = _byte_ideal(dense_dir, harp_dir, DECODE_CONTEXT + args.decode_tokens // 2)
    engines = {"genai_int4": genai_engine(genai_dir, args.threads), "dense_int4": _Ours(dense_dir, args.threads),
               "harp_int4": _Ours(harp_dir, args.threads)}
    rng = np.random.default_rng(0)
    prompts = {n: [int(t) for t in rng.integers(3, 20000, n)] for n in PREFILLS}
    names = list(engines)
    for name in names:  # warm-up: one short prefill and decode each
        engines[name].prefill_seconds(prompts[512][:64])
        engines[name].decode_tokens_per_s(prompts[512][:64], 4)
    samples = {n: {"prefill_512_s": [], "prefill_2048_s": [], "decode_tokens_per_s": []} for n in names}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            e = engines[name]
            for n in PREFILLS:
                samples[name][f"prefill_{n}_s"].append(e.prefill_seconds(prompts[n]))
            samples[name]["decode_tokens_per_s"].append(e.decode_tokens_per_s(prompts[DECODE_CONTEXT], args.decode_tokens))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{n} decode {samples[n]['decode_tokens_per_s'][-1]:.1f} tok/s" for n in names), file=sys.stderr)
    med = {n: {k: round(statistics.median(v), 4) for k, v in s.items()} for n, s in samples.items()}
    g, d, h = (med[n]["decode_tokens_per_s"] for n in names)
    out = {"threads": args.threads, "ideal_speedup": ideal["ideal_speedup"], **med,
           "targets": {"dense_vs_genai_decode": round(d / g, 3), "dense_target": 0.9,
                       "dense_met": d >= 0.9 * g, "harp_vs_genai_decode": round(h / g, 3),
                       "harp_target": ideal["ideal_speedup"], "harp_met": h >= g * ideal["ideal_speedup"],
                       "harp_vs_dense_decode": round(h / d, 3)},
           "samples": samples, "bytes_per_decode_step": {k: ideal[k] for k in ("dense", "harp")},
           "plan": {"layers": list(plan.layers), "alphas": list(plan.alphas)}, "repeats": args.repeats,
           "decode_tokens": args.decode_tokens, "decode_context": DECODE_CONTEXT,
           "versions": {"onnxruntime_genai": genai_version()}, "genai": facts,
           "peak_rss_gb": round(_peak_rss_bytes() / 1e9, 2)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
