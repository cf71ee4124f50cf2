"""The PyTorch side of ``bench/gpu_prefill.py`` and ``bench/gpu_check.py``: a dense model of one of
``bench/_shapes.py``'s shapes with random weights built on the device, its HARP copy
(``harp_trt.harp.apply_harp``), prefill timed with the fastest attention there (FlashAttention-2,
else sdpa restricted to its flash / memory-efficient kernels), dense and HARP interleaved, and decode
from a KV cache filled with random tensors at the largest batch that fits in free memory
(``max_batch``: the smaller HARP cache fits more sequences)."""
from __future__ import annotations

import copy
import sys
import time

from harp_trt.bench._gpu_common import prefill_row
from harp_trt.bench._shapes import SHAPES


def build_models(shape: str, layers: int, device, dtype):
    """(dense, harp, attention implementation). Weights are created on ``device`` directly."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harp_trt.harp import apply_harp

    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    attn = "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        dense = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).eval()
    harp = copy.deepcopy(dense)
    n = cfg.num_hidden_layers
    apply_harp(harp, {i: 1.0 for i in range(n - layers, n)})
    return dense, harp, attn


def sync(device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA): timings end when the GPU is done."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sdpa_context(device):
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def time_prefill(models: dict, seq_lens, repeats: int, warmup: int, device, vocab: int) -> list[dict]:
    import torch

    rows = []
    for seq in seq_lens:
        ids = torch.randint(0, vocab, (1, seq), device=device, generator=None)
        samples: dict[str, list[float]] = {v: [] for v in models}
        for r in range(warmup + repeats):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for v in order:
                sync(device)
                t0 = time.perf_counter()
                with torch.inference_mode(), _sdpa_context(device):
                    models[v](input_ids=ids, use_cache=False, logits_to_keep=1)
                sync(device)
                if r >= warmup:
                    samples[v].append(time.perf_counter() - t0)
        rows += [prefill_row(v, seq, xs) for v, xs in samples.items()]
        d = next(r for r in rows if r["seq_len"] == seq and r["variant"] == "dense")
        h = next(r for r in rows if r["seq_len"] == seq and r["variant"] == "harp")
        print(f"prefill {seq:>6}: dense {d['mean_s']:.4f}±{d['ci95_s']:.4f} s  harp {h['mean_s']:.4f}±"
              f"{h['ci95_s']:.4f} s  x{d['mean_s'] / h['mean_s']:.3f}", file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _random_cache(model, batch: int, context: int, device, dtype):
    import torch
    from transformers.cache_utils import DynamicCache, DynamicLayer

    from harp_trt.dims import attention_dims
    from harp_trt.harp import HarpAttention
    from harp_trt.hf_compat import no_kv_layer

    _, kv, hd = attention_dims(model.config)
    cache = DynamicCache()
    layers = []
    for layer in model.model.layers:
        if isinstance(layer.self_attn, HarpAttention):
            layers.append(no_kv_layer(cache))
            continue
        k = torch.randn(batch, kv, context, hd, device=device, dtype=dtype)
        v = torch.randn(batch, kv, context, hd, device=device, dtype=dtype)
        dl = DynamicLayer()
        dl.lazy_initialization(k, v)
        dl.keys, dl.values = k, v
        layers.append(dl)
    cache.layers = layers
    return cache


def kv_bytes_per_token(model, dtype_bytes: int) -> int:
    """KV-cache bytes per token of one sequence: layers HARP pruned keep no cache."""
    from harp_trt.dims import attention_dims
    from harp_trt.kvcache import kv_cache_bytes
    from harp_trt.harp import HarpAttention

    _, kv, hd = attention_dims(model.config)
    kept = sum(1 for l in model.model.layers if not isinstance(l.self_attn, HarpAttention))
    return kv_cache_bytes(kv, hd, dtype_bytes, layers=kept)


def max_batch(models: dict, context: int, steps: int, fraction: float, cap: int, device, dtype_bytes: int) -> dict:
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = 1 << 30
    # leave room for the step's activations and logits (batch x vocab in fp32)
    out = {}
    for v, m in models.items():
        per_seq = kv_bytes_per_token(m, dtype_bytes) * (context + steps) + m.config.vocab_size * 4 * 2
        out[v] = int(max(1, min(cap, (free * fraction) // per_seq)))
    return out


def time_decode(models: dict, batches: dict, context: int, steps: int, device, dtype, vocab: int) -> list[dict]:
    import torch

    from harp_trt.hf_compat import cache_kwarg

    rows = []
    plan = [(v, batches[v], "max_batch") for v in models] + [(v, batches["dense"], "dense_batch") for v in models]
    for v, b, kind in plan:
        m = models[v]
        cache = _random_cache(m, b, context, device, dtype)
        tok = torch.randint(0, vocab, (b, 1), device=device)
        kw = {cache_kwarg(m): cache, "use_cache": True}  # past_key_values= before transformers 5.24
        with torch.inference_mode(), _sdpa_context(device):
            m(input_ids=tok, **kw)  # warm-up step
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = m(input_ids=tok, **kw).logits[:, -1].argmax(-1, keepdim=True)
            sync(device)
        dt = time.perf_counter() - t0
        rows.append({"variant": v, "batch": b, "kind": kind, "context": context, "steps": steps,
                     "ms_per_step": dt / steps * 1e3, "tokens_per_s": b * steps / dt,
                     "kv_bytes_per_token": kv_bytes_per_token(m, torch.finfo(dtype).bits // 8)})
        print(f"decode {v:>5} batch {b:>4} ({kind}): {rows[-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
        # every reference to this batch's KV goes before the next is allocated: ``kw`` held the
        # dense cache while the HARP batch, sized from free memory, was allocated (OOM on an H200)
        del cache, kw, tok
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
