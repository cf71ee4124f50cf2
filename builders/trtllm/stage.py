"""``TrtllmCheckpointStage``: plan + Hugging Face model -> TensorRT-LLM deployment artifact.

Artifact layout (``<cache>/trtllm-<key>/``)::

    manifest.json                 per-layer mapping, KV/GEMM costs, verification, engine status
    plan.json                     the recipe
    checkpoint/config.json        TensorRT-LLM checkpoint (trtllm-build input)
    checkpoint/rank{N}.safetensors
    hf/                           HF DeciLM (block_configs) checkpoint, Llama/Mistral only
    build_engine.sh               the exact trtllm-build command (run where a GPU and TensorRT-LLM are)
    serve_engine.sh, engine_llm_api_options.yaml      run the built engine (trtllm-serve --backend tensorrt)
    serve_pytorch.sh, pytorch_llm_api_options.yaml    run hf/ on the PyTorch backend (Llama, Mistral)
    engine/                       only where ``tensorrt_llm`` imports and a GPU is present

Inputs: ``{"plan": Plan, "model": ResolvedModel}``: a reference to the weights, never a loaded
module. Nothing is read on a cache hit; on a miss, tensors stream from the safetensors files one at
a time into the rank files, and the verification runs the written checkpoint and the PyTorch HARP
reference layer by layer (one layer resident, fp32)."""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import shlex
import subprocess
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch

from harp_trt.config import StageConfig, digest_of
from harp_trt.errors import ConfigError, PreconditionError, VerificationError
from harp_trt.families import family_of
from harp_trt.plan import Plan
from harp_trt.stage import Stage

from .checkpoint import (DTYPES, STAGE_NAME, ModelDims, check_layout, check_pipeline, hf_config, layer_kinds,
                         write_checkpoint)
from .hf_format import write_hf_decilm
from .launch import write_launch_files
from .reader import read_checkpoint, read_hf_decilm
from .targets import target_for

__all__ = ["TrtllmCheckpointConfig", "TrtllmCheckpointStage", "build_command", "VERIFY_TOLERANCE"]

log = logging.getLogger(__name__)

# Reader vs PyTorch HARP reference, max |logit diff| / max(1, max |reference logit|). Half-precision
# checkpoints are compared with a reference whose weights were rounded to the same dtype.
VERIFY_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class TrtllmCheckpointConfig(StageConfig):
    """Config of the TensorRT-LLM build stage. ``build``: ``auto`` runs ``build_engine.sh`` where
    ``tensorrt_llm`` imports and a GPU is present, ``never`` only writes it."""

    VERSION: ClassVar[int] = 1
    dtype: str = "float16"
    tp_size: int = 1
    pp_size: int = 1
    max_batch_size: int = 8
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    hf_format: bool = True
    verify: bool = True
    verify_tokens: int = 32
    build: str = "auto"

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported TensorRT-LLM dtype {self.dtype!r}; valid: {', '.join(DTYPES)}",
                              "fp16 -> float16, bf16 -> bfloat16, fp32 -> float32")
        for name in ("tp_size", "pp_size", "max_batch_size", "max_input_len", "max_seq_len",
                     "max_num_tokens", "verify_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.max_input_len > self.max_seq_len:
            raise ConfigError(f"max_input_len ({self.max_input_len}) exceeds max_seq_len ({self.max_seq_len})",
                              "max_seq_len counts prompt plus generated tokens")
        t = self.tokens_per_block
        if not isinstance(t, int) or t < 2 or t & (t - 1):
            raise ConfigError(f"tokens_per_block must be a power of two >= 2, got {t!r}")
        if self.build not in ("auto", "never"):
            raise ConfigError(f"build must be 'auto' or 'never', got {self.build!r}")


def build_command(cfg: TrtllmCheckpointConfig, checkpoint_dir: str, output_dir: str) -> list[str]:
    """The ``trtllm-build`` argv (TensorRT-LLM 1.x flag names, see ``tensorrt_llm/commands/build.py``)."""
    cmd = ["trtllm-build", "--checkpoint_dir", checkpoint_dir, "--output_dir", output_dir,
           "--gemm_plugin", "auto", "--kv_cache_type", "paged",
           "--max_batch_size", str(cfg.max_batch_size), "--max_input_len", str(cfg.max_input_len),
           "--max_seq_len", str(cfg.max_seq_len), "--max_num_tokens", str(cfg.max_num_tokens)]
    if cfg.tokens_per_block != 32:
        cmd += ["--tokens_per_block", str(cfg.tokens_per_block)]
    if cfg.tp_size * cfg.pp_size > 1:
        cmd += ["--workers", str(cfg.tp_size * cfg.pp_size)]
    return cmd


def _script(cfg: TrtllmCheckpointConfig) -> str:
    cmd = [a if a.startswith('"') else shlex.quote(a) for a in
           build_command(cfg, '"$HERE/checkpoint"', '"$OUT"')]
    pairs = [cmd[0]] + [f"{cmd[i]} {cmd[i + 1]}" for i in range(1, len(cmd), 2)]  # flag value
    lines = " \\\n    ".join(pairs)
    return ("#!/usr/bin/env bash\n"
            "# Generated by harp-trt: build TensorRT engines from the HARP checkpoint beside this script.\n"
            "# Usage: bash build_engine.sh [OUTPUT_DIR]   (needs tensorrt_llm and "
            f"{cfg.tp_size * cfg.pp_size} GPU(s))\n"
            "set -euo pipefail\n"
            'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
            'OUT="${1:-$HERE/engine}"\n'
            f"{lines}\n")


class TrtllmCheckpointStage(Stage[TrtllmCheckpointConfig]):
    name: ClassVar[str] = STAGE_NAME
    version: ClassVar[int] = 2
    outputs: ClassVar[tuple[str, ...]] = ("plan.json", "checkpoint/config.json", "build_engine.sh")

    def key_material(self, config, inputs):
        base = super().key_material(config, inputs)
        plan: Plan = inputs["plan"]
        model = inputs.get("model")
        return {**base, "plan": digest_of(plan.to_dict()),
                "model_digest": getattr(model, "digest", None) or plan.model_digest}

    def check_preconditions(self, config: TrtllmCheckpointConfig, inputs: Mapping[str, Any]) -> None:
        plan, model = inputs.get("plan"), inputs.get("model")
        if not isinstance(plan, Plan):
            raise PreconditionError(self.name, "input 'plan' is missing or not a harp_trt.plan.Plan",
                                    "pass Plan.load(<calibrate artifact>)")
        if model is None or not hasattr(model, "folder"):
            raise PreconditionError(self.name, "input 'model' is missing or not a resolved model reference",
                                    "pass harp_trt.models.resolve_model(ref, cache_root)")
        if model.digest and model.digest != plan.model_digest:
            raise PreconditionError(self.name, f"model {model.ref} (weights {model.digest[:12]}) is not the model "
                                    f"the plan was calibrated on ({plan.model_digest[:12]})",
                                    "pass --model with the calibrated weights, or calibrate this model first")
        cfg = hf_config(model.folder)
        family = family_of(cfg)
        dims = ModelDims.from_config(cfg)
        target = target_for(family.name)
        check_layout(dims, target, config.dtype, config.tp_size, config.pp_size)
        check_pipeline(layer_kinds(plan, target, dims, config.max_seq_len), target, config.pp_size)
        if config.max_seq_len > cfg.max_position_embeddings:
            log.warning("max_seq_len %d exceeds the model's max_position_embeddings %d",
                        config.max_seq_len, cfg.max_position_embeddings)

    def run(self, config: TrtllmCheckpointConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        out = Path(out_dir)
        plan: Plan = inputs["plan"]
        model = inputs["model"]
        plan.save(out / "plan.json")
        info = write_checkpoint(model.folder, plan, out / "checkpoint", dtype=config.dtype, tp_size=config.tp_size,
                                pp_size=config.pp_size, max_seq_len=config.max_seq_len,
                                tokens_per_block=config.tokens_per_block)
        hf = (write_hf_decilm(model.folder, plan, out / "hf", dtype=config.dtype)
              if config.hf_format else {"written": False, "reason": "hf_format is off"})
        if hf["written"]:
            _copy_tokenizer(Path(model.folder), out / "hf")
        script = out / "build_engine.sh"
        script.write_text(_script(config))
        script.chmod(0o755)
        cfg = hf_config(model.folder)
        dims = ModelDims.from_config(cfg)
        lk = layer_kinds(plan, target_for(family_of(cfg).name), dims, config.max_seq_len)
        launch = write_launch_files(out, config, lk, dims, hf)
        body = {"model": model.to_dict(), "checkpoint": info, "hf_checkpoint": hf, "launch": launch,
                "build_command": build_command(config, "checkpoint", "engine")}
        if config.verify:
            body["verification"] = self._verify(config, plan, Path(model.folder), out / "checkpoint",
                                                out / "hf" if hf["written"] else None)
        body["engine"] = self._maybe_build(config, out)
        return body

    # ---- postcondition: the written checkpoint computes the HARP model --------------------------
    def _verify(self, config, plan: Plan, folder: Path, ckpt: Path, hf: Path | None) -> dict[str, Any]:
        """Logits of the written checkpoint (and HF folder) against the PyTorch HARP reference, both
        run layer by layer in fp32 with one layer resident; a half-precision checkpoint is compared
        with a reference whose weights are rounded to the same dtype."""
        import torch

        from harp_trt.device import Placement
        from harp_trt.harp import apply_harp
        from harp_trt.layerwise import LayerStack

        n = min(config.verify_tokens, config.max_input_len)
        round_to = None if config.dtype == "float32" else DTYPES[config.dtype]
        ref = LayerStack.open(folder, Placement("cpu", "float32", sequential=True), stream_embeddings=True,
                              round_to=round_to)
        vocab = ref.model.config.vocab_size
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
        apply_harp(ref.model, plan.alpha_map, ref.family)
        cap = ref.capture(ids)
        want = ref.logits(ref.run(cap.h0, cap)[0]).float()
        del ref, cap
        scale = max(1.0, float(want.abs().max()))
        tol = VERIFY_TOLERANCE[config.dtype] * scale
        result: dict[str, Any] = {"tokens": n, "tolerance": tol, "reference": "layer by layer, fp32"}
        checks = [("checkpoint", read_checkpoint(ckpt))] + ([("hf", read_hf_decilm(hf))] if hf else [])
        for what, ck in checks:
            diff = float((ck.forward(ids) - want).abs().max())
            result["max_abs_diff" if what == "checkpoint" else "hf_max_abs_diff"] = diff
            log.info("%s: %s logits max |diff| %.3g (tolerance %.3g)", self.name, what, diff, tol)
            if not diff <= tol:
                raise VerificationError(self.name, f"{what} logits differ from the PyTorch HARP model: "
                                        f"max |diff| {diff:.3g} > tolerance {tol:.3g}",
                                        "this is a bug in the writer; please report it with the plan")
        result["passed"] = True
        return result

    def _maybe_build(self, config, out: Path) -> dict[str, Any]:
        if config.build == "never":
            return {"built": False, "reason": "build is 'never'"}
        if importlib.util.find_spec("tensorrt_llm") is None:
            return {"built": False, "reason": "tensorrt_llm is not installed here; run build_engine.sh on a GPU host"}
        if not torch.cuda.is_available() or torch.cuda.device_count() < config.tp_size * config.pp_size:
            return {"built": False, "reason": f"needs {config.tp_size * config.pp_size} GPU(s); "
                    "run build_engine.sh on a GPU host"}
        r = subprocess.run(["bash", str(out / "build_engine.sh"), str(out / "engine")],
                           capture_output=True, text=True)
        (out / "build_engine.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise VerificationError(self.name, f"trtllm-build failed (exit {r.returncode}): "
                                    f"{(r.stderr or r.stdout).strip()[-400:]}", "see build_engine.log in the artifact")
        return {"built": True, "dir": "engine"}


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    import shutil

    from harp_trt.models import TOKENIZER_FILES

    copied = []
    for name in TOKENIZER_FILES:
        if name != "config.json" and (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def read_checkpoint_config_windows(ckpt: Path) -> list[int] | None:
    import json

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    return (cfg.get("runtime_defaults") or {}).get("max_attention_window")
