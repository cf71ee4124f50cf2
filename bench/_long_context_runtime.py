"""One runtime's figures for ``bench/long_context.py``: decode and prefill (measured interleaved),
KV bytes per token and KV capacity (measured in the runtime), each beside its ideal from
``harp_trt/flops.py``."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from harp_trt import flops
from harp_trt.builders.ort.config import weight_bytes
from harp_trt.memory import peak_rss_bytes

from ._long_context_measure import largest_fit, measure_decode, measure_prefill, prompt_length

__all__ = ["measure_runtime", "element_bytes", "pruned_form", "prefill_ideal", "capacity_allocator"]

log = logging.getLogger("long_context")


def element_bytes(runtime: str, pair, quant: str) -> tuple[float, float]:
    """(weight bytes per parameter, KV bytes per element) as the runtime holds them. ORT/genai:
    fp32 or the ``--quant`` element size (``builders/ort/config.weight_bytes``; scales and
    unquantized matrices left out: the byte ideal of a quantized engine is approximate), the
    session's KV dtype; llama.cpp: the dense GGUF's
    matrices as stored (f16, or mixed types after ``--gguf-type``: ``gguf_meta.matrix_bytes_per_param``),
    the KV type it logged (``LlamaCppEngine.kv_dtype_bytes``)."""
    if runtime == "llamacpp":
        from harp_trt.bench.stage.gguf_meta import matrix_bytes_per_param

        return matrix_bytes_per_param(pair.dense.path), float(pair.dense.kv_dtype_bytes)
    weights = weight_bytes(quant)
    if runtime == "ort":
        return weights, float(np.dtype(pair.dense.session.kv_dtype).itemsize)
    return weights, 4.0   # genai runs the ORT engine's graph: its fp32 KV


def _ceiling(m: dict[str, Any], num_layers: int, pruned: int) -> None:
    """Put L / (L - P) beside a measurement's speed-up, and flag an interval wholly above it (a bug to
    find: genai's 8192 x 4 run once reported 1.457 [1.442, 1.472] against a ceiling of 1.364)."""
    m["ceiling"] = flops.speedup_ceiling(num_layers, pruned)
    m["above_ceiling"] = flops.above_ceiling(m["speedup"]["speedup_ci95_low"], m["ceiling"])
    if m["above_ceiling"]:
        log.warning("speed-up %.3f [%.3f, %.3f] lies above its ceiling L/(L-P) = %.3f: a measurement to "
                    "investigate (threads, a peer's settings), not a gain", m["speedup"]["speedup"],
                    m["speedup"]["speedup_ci95_low"], m["speedup"]["speedup_ci95_high"], m["ceiling"])


def pruned_form(runtime: str) -> str:
    """How the runtime's HARP engine stores a pruned layer (``flops.PRUNED_FORMS``): llama.cpp's deci
    GGUF holds one folded h x h matrix (``builders/gguf/writer.py``), the ONNX graphs V and kv x h O."""
    return "folded" if runtime == "llamacpp" else "vo"


def prefill_ideal(d, pruned, seq: int, logits: str, form: str = "vo") -> dict[str, float]:
    dense = flops.prefill_flops(d, seq, None, logits, form)
    harp = flops.prefill_flops(d, seq, pruned, logits, form)
    return {"dense_flops": dense, "harp_flops": harp, "ideal": dense / harp, "pruned_form": form}


def capacity_allocator(runtime: str, engine, sequences: int = 1):
    """``alloc(tokens) -> bytes``: a KV cache for ``tokens`` positions allocated by the runtime and
    freed. llama.cpp: a one-sequence context of that many cells (its logged KV size); genai: a
    generator of ``sequences`` sequences of ``max_length`` = ``tokens / sequences`` after its first
    forward (the present buffers it holds; needs ``past_present_share_buffer``, else LookupError);
    ORT: the engine's ``StaticCache`` (K and V buffers of every KV layer) of that capacity."""
    if runtime == "llamacpp":
        return lambda n: engine.kv_allocation(n)[0]
    if runtime == "genai":
        def alloc(n):
            nbytes, positions = engine.kv_allocation(sequences, n // sequences)
            if positions != n // sequences:
                raise LookupError("genai does not allocate max_length ahead (no past_present_share_buffer)")
            return nbytes
        return alloc
    from harp_trt.ort_session import StaticCache

    lm = engine.session

    def alloc(n):
        empty = np.zeros((1, lm.kv_heads, 0, lm.head_dim), lm.kv_dtype)
        cache = StaticCache(lm, {i: (empty, empty) for i in lm.kv_layers}, n)
        return int(sum(k.nbytes + v.nbytes for k, v in cache.buffers.values()))
    return alloc


KV_PROBE_TOKENS = 512   # prompt of the KV-bytes-per-token figure
GENAI_MAX_SEQUENCES = 32   # onnxruntime-genai 0.18's Generator: "batch_size (64) must be in [1, 32]"


def _capacity(runtime: str, pair, args, L: int, P: int, least_bytes_per_token: float) -> dict[str, Any]:
    budget, step = args.kv_budget_bytes, args.capacity_step
    out: dict[str, Any] = {"budget_bytes": budget, "step_tokens": step, "ideal": L / (L - P),
                           "per_layer": True,
                           "what": "KV positions whose buffers, as the runtime sizes them, fit the budget: no memory "
                                   "cap, nothing else counted (an expectation; capacity_under_cap is measured)"}
    sequences = 1
    if runtime == "genai":
        # a genai sequence holds at most the model's context, a generator at most GENAI_MAX_SEQUENCES:
        # the fewest sequences whose max_length stays within the context up to twice the budget (the
        # search's largest probe) hold the cache, each growing by step / sequences positions (at least 1)
        most = 2 * budget / least_bytes_per_token
        sequences = max(1, -(-int(most) // pair.dense.max_positions))
        if sequences > GENAI_MAX_SEQUENCES:
            return {**out, "ratio": None, "why": f"{budget} bytes need more than {GENAI_MAX_SEQUENCES} "
                    f"sequences of {pair.dense.max_positions} positions (genai's generator limit)"}
        step = -(-step // sequences) * sequences
        out.update(step_tokens=step, sequences=sequences)
    if runtime == "llamacpp":
        # llama.cpp rounds a context up to whole blocks of cells (256 in 0.3.x): a finer step fits
        # no more tokens, and the ratio's granularity is that block
        step = max(step, pair.dense.kv_allocation(step)[1])
        out["step_tokens"] = step
    try:
        for v, e in pair.engines().items():
            out[v] = largest_fit(capacity_allocator(runtime, e, sequences), budget, step)
    except LookupError as exc:
        return {**out, "per_layer": False, "ratio": None, "why": str(exc)}
    d, h = out["dense"]["tokens"], out["harp"]["tokens"]
    out["ratio"] = h / d if d else None
    # a fit is a multiple of the step: the ratio is within this of the exact one
    out["ratio_granularity"] = (h + step) / d - h / d if d else None
    return out


def _kv_per_token(pair, vocab: int, context: int, kvb: float, d) -> dict[str, Any]:
    """Batch 1: prefill ``context`` tokens (the shortest context, at most ``KV_PROBE_TOKENS``), decode
    one, bytes the runtime holds / positions they cover."""
    from harp_trt.bench.stage.latency import random_ids

    out: dict[str, Any] = {}
    ids = random_ids(vocab, context, 11)
    for v, e in pair.engines().items():
        logits, state = e.prefill(ids)
        _, state = e.decode(logits.argmax(-1, keepdim=True), state)
        tokens = e.cache_tokens(state) or context + 1
        out[v] = e.cache_bytes(state) / tokens
        del state
    out["ratio"] = out["harp"] / out["dense"]
    out["counted"] = {"dense": flops.kv_bytes_per_token(d, None, kvb),
                      "harp": flops.kv_bytes_per_token(d, pair.pruned, kvb)}
    return out


def _kv_probe_tokens(args) -> int:
    """The prompt of the KV-bytes-per-token figure: the shortest context, at most KV_PROBE_TOKENS."""
    return min(*args.contexts, KV_PROBE_TOKENS)


def _check_contexts(pair, args) -> None:
    from harp_trt.errors import ConfigError

    prompt_length(min(args.contexts), args.warmup, args.repeats, args.decode_steps)  # before any work
    # the per-token KV figure decodes one token after its prompt
    longest = max([max(args.contexts), _kv_probe_tokens(args) + 1, *args.prefill_lens, args.cap_context])
    if longest > pair.max_positions:
        raise ConfigError(f"contexts up to {max(args.contexts)} (or a prefill of {max(args.prefill_lens, default=0)}) "
                          f"exceed the model's {pair.max_positions} positions", "give shorter --contexts / --prefill-lens")


def measure_runtime(runtime: str, pair, peers: dict[str, Any], args) -> dict[str, Any]:
    _check_contexts(pair, args)
    d, L, P = pair.dims, pair.dims.num_layers, len(pair.pruned)
    wb, kvb = element_bytes(runtime, pair, args.quant)
    engines = {**pair.engines(), **peers}
    out: dict[str, Any] = {"engines": pair.info, "weight_bytes_per_param": wb, "kv_bytes_per_element": kvb,
                           "kv_type": args.kv_type if runtime == "llamacpp" else str(np.dtype("float32")),
                           "prefill_logits": pair.dense.prefill_logits, "decode": [], "prefill": []}
    # bytes held over positions covered does not depend on the length: a short prompt says it (an 8192
    # prefill per engine would only cost minutes)
    out["kv_bytes_per_token"] = _kv_per_token(pair, d.vocab, _kv_probe_tokens(args), kvb, d)
    for c in args.contexts:
        for b in args.batches:
            m = measure_decode(engines, d.vocab, c, b, args.decode_steps, args.repeats, args.warmup, args.seed,
                               args.kv_fill)
            m["ideal"] = flops.decode_ideal(d, pair.pruned, c, b, wb, kvb, pruned_form(runtime))
            m["fraction_of_ideal"] = m["speedup"]["speedup"] / m["ideal"]["ideal"]
            _ceiling(m, d.num_layers, len(pair.pruned))
            out["decode"].append(m)
            log.info("%s decode %d x %d: dense %.1f, harp %.1f tok/s, speed-up %.3f [%.3f, %.3f], ideal %.3f",
                     runtime, c, b, m["per_engine"]["dense"]["tokens_per_s"], m["per_engine"]["harp"]["tokens_per_s"],
                     m["speedup"]["speedup"], m["speedup"]["speedup_ci95_low"], m["speedup"]["speedup_ci95_high"],
                     m["ideal"]["ideal"])
    for s in args.prefill_lens:
        m = measure_prefill(pair.engines(), d.vocab, s, args.prefill_repeats, min(args.warmup, 1), args.seed)
        m["ideal"] = prefill_ideal(d, pair.pruned, s, pair.dense.prefill_logits, pruned_form(runtime))
        _ceiling(m, d.num_layers, len(pair.pruned))
        out["prefill"].append(m)
        log.info("%s prefill %d: speed-up %.3f, ideal %.3f", runtime, s, m["speedup"]["speedup"], m["ideal"]["ideal"])
    kv = out["kv_bytes_per_token"]
    out["kv_capacity"] = _capacity(runtime, pair, args, L, P, min(kv["dense"], kv["harp"]))
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out
