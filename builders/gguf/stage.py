"""``GgufStage``: plan + Hugging Face model -> a llama.cpp ``deci`` GGUF, verified in llama.cpp.

Artifact layout (``<cache>/gguf-<key>/``)::

    manifest.json          the body below, plus the stage record
    harp_gguf.json         the same body: per-layer table, KV bytes per token, verification
    plan.json              the recipe (absent for the dense model)
    model.gguf             the deci GGUF (``writer.py``), f32 / f16 / bf16
    model-<type>.gguf      the same quantized by llama.cpp's ``llama_model_quantize`` (with gguf_type)

Inputs: ``{"plan": Plan, "model": ResolvedModel}``; without ``plan`` the dense model is written
(same writer, every layer kept): the baseline a llama.cpp bench compares with.

KV bytes per token are llama.cpp's own accounting (``probe.kv_cache``: the KV buffers its
``llama_kv_cache`` constructor allocates and logs, f16 cache) with flash attention on and off; the
pruned layers' savings need flash attention (without it llama.cpp pads every layer's V cache to the
widest layer, ``src/llama-kv-cache.cpp`` "[TAG_V_CACHE_VARIABLE]"). ``kv_bytes_per_token_dense`` is the
same rule applied to every layer.

Verification (``verify``): llama.cpp's logits of the written file (f32 KV cache, one prefill) against
the PyTorch HARP reference run layer by layer in fp32 (``harp_trt.layerwise.LayerStack`` with
``harp_trt.harp.apply_harp``, half-precision files against a reference rounded to the same dtype),
max |diff| <= ``VERIFY_TOLERANCE[dtype]`` x max(1, max |reference logit|); and llama.cpp's greedy tokens
(with its KV cache) equal the reference's argmax on the same sequence teacher-forced."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping

from harp_trt.config import digest_of
from harp_trt.dims import ModelDims
from harp_trt.errors import ConfigError, PreconditionError, VerificationError
from harp_trt.families import family_of
from harp_trt.onnx_io import check_plan_weights, tokenizer_digest
from harp_trt.plan import Plan
from harp_trt.stage import Stage

from .config import CLI, GgufConfig
from .writer import check_supported, deci_layers, hf_config, kv_bytes_per_token, write_deci_gguf

__all__ = ["GgufStage", "deploy_gguf", "choose_vocab", "vocab_file", "STAGE", "REPORT", "MODEL_FILE", "VERIFY_TOLERANCE", "quantized_name"]

log = logging.getLogger(__name__)
STAGE = "gguf"
REPORT = "harp_gguf.json"
MODEL_FILE = "model.gguf"
FORMAT = "harp-gguf/1"
# llama.cpp vs PyTorch HARP reference: max |logit diff| / max(1, max |reference logit|)
VERIFY_TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "bf16": 2e-2}
CHECK_TEXT = "Hello world! The quick brown fox, 42 times: it's fine.\n  Tabs\tand    spaces"
GREEDY_PROMPT = 8
PROMPT_TEXT = "The capital of France is Paris. The capital of Germany is"  # tokenized by the file's own vocab


def quantized_name(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


class GgufStage(Stage[GgufConfig]):
    name: ClassVar[str] = STAGE
    version: ClassVar[int] = 1
    outputs: ClassVar[tuple[str, ...]] = (MODEL_FILE, REPORT)

    def key_material(self, config, inputs):
        base = super().key_material(config, inputs)
        plan, model = inputs.get("plan"), inputs.get("model")
        return {**base, "plan": digest_of(plan.to_dict()) if isinstance(plan, Plan) else "dense",
                "model_digest": getattr(model, "digest", None),
                "tokenizer": tokenizer_digest(Path(model.folder)) if model is not None else None}

    def requirements(self, config: GgufConfig) -> tuple[tuple[str, str], ...]:
        return (("llama_cpp", "llama.cpp writes, checks and quantizes the GGUF"),)

    def check_preconditions(self, config: GgufConfig, inputs: Mapping[str, Any]) -> None:
        plan, model = inputs.get("plan"), inputs.get("model")
        if plan is not None and not isinstance(plan, Plan):
            raise PreconditionError(self.name, "input 'plan' is not a harp_trt.plan.Plan",
                                    "pass Plan.load(<calibrate artifact>), or no plan for the dense model")
        if model is None or not hasattr(model, "folder"):
            raise PreconditionError(self.name, "input 'model' is missing or not a resolved model reference",
                                    "pass harp_trt.models.resolve_model(ref, cache_root)")
        cfg = hf_config(model.folder)
        family = family_of(cfg)
        dims = ModelDims.from_config(cfg)
        if plan is not None:
            check_plan_weights(plan.model_digest, model.digest, self.name, f"model {model.ref}")
            plan.check_model(family.name, dims.num_layers, self.name)
            plan.refuse_fitted(self.name, CLI.refuses_fitted)
        check_supported(family, cfg, dims)

    def run(self, config: GgufConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        from . import probe

        out = Path(out_dir)
        plan: Plan | None = inputs.get("plan")
        model = inputs["model"]
        alphas = plan.alpha_map if plan is not None else {}
        fitted = plan.fitted_tensors() if plan is not None else {}  # calibrate --replacement rrr
        if plan is not None:
            plan.save(out / "plan.json")
        cfg = hf_config(model.folder)
        dims = ModelDims.from_config(cfg)
        vocab = choose_vocab(model, cfg, dims, out)
        info = write_deci_gguf(model.folder, alphas, out / MODEL_FILE, dtype=config.dtype, context=config.context,
                               vocab=vocab, name=f"{Path(str(model.ref)).name} HARP" if alphas else str(model.ref),
                               fitted=fitted)
        quantized = None
        if config.gguf_type != "none":
            probe.quantize(out / MODEL_FILE, out / quantized_name(config.gguf_type), config.gguf_type)
            quantized = quantized_name(config.gguf_type)
        layers = deci_layers(alphas, dims)
        kv_fa = probe.kv_cache(out / MODEL_FILE, flash_attn=True)
        kv_nofa = probe.kv_cache(out / MODEL_FILE, flash_attn=False)
        dense = kv_bytes_per_token(deci_layers({}, dims), dims.head_dim, 2)
        body: dict[str, Any] = {
            "format": FORMAT, "model": model.to_dict(), "llama_cpp": {"version": probe.llama_cpp_version()},
            "file": MODEL_FILE, "quantized_file": quantized, "gguf_type": config.gguf_type, **info,
            "pruned_layers": sorted(alphas), "alphas": {str(k): v for k, v in sorted(alphas.items())},
            "fitted_layers": list(plan.fitted_layers) if plan is not None else [],
            "kv_cache_type": "f16",
            "kv_bytes_per_token": kv_fa["bytes_per_token"],
            "kv_bytes_per_token_no_flash_attn": kv_nofa["bytes_per_token"],
            "kv_bytes_per_token_dense": dense,
            "flash_attn_required": bool(alphas) and kv_nofa["bytes_per_token"] > kv_fa["bytes_per_token"],
            "kv_accounting": {"flash_attn": kv_fa, "no_flash_attn": kv_nofa,
                              "dense_rule": "2 x head_dim x kv_heads x 2 bytes per layer (llama_kv_cache, f16)"},
        }
        if config.verify:
            body["verification"] = _verify(config, alphas, Path(model.folder), out / MODEL_FILE,
                                           text=info["tokenizer"]["source"] != "none", fitted=fitted)
        if quantized:
            body["quantized_check"] = _generates(out / quantized, dims.vocab)
        (out / REPORT).write_text(json.dumps(body, indent=2))
        return body


# ---- the tokenizer keys -------------------------------------------------------------------------
def choose_vocab(model, cfg, dims: ModelDims, out: Path):
    """The source GGUF's tokenizer keys (a model read from a GGUF file); else a byte-level BPE from
    the Hugging Face folder with the first llama.cpp pre-tokenizer name whose tokenization of
    ``CHECK_TEXT`` equals the Hugging Face tokenizer's; else token ids only (``vocab.no_vocab``)."""
    from harp_trt.models import source_gguf

    from . import vocab as V

    src = source_gguf(model)
    if src is not None and src.is_file():
        return V.from_gguf(src)
    try:
        V.from_hf_bpe(model.folder, dims.vocab, "default")
    except (FileNotFoundError, ValueError, KeyError) as e:
        return V.no_vocab(f"the tokenizer is not a byte-level BPE gguf.vocab reads ({e}); llama.cpp runs token ids")
    from harp_trt.models import load_tokenizer

    want = load_tokenizer(model.folder)(CHECK_TEXT, add_special_tokens=False)["input_ids"]
    for pre in V.PRE_CANDIDATES:
        if _tokenizes_as(model.folder, cfg, dims, V.from_hf_bpe(model.folder, dims.vocab, pre), out, want):
            log.info("llama.cpp pre-tokenizer %r reproduces the Hugging Face tokenization", pre)
            chosen = V.from_hf_bpe(model.folder, dims.vocab, pre)
            return lambda w: {**chosen(w), "check_text": CHECK_TEXT, "matches_hf": True}
    return V.no_vocab(f"no llama.cpp pre-tokenizer of {', '.join(V.PRE_CANDIDATES)} reproduces the Hugging Face "
                      "tokenization; llama.cpp runs token ids")


def vocab_file(cfg, dims: ModelDims, vocab, path: Path) -> dict[str, Any]:
    """A GGUF of the keys alone (no tensors): enough for llama.cpp's vocab-only load."""
    import gguf

    from .writer import write_arch_keys

    w = gguf.GGUFWriter(str(path), family_of(cfg).gguf.architecture)
    try:
        write_arch_keys(w, cfg, dims, deci_layers({}, dims), "f32", 0, "vocab check")
        info = vocab(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    finally:
        w.close()
    return info


def _tokenizes_as(folder, cfg, dims: ModelDims, vocab, out: Path, want: list[int]) -> bool:
    """llama.cpp's tokenization of ``CHECK_TEXT`` with ``vocab`` (a vocab-only load) is ``want``."""
    from . import probe

    path = out / ".vocab-check.gguf"
    vocab_file(cfg, dims, vocab, path)
    try:
        return probe.tokenize(path, CHECK_TEXT) == list(want)
    except PreconditionError:  # llama.cpp does not load this vocabulary
        return False
    finally:
        path.unlink(missing_ok=True)


# ---- postconditions: llama.cpp computes the HARP model ------------------------------------------
def reference_logits(folder: Path, alphas: Mapping[int, float], ids, dtype: str, fitted: Mapping | None = None):
    """PyTorch HARP logits ``[n, vocab]`` (fp32, layer by layer, one layer resident; weights rounded
    to ``dtype`` first for a half-precision file), with a plan's ``fitted`` maps where it has them."""
    import torch

    from harp_trt.device import Placement
    from harp_trt.layerwise import LayerStack

    from .writer import TORCH_DTYPES

    round_to = None if dtype == "f32" else TORCH_DTYPES[dtype]
    ref = LayerStack.open(folder, Placement("cpu", "float32", sequential=True), stream_embeddings=True,
                          round_to=round_to)
    ref.apply_plan(alphas, dict(fitted or {}))
    cap = ref.capture(torch.as_tensor([list(ids)]))
    return ref.logits(ref.run(cap.h0, cap)[0]).float()[0].numpy()


def _verify(config: GgufConfig, alphas: Mapping[int, float], folder: Path, gguf_path: Path,
            text: bool, fitted: Mapping | None = None) -> dict[str, Any]:
    """llama.cpp generates greedily (KV cache, one token per decode) from ``PROMPT_TEXT`` in the
    file's own tokenization (``text``) or from random ids; then the prompt plus its continuation runs
    in one prefill in llama.cpp and in the reference: logits within the tolerance, and the
    reference's argmax after the prompt is llama.cpp's continuation."""
    import numpy as np

    from . import probe

    n, p = config.verify_tokens, min(GREEDY_PROMPT, config.verify_tokens - 1)
    vocab = int(hf_config(folder).vocab_size)
    prompt = (probe.tokenize(gguf_path, PROMPT_TEXT)[:p] if text else []) or \
        np.random.default_rng(0).integers(0, vocab, p).tolist()
    p = len(prompt)
    greedy = probe.greedy(gguf_path, prompt, n - p + 1)
    ids = prompt + greedy[:-1]
    got = probe.logits(gguf_path, ids)
    want = reference_logits(folder, alphas, ids, config.dtype, fitted)
    want_greedy = want[p - 1:].argmax(-1).tolist()
    scale = max(1.0, float(np.abs(want).max()))
    tol = VERIFY_TOLERANCE[config.dtype] * scale
    diff = float(np.abs(got - want).max())
    result = {"tokens": n, "prompt": prompt, "max_abs_diff": diff, "tolerance": tol, "logit_scale": scale,
              "argmax_equal": int((got.argmax(-1) == want.argmax(-1)).sum()), "greedy": greedy,
              "greedy_equal": greedy == want_greedy, "kv_cache_type": "f32",
              "reference": "PyTorch HARP, layer by layer, fp32" + ("" if config.dtype == "f32" else
                                                                    f" on weights rounded to {config.dtype}")}
    log.info("%s: llama.cpp logits max |diff| %.3g (tolerance %.3g), greedy equal %s", STAGE, diff, tol,
             result["greedy_equal"])
    if not diff <= tol:
        raise VerificationError(STAGE, f"llama.cpp logits differ from the PyTorch HARP model: max |diff| {diff:.3g} "
                                f"> tolerance {tol:.3g}", "this is a bug in the GGUF writer; please report it with the plan")
    if not result["greedy_equal"]:
        raise VerificationError(STAGE, f"llama.cpp greedy tokens {greedy} differ from the reference's {want_greedy}",
                                "this is a bug in the GGUF writer; please report it with the plan")
    result["passed"] = True
    return result


def _generates(path: Path, vocab: int) -> dict[str, Any]:
    """A quantized file loads and generates (its logits are not held to a tolerance: quantization
    changes them by design)."""
    from . import probe

    tokens = probe.greedy(path, list(range(1, 1 + GREEDY_PROMPT)), 8)
    if len(tokens) != 8 or not all(0 <= t < vocab for t in tokens):
        raise VerificationError(STAGE, f"the quantized GGUF generated {tokens}", "see the llama.cpp log")
    return {"greedy": tokens}


# ---- deploy -------------------------------------------------------------------------------------
def deploy_gguf(plan: Plan | None, model, out: str | os.PathLike | None, config: GgufConfig | None = None,
                *, store=None, force: bool = False) -> dict[str, Any]:
    """``out`` None: the cached ``gguf-<key>/`` artifact in ``store``; else the folder ``out`` (new or
    empty unless ``force``), written to a temporary sibling and renamed into place. Bad input raises
    a ``HarpError`` before anything is written. Returns the manifest body plus ``folder``/``cached``."""
    config = config or GgufConfig()
    config.validate()
    stage = GgufStage()
    inputs = {"model": model, **({"plan": plan} if plan is not None else {})}
    if out is None:
        if store is None:
            raise ConfigError("no --out and no artifact store to cache the GGUF in", "pass --out DIR or --workdir")
        art = stage.execute(store, config, inputs, force=force)
        return {**art.manifest, "folder": str(art.path), "cached": art.cached}
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder", "pick another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} exists and is not empty", "pass --force to replace it, or pick another --out")
    stage.check_preconditions(config, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        body = stage.run(config, inputs, tmp)
        stage.check_postconditions(config, inputs, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote llama.cpp GGUF folder %s in %.2f s", out, time.perf_counter() - t0)
    return {**body, "folder": str(out), "cached": False}


def deploy_summary(r: dict[str, Any], config: GgufConfig) -> dict[str, Any]:
    """``harp-trt deploy gguf``'s result (``--json``, the summary) from ``deploy_gguf``'s report."""
    v = r.get("verification") or {}
    return {"folder": r["folder"], "cached": r["cached"], "file": r["file"], "quantized_file": r["quantized_file"],
            "architecture": r["architecture"], "dtype": r["dtype"], "pruned_layers": r["pruned_layers"],
            "kv_bytes_per_token": r["kv_bytes_per_token"], "kv_bytes_per_token_dense": r["kv_bytes_per_token_dense"],
            "kv_bytes_per_token_no_flash_attn": r["kv_bytes_per_token_no_flash_attn"],
            "flash_attn_required": r["flash_attn_required"], "tokenizer": r["tokenizer"]["source"],
            "verify_max_abs_diff": v.get("max_abs_diff"), "verify_tolerance": v.get("tolerance"),
            "greedy_equal": v.get("greedy_equal"), "llama_cpp": r["llama_cpp"]["version"],
            "_tables": {"layers": [{k: ("" if val is None else val) for k, val in row.items()} for row in r["layers"]]}}
