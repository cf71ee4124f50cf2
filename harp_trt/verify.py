"""Numeric check of a rewritten graph against the PyTorch HARP reference (``harp.apply_harp``).

The graph runs a batch of 2 prompts in ONNX Runtime, the second left-padded: a prefill, then
greedy decoding through its KV cache. The reference computes each row's whole sequence (prompt
plus the tokens the graph chose, no padding) in one causal pass, layer by layer through a
``LayerStack``: its logits at position t are those of incremental decoding at step t. So the
reference can be a loaded model or a model folder read one layer at a time (one fp32 layer plus
the ORT session resident: a 1.5B graph is checked within ~1.2x its own size). The prefill logits
are compared at every real (unpadded) position; for the first ``decode_steps`` steps the logits
are compared; for ``greedy_steps`` steps the argmax tokens must be identical. The tolerance is
relative to the logit scale:

    max |logits_onnx - logits_torch| <= rtol * max(1, max |logits_torch|)      (per step)

with ``rtol = 1e-4`` by default (fp32). A failure raises ``VerificationError`` naming the output,
the step and the max diff.

Graphs other exporters wrote are fed what they take (``OrtCausalLM``): optimum-onnx's have
harp-trt's names; onnxruntime-genai's have no ``position_ids`` (``GroupQueryAttention`` derives
positions from ``attention_mask``, so its prompts cannot be left-padded: both prompts then have
full length) and a symbolic head size (read from the reference model's config)."""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .dims import attention_dims
from .errors import GraphError, VerificationError

STAGE = "rewrite"  # the stage its errors name (the export stage checks its graph with it too)

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
    pad: int = 0                # left padding of the second prompt (0 for graphs without position_ids)
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


def _reference_hint(reference) -> tuple[int, int, int] | None:
    """(kv_heads, head_dim, vocab) of the reference model, from its config (no weights read)."""
    if isinstance(reference, (str, Path)):
        f = Path(reference) / "config.json"
        if not f.is_file():
            return None
        cfg = json.loads(f.read_text())
    else:
        cfg = reference.config.to_dict()
    dims = attention_dims(cfg)
    return (dims[1], dims[2], cfg.get("text_config", cfg).get("vocab_size")) if dims else None


def _positions(mask: np.ndarray, new: int) -> np.ndarray:
    return (np.cumsum(mask, -1) - 1).clip(min=0)[:, -new:].astype(np.int64)


def _reference_stack(reference, alphas: Mapping[int, float], fitted: Mapping | None = None):
    """A LayerStack for the reference: a loaded model (patched in place) or a folder (sequential,
    streamed embeddings: one layer resident); ``fitted``: the plan's fitted maps
    (``Plan.fitted_tensors``) in their layers."""
    from .device import Placement
    from .layerwise import LayerStack

    if isinstance(reference, (str, Path)):
        stack = LayerStack.open(reference, Placement("cpu", "float32", sequential=True), stream_embeddings=True)
    else:
        stack = LayerStack.wrap(reference)
    if alphas:
        stack.apply_plan(alphas, dict(fitted or {}))
    stack.model.eval()
    return stack


def _reference_logits(stack, rows: list[np.ndarray]) -> list[np.ndarray]:
    """Full-sequence logits of each token row (one causal pass per row, layer by layer)."""
    import torch

    out = []
    for row in rows:
        ids = torch.from_numpy(row[None].astype(np.int64))
        cap = stack.capture(ids)
        out.append(stack.logits(stack.run(cap.h0, cap)[0]).float().numpy()[0])
    return out


def verify_rewrite(onnx_path: Path, reference, alphas: Mapping[int, float],
                   cfg: VerifyConfig = VerifyConfig(), session_options: Mapping[str, str] | None = None,
                   fitted: Mapping | None = None) -> VerifyResult:
    """Compare the graph at ``onnx_path`` with the HARP model of ``alphas`` (and ``fitted`` maps) built
    from ``reference`` (a loaded ``*ForCausalLM``, patched in place, or a folder read layer by layer)."""
    from .ort_session import OrtCausalLM

    try:
        sess = OrtCausalLM(onnx_path, session_config=dict(session_options or {"session.disable_prepacking": "1"}),
                           kv_hint=_reference_hint(reference))
    except GraphError as e:  # the graph cannot run at all: the rewrite failed its check
        raise VerificationError(STAGE, e.message, e.hint) from None
    vocab = sess.vocab_size
    if not sess.takes_positions and cfg.pad:
        # GroupQueryAttention takes positions and lengths from attention_mask as if right-padded
        cfg = replace(cfg, pad=0)
    ids, mask = make_prompts(vocab, cfg)
    steps = max(cfg.greedy_steps, cfg.decode_steps)
    logits: list[np.ndarray] = []   # per step: [2, new, V]
    past, cur, m = None, ids, mask
    chosen: list[np.ndarray] = []
    for step in range(steps + 1):
        pos = _positions(m, cur.shape[1])
        got, past = sess.forward(cur, m, pos, past)
        got = np.asarray(got, dtype=np.float32)
        logits.append(got)
        if step == steps:
            break
        nxt = got[:, -1].argmax(-1)
        chosen.append(nxt)
        cur = nxt[:, None].astype(np.int64)
        m = np.concatenate([m, np.ones((m.shape[0], 1), np.int64)], 1)
    del sess, past
    gen = np.stack(chosen, 1) if chosen else np.zeros((2, 0), np.int64)
    rows = [np.concatenate([ids[b][mask[b] > 0], gen[b]]) for b in range(2)]
    stack = _reference_stack(reference, alphas, fitted)
    ref_rows = _reference_logits(stack, rows)
    del stack

    result = VerifyResult(0.0, 0.0, cfg.rtol, 0.0, greedy_steps=cfg.greedy_steps, decode_steps=cfg.decode_steps,
                          pad=cfg.pad)
    n_prompt = [int(mask[b].sum()) for b in range(2)]
    for step in range(steps + 1):
        name = "prefill" if step == 0 else f"decode step {step}"
        got = logits[step]
        # reference positions of this step's outputs, per row
        if step == 0:
            ref = [ref_rows[b][:n_prompt[b]] for b in range(2)]
            g = [got[b][mask[b] > 0] for b in range(2)]
        else:
            ref = [ref_rows[b][n_prompt[b] + step - 1: n_prompt[b] + step] for b in range(2)]
            g = [got[b] for b in range(2)]
        if any(x.shape != y.shape for x, y in zip(g, ref)):
            raise VerificationError(STAGE, f"{name}: ONNX logits have shape {[x.shape for x in g]}, "
                                           f"PyTorch {[y.shape for y in ref]}")
        if step <= cfg.decode_steps:
            diff = max(float(np.abs(x - y).max()) for x, y in zip(g, ref))
            tol = cfg.rtol * max(1.0, max(float(np.abs(y).max()) for y in ref))
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
        if step < min(cfg.greedy_steps, steps):
            want = np.array([ref[b][-1].argmax() for b in range(2)])
            if not np.array_equal(want, gen[:, step]):
                raise VerificationError(
                    STAGE, f"output 'tokens' at greedy step {step + 1}: ONNX chose {gen[:, step].tolist()}, "
                           f"PyTorch {want.tolist()} (logits max |diff| there "
                           f"{max(float(np.abs(x[-1] - y[-1]).max()) for x, y in zip(g, ref)):.3g})")
    result.tokens = gen.tolist()
    log.info("verify: logits max|diff| %.3g (tolerance %.3g) over prefill + %d decode steps; "
             "%d greedy tokens identical", result.max_abs_diff, result.tolerance, cfg.decode_steps,
             cfg.greedy_steps)
    return result
