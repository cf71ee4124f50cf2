"""Numeric check of a rewritten graph against the PyTorch HARP reference (``harp.apply_harp``).

Both run the same batch of 2 prompts, the second left-padded: the prefill logits are compared at
every real (unpadded) position, then the models decode greedily through their KV caches. For the
first ``decode_steps`` steps the logits are compared; for ``greedy_steps`` steps the argmax
tokens must be identical. The tolerance is relative to the logit scale:

    max |logits_onnx - logits_torch| <= rtol * max(1, max |logits_torch|)      (per step)

with ``rtol = 1e-4`` by default (fp32). A failure raises ``VerificationError`` naming the output,
the step and the max diff."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import VerificationError
from .graph import STAGE

__all__ = ["VerifyConfig", "VerifyResult", "verify_rewrite", "make_prompts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyConfig:
    rtol: float = 1e-4          # logits tolerance relative to max(1, max|logits|)
    decode_steps: int = 16      # decode steps whose logits are compared
    greedy_steps: int = 32      # decode steps whose greedy tokens must match
    prompt_len: int = 12        # longest prompt; the second is 3 tokens shorter, left-padded
    pad: int = 3
    seed: int = 0


@dataclass
class VerifyResult:
    max_abs_diff: float
    tolerance: float
    rtol: float
    prefill_max_abs_diff: float
    per_step: list[dict[str, float]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    greedy_steps: int = 0
    decode_steps: int = 0
    passed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_prompts(vocab_size: int, cfg: VerifyConfig) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts, the second ``cfg.pad`` tokens shorter and left-padded (id 0 under mask 0)."""
    rng = np.random.default_rng(cfg.seed)
    ids = rng.integers(3, vocab_size, size=(2, cfg.prompt_len), dtype=np.int64)
    mask = np.ones_like(ids)
    ids[1, :cfg.pad] = 0
    mask[1, :cfg.pad] = 0
    return ids, mask


def _positions(mask: np.ndarray, new: int) -> np.ndarray:
    return (np.cumsum(mask, -1) - 1).clip(min=0)[:, -new:].astype(np.int64)


def verify_rewrite(onnx_path: Path, torch_model, alphas: Mapping[int, float],
                   cfg: VerifyConfig = VerifyConfig()) -> VerifyResult:
    """Compare the rewritten graph at ``onnx_path`` with ``torch_model`` after
    ``apply_harp(torch_model, alphas)`` (done here, in place). See the module docstring."""
    import torch
    from transformers.cache_utils import DynamicCache

    from ..harp import apply_harp
    from ..ort_session import OrtCausalLM

    apply_harp(torch_model, dict(alphas))
    torch_model.eval()
    sess = OrtCausalLM(onnx_path)
    ids, mask = make_prompts(torch_model.config.vocab_size, cfg)
    cache = DynamicCache(config=torch_model.config)
    past = None
    steps = max(cfg.greedy_steps, cfg.decode_steps)
    result = VerifyResult(0.0, 0.0, cfg.rtol, 0.0, greedy_steps=cfg.greedy_steps, decode_steps=cfg.decode_steps)
    tokens: list[np.ndarray] = []
    cur = ids
    for step in range(steps + 1):
        name = "prefill" if step == 0 else f"decode step {step}"
        pos = _positions(mask, cur.shape[1])
        with torch.no_grad():
            out = torch_model(input_ids=torch.from_numpy(cur), attention_mask=torch.from_numpy(mask),
                              position_ids=torch.from_numpy(pos), past_key_values=cache, use_cache=True)
        ref = out.logits.float().numpy()
        got, past = sess.forward(cur, mask, pos, past)
        got = np.asarray(got, dtype=np.float32)
        if got.shape != ref.shape:
            raise VerificationError(STAGE, f"{name}: ONNX logits have shape {got.shape}, PyTorch {ref.shape}")
        if step <= cfg.decode_steps:
            valid = mask[:, -cur.shape[1]:] > 0
            diff = float(np.abs(got - ref)[valid].max())
            tol = cfg.rtol * max(1.0, float(np.abs(ref[valid]).max()))
            if not np.isfinite(diff) or diff > tol:
                raise VerificationError(
                    STAGE, f"output 'logits' at {name}: max |diff| {diff:.3g} > tolerance {tol:.3g} "
                           f"(rtol {cfg.rtol:g} x max(1, max|logits| {tol / cfg.rtol:.3g}))",
                    "the rewritten graph does not compute the HARP model of the plan")
            result.per_step.append({"step": step, "max_abs_diff": diff, "tolerance": tol})
            result.max_abs_diff = max(result.max_abs_diff, diff)
            result.tolerance = max(result.tolerance, tol)
            if step == 0:
                result.prefill_max_abs_diff = diff
        if step == steps:
            break
        nxt_ref = ref[:, -1].argmax(-1)
        nxt_got = got[:, -1].argmax(-1)
        if step < cfg.greedy_steps and not np.array_equal(nxt_ref, nxt_got):
            raise VerificationError(
                STAGE, f"output 'tokens' at greedy step {step + 1}: ONNX chose {nxt_got.tolist()}, "
                       f"PyTorch {nxt_ref.tolist()} (logits max |diff| there "
                       f"{float(np.abs(got[:, -1] - ref[:, -1]).max()):.3g})")
        tokens.append(nxt_ref)
        cur = nxt_ref[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], 1)
    result.tokens = np.stack(tokens, 1).tolist() if tokens else []
    log.info("verify: logits max|diff| %.3g (tolerance %.3g) over prefill + %d decode steps; "
             "%d greedy tokens identical", result.max_abs_diff, result.tolerance, cfg.decode_steps,
             cfg.greedy_steps)
    return result
