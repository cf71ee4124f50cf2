"""Export a Hugging Face ``*ForCausalLM`` (fp32) to ONNX with a KV cache: the graph every later
stage (rewrite, ORT build) starts from.

I/O contract (``rewrite`` surgery and ``OrtCausalLM`` depend on it exactly):

* inputs  ``input_ids`` [B, S] int64, ``attention_mask`` [B, P+S] int64 (1 = token, 0 = left
  padding), ``position_ids`` [B, S] int64, and for every layer i that has a KV cache
  ``past_key_values.{i}.key`` / ``past_key_values.{i}.value`` [B, kv_heads, P, head_dim] fp32;
* outputs ``logits`` [B, S, V] fp32 and ``present.{i}.key`` / ``present.{i}.value``
  [B, kv_heads, P+S, head_dim] (the past with the new tokens appended).

B, S and P are dynamic (``batch``, ``seq``, ``past``; the mask's axis is ``total``). A model
already patched by :func:`harp_trt.harp.apply_harp` exports with no KV I/O for its pruned layers.
The graph carries ``harp_trt.export`` (JSON) in its metadata: model type, layer counts, heads,
head_dim, which layers have KV and the HARP alphas. Weights go to ``model.onnx.data`` only when
they exceed 2 GB (the protobuf limit); below that ``model.onnx`` is self-contained.

How it is exported: ``torch.onnx.export(dynamo=True, opset 23)`` on a thin wrapper that takes the
KV cache as flat tensors and builds the ``DynamicCache`` inside forward (transformers 5 takes a
``cache`` object, not tuples). sdpa attention becomes the opset-23 ``Attention`` op fed by a boolean
[B, 1, S, P+S] causal+padding mask, with ``RotaryEmbedding`` and ``RMSNormalization`` ops; every
node's ``pkg.torch.onnx.name_scopes`` metadata names its HF module. Gemma2 is exported with eager
attention (sdpa cannot soft-cap), so its attention stays as MatMul/Tanh/Softmax.

Which form is fastest in ONNX Runtime on CPU (SmolLM2-135M, fp32, 2 threads; measured on a
shared 2-core machine, so absolute times are noisy, comparisons were interleaved):

* attention alone at 2048 tokens, per layer: opset-23 ``Attention`` with the exported bool mask
  131-142 ms (it materialises the full S x T scores; repeat_kv'd or native GQA K/V alike),
  ``com.microsoft::GroupQueryAttention`` 46-72 ms (with or without an ``attention_bias``),
  PyTorch sdpa causal 73-112 ms;
* whole graph, exported form vs the GroupQueryAttention form: prefill 512 2.70 vs 2.25 s,
  prefill 2048 10.5 vs 7.5 s, decode 71 vs 60 ms/token. With GQA, MatMul is 76-85 % of the time
  and ORT's MLAS GEMMs match or beat PyTorch's per shape.

So the dense export stays portable (standard ops, what the rewrite rules match) and the ORT
builder converts ``Attention`` to ``GroupQueryAttention`` in a separate pass (``harp_trt.builders.ort.gqa``)
that keeps this I/O contract. ``bench/ort_vs_torch.py`` measures engine vs PyTorch."""
from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..dims import ModelDims
from ..errors import ConfigError, GraphError, PreconditionError
from ..onnx_io import (EXPORT_META_KEY, EXTERNAL_DATA_SUFFIX, EXTERNAL_DATA_THRESHOLD, MODEL_FILE, copy_tokenizer,
                      input_names, output_names, read_export_meta)
from ..config import digest_of
from ..stage import CompactIntermediates, Stage
from ..weights import hf_config
from .config import ExportConfig
from .initializers import bind_lazily, drop_dead_initializers, fold_weight_transposes, optimize

__all__ = ["export_dense", "export_folder", "kv_layers_of", "ExportStage",
           "exporter_versions"]

log = logging.getLogger(__name__)
PROBE_DIR = "probe-model"   # a probe export's model folder (harp_trt.probe)


def kv_layers_of(model: nn.Module) -> list[int]:
    """Indices of the decoder layers that keep attention (and so a KV cache)."""
    from ..families import family_of
    from ..harp import HarpAttention

    layers = family_of(model.config).layers(model)
    return [i for i, l in enumerate(layers) if not isinstance(l.self_attn, HarpAttention)]



def exporter_versions() -> dict[str, str]:
    import onnx
    import onnxscript
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxscript": onnxscript.__version__}


# ---- the wrapper -----------------------------------------------------------------------------
class _FlatKV(nn.Module):
    """``(input_ids, attention_mask, position_ids, [k0, v0, k1, v1, ...]) -> (logits, k0', v0', ...)``
    for the layers in ``kv_layers``; the others get a ``DummyLayer`` (no cache)."""

    def __init__(self, model: nn.Module, kv_layers: list[int], num_layers: int):
        super().__init__()
        self.model = model
        self.kv_layers = list(kv_layers)
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, past: list[torch.Tensor]):
        from transformers.cache_utils import DynamicCache, DynamicLayer

        from ..hf_compat import cache_kwarg, no_kv_layer

        cache = DynamicCache()
        # plain DynamicLayers everywhere: sliding-window layers keep the whole past too (the mask
        # applies the window), so every present has the same [B, kv, P+S, hd] layout
        cache.layers = [no_kv_layer(cache) for _ in range(self.num_layers)]  # pruned slots, kept ones replaced below
        for j, i in enumerate(self.kv_layers):
            k, v = past[2 * j], past[2 * j + 1]
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            cache.layers[i] = layer
        name = cache_kwarg(self.model)  # past_key_values= before transformers 5.24
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{name: cache})
        cache = getattr(out, name)
        result = [out.logits]
        for i in self.kv_layers:
            result += [cache.layers[i].keys, cache.layers[i].values]
        return tuple(result)


def _example(model: nn.Module, kv_layers: list[int], batch: int, seq: int, past: int, seed: int = 0):
    d = ModelDims.from_config(model.config)
    kv, hd = d.kv_heads, d.head_dim
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    pos = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    dtype = next(model.parameters()).dtype
    flat = [torch.randn(batch, kv, past, hd, generator=g).to(dtype) for _ in range(2 * len(kv_layers))]
    return ids, mask, pos, flat


def _meta(model: nn.Module, kv_layers: list[int], dtype: str = "float32") -> dict[str, Any]:
    cfg = model.config
    d = ModelDims.from_config(cfg)
    heads, kv, hd = d.heads, d.kv_heads, d.head_dim
    return {
        "format": "harp-export/1", "model_type": cfg.model_type, "num_layers": cfg.num_hidden_layers,
        "num_heads": heads, "kv_heads": kv, "head_dim": hd, "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "kv_layers": kv_layers,
        "harp_alphas": {str(k): v for k, v in (getattr(cfg, "harp_alphas", None) or {}).items()},
        "sliding_window": getattr(cfg, "sliding_window", None),
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "layer_windows": list(d.windows),  # per layer, None = full: FamilySpec.layer_windows, the one rule
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "dtype": dtype, "versions": exporter_versions(),
    }


def _dims_args(dyn_kv: int):
    return [{0: "batch", 1: "seq"}, {0: "batch", 1: "total"}, {0: "batch", 1: "seq"},
            [{0: "batch", 2: "past"}] * dyn_kv]


def _fake_model(cfg, dtype: torch.dtype, attn_implementation: str):
    """The model with fake parameters (shapes and dtypes on the CPU device, no memory), and its
    fake-tensor mode. Tracing it gives the graph a real model gives, op for op (the meta device
    does not: views trace differently there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), mode


def _trace(fake_model: nn.Module, mode, kv_layers: list[int], num_layers: int, opset: int):
    """``torch.onnx.export`` of a model whose parameters are fake: the graph is traced from shapes
    alone; every initializer is bound afterwards (``bind_lazily``)."""
    wrapper = _FlatKV(fake_model, kv_layers, num_layers).eval()
    ids, mask, pos, flat = _example(fake_model, kv_layers, batch=2, seq=5, past=3)
    args = (mode.from_tensor(ids), mode.from_tensor(mask), mode.from_tensor(pos), [mode.from_tensor(t) for t in flat])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            return torch.onnx.export(
                wrapper, args, None, input_names=input_names(kv_layers), output_names=output_names(kv_layers),
                dynamic_shapes=_dims_args(2 * len(kv_layers)), opset_version=opset, dynamo=True,
                optimize=False, verbose=False)
        except Exception as e:  # torch.export raises many types; keep the first line
            msg = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
            raise GraphError("export", f"torch.onnx.export failed for {fake_model.config.model_type}: {msg}",
                             "check the model loads and runs a forward pass with cache=DynamicCache()") from e


def _finish(program, meta: dict[str, Any], out_dir: Path, compact: bool = False) -> Path:
    """Optimise (as ``torch.onnx.export(optimize=True)`` does), stamp the metadata and save; weights
    go to ``model.onnx.data`` only past the protobuf limit, written one initializer at a time.
    Each weight is saved once: the folded transposes replace their sources, and any initializer
    the graph no longer reads is dropped (a dead copy doubled the fp32 export on disk). ``compact``:
    weights read from half-width safetensors are stored at that width (``harp_trt.compact``)."""
    import onnx_ir as ir

    from ..compact import compact as compact_weights, narrow_bytes

    fold_weight_transposes(program.model)
    optimize(program.model)
    dead = drop_dead_initializers(program.model)
    if dead:
        log.info("dropped %d unused initializers (%s)", len(dead), ", ".join(dead[:5]))
    program.model.metadata_props[EXPORT_META_KEY] = json.dumps(meta)
    path = out_dir / MODEL_FILE
    data = MODEL_FILE + EXTERNAL_DATA_SUFFIX
    for stale in (path, out_dir / data):
        stale.unlink(missing_ok=True)
    weight_bytes = narrow_bytes(program.model) if compact else sum(
        v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)
    if compact:
        meta = {**meta, "storage": "compact"}
        program.model.metadata_props[EXPORT_META_KEY] = json.dumps(meta)
        log.info("compact storage: %d weights stored at half width", compact_weights(program.model))
    if weight_bytes > EXTERNAL_DATA_THRESHOLD:
        ir.save(program.model, str(path), external_data=data)
    else:
        ir.save(program.model, str(path))
    log.info("wrote %s (%.1f MB weights%s)", path, weight_bytes / 1e6,
             ", external data" if weight_bytes > EXTERNAL_DATA_THRESHOLD else "")
    return path


def export_dense(model: nn.Module, out_dir: Path, opset: int = 23) -> Path:
    """Export a loaded ``model`` (a ``*ForCausalLM``, fp32, optionally HARP-patched) to
    ``out_dir/model.onnx`` following the module's I/O contract; returns the path. The graph is
    traced on a fake-tensor twin and its initializers are taken from ``model``."""
    _check_opset(opset)
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ConfigError(f"export takes an fp32 model, got {dtype}", "load it with dtype='float32'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    kv_layers = kv_layers_of(model)
    log.info("exporting %s (%d layers, KV for %d)", model.config.model_type, model.config.num_hidden_layers,
             len(kv_layers))
    from ..families import family_of
    from ..harp import apply_harp, harp_alphas

    real = {f"model.{n}": t for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    fake, mode = _fake_model(copy.deepcopy(model.config), dtype, model.config._attn_implementation)
    alphas = harp_alphas(model)
    if alphas:
        apply_harp(fake, alphas, family_of(model.config))
    program = _trace(fake, mode, kv_layers, model.config.num_hidden_layers, opset)
    bind_lazily(program, lambda n: real[n], {n: (t.dtype, tuple(t.shape)) for n, t in real.items()})
    return _finish(program, _meta(model, kv_layers, "float32"), out_dir)


def export_folder(folder: Path, out_dir: Path, opset: int = 23, dtype: str = "float32",
                  storage: str = "full") -> Path:
    """Export the dense model in a Hugging Face ``folder`` without loading it: trace a fake-tensor
    skeleton, then stream each initializer from the safetensors files (cast to ``dtype``) into
    the saved graph. Peak memory: the largest single tensor, plus the exporter. ``storage="compact"``
    (fp32 only) keeps weights read from bf16/fp16 files at that width on disk (``harp_trt.compact``)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..families import family_of
    from ..weights import WeightReader

    _check_opset(opset)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"export dtype must be float32, float16 or bfloat16, got {dtype!r}")
    tdt = getattr(torch, dtype)
    cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    family = family_of(cfg)
    fake, mode = _fake_model(cfg, tdt, family.attn_implementation)
    with init_empty_weights(include_buffers=False):  # real buffers (rotary tables, embedding scales)
        shell = AutoModelForCausalLM.from_config(cfg, dtype=tdt, attn_implementation=family.attn_implementation)
    buffers = {f"model.{n}": b.to(tdt) if b.is_floating_point() else b for n, b in shell.named_buffers()}
    del shell
    reader = WeightReader(folder)
    embed = family.weight_name("embed")

    def hf_name(n: str) -> str:
        hf = n[len("model."):]
        return hf if hf in reader or hf != family.lm_head_name else embed  # tied head

    shapes = {n: (b.dtype, tuple(b.shape)) for n, b in buffers.items()}
    for n, p in fake.named_parameters(remove_duplicate=False):
        shapes[f"model.{n}"] = (tdt, tuple(p.shape))

    def fetch(n: str) -> torch.Tensor:
        return buffers[n] if n in buffers else reader.get(hf_name(n), tdt)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kv_layers = list(range(cfg.num_hidden_layers))
    log.info("exporting %s from %s (%d layers, %s, streamed)", cfg.model_type, folder, cfg.num_hidden_layers, dtype)
    program = _trace(fake, mode, kv_layers, cfg.num_hidden_layers, opset)
    bind_lazily(program, fetch, shapes)
    compact = storage == "compact" and tdt == torch.float32
    if compact:
        from ..compact import mark

        from .initializers import _ir_tensor

        narrow = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
        for n, v in program.model.graph.initializers.items():
            if n not in buffers and hf_name(n) in reader:  # saved as read: never widened
                mark(v, narrow.get(reader.spec(hf_name(n)).dtype), lambda n=n: _ir_tensor(reader.get(hf_name(n)), n))
    return _finish(program, _meta(fake, kv_layers, dtype), out_dir, compact)


def _check_opset(opset: int) -> None:
    if opset < 23:
        raise ConfigError(f"opset {opset} is too old: the export needs opset >= 23 "
                          "(Attention, RotaryEmbedding, RMSNormalization)")


# ---- the stage -------------------------------------------------------------------------------
class ExportStage(CompactIntermediates, Stage[ExportConfig]):
    """inputs: ``{"model": ResolvedModel}``. Writes ``model.onnx`` (+ ``model.onnx.data`` over
    2 GB), the tokenizer and config files, and a manifest with the KV layout and the numeric check.

    The key hashes the weights' digest, the opset and the exporter versions (not the plan), so
    every plan tried on one model shares one export."""

    name = "export"
    # code version: the import closure of this module (harp_trt.codekey), which does not reach the
    # rewrite rules (rules/, passes.py): a change there must not re-export (minutes for a 7B
    # model). Keep it so: import what the export needs from its own modules, never from rules.
    version = 2
    outputs = ("model.onnx", "config.json")
    intermediate = ("model.onnx", PROBE_DIR + "/model.safetensors")

    def requirements(self, config: ExportConfig) -> tuple[tuple[str, str], ...]:
        return (("onnxruntime", "the export's check against PyTorch needs it"),)

    def key_material(self, config: ExportConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
        base = super().key_material(config, inputs)
        resolved = inputs.get("model")
        plan = inputs.get("plan") if config.probe else None
        probe = {"probe_plan": digest_of(plan.to_dict())} if plan is not None else {}
        return {**base, "model_digest": getattr(resolved, "digest", None), "exporter": exporter_versions(), **probe}

    def check_preconditions(self, config: ExportConfig, inputs: Mapping[str, Any]) -> None:
        resolved = inputs.get("model")
        if resolved is None or not hasattr(resolved, "folder"):
            raise PreconditionError(self.name, "needs inputs={'model': ResolvedModel}",
                                    "resolve it with harp_trt.models.resolve_model(ref, cache_root)")
        if not (Path(resolved.folder) / "config.json").is_file():
            raise PreconditionError(self.name, f"model folder {resolved.folder} has no config.json")
        if config.probe and inputs.get("plan") is None:
            raise PreconditionError(self.name, "a probe export needs inputs['plan'] (the plan whose layer forms it holds)")

    def run(self, config: ExportConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        from ..families import family_of
        from ..verify import VerifyConfig, verify_rewrite

        resolved = inputs["model"]
        folder, probe = Path(resolved.folder), None
        if config.probe:  # the plan's probe model (harp_trt.probe), written from the checkpoint
            from ..probe import probe_layers, write_probe_folder

            plan = inputs["plan"]
            probe = write_probe_folder(folder, probe_layers(plan.num_layers, plan.alpha_map), Path(out_dir) / PROBE_DIR)
            probe["folder"] = PROBE_DIR
            folder = Path(out_dir) / PROBE_DIR
        path = export_folder(folder, Path(out_dir), opset=config.opset, dtype=config.dtype, storage=config.storage)
        family = family_of(hf_config(folder))
        check = None
        if config.dtype == "float32" and (config.storage == "full" or config.probe):
            # half-precision graphs are for GPU engines (checked there); a compact full graph is
            # checked through its probe (harp_trt.probe) in the rewrite
            res = verify_rewrite(path, folder, {}, VerifyConfig(rtol=config.verify_atol, decode_steps=4,
                                                                 greedy_steps=4))
            check = {"logits": res.max_abs_diff, "tolerance": res.tolerance, "decode_steps": 4,
                     "reference": "layer by layer from the safetensors files"}
        copied = copy_tokenizer(Path(resolved.folder), Path(out_dir))
        meta = read_export_meta(path)
        return {"model": resolved.to_dict(), "family": family.name, "onnx": path.name,
                "external_data": (Path(out_dir) / (MODEL_FILE + EXTERNAL_DATA_SUFFIX)).exists(), "kv_layers": meta["kv_layers"],
                "num_layers": meta["num_layers"], "kv_heads": meta["kv_heads"], "head_dim": meta["head_dim"],
                "storage": config.storage, "probe": probe,
                "verify": check, "files": copied, "versions": meta["versions"]}
