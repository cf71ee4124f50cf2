"""End-to-end recovery of the replaced parameters (``calibrate --recover maps``).

The layer-wise choice (HARP's alphas, Algorithm 1 of arXiv 2507.01900, or the closed-form maps of
``calib.fit``) fits each pruned block on its own. Recovery then trains only the parameters that
replace attention, all pruned layers together, against the dense model's next-token distribution:

    min_theta  sum_t KL( p_dense(. | x_<t) || p_theta(. | x_<t) )           (knowledge distillation)

theta, per pruned layer: the V.O pair (v_proj, o_proj; HARP's alpha is folded into o_proj, an rrr
map's A and B are these two) or an lmmse map's W and b. Shapes do not change, so every engine carries
the result as it carries a fitted rrr map (``Plan.fitted_tensors``).

Cost. The state entering the lowest pruned layer ``lo`` does not depend on theta: it is computed
once per window, with the dense model's final state (the teacher), and a step runs only layers
``lo..L-1`` and the head. Adam on the fit text's windows; the KL on the select text (which the fit
never reads) is read every ``eval_every`` steps and the best state kept; training stops after
``patience`` reads without a gain. Where no state beats the start on the select text, the
layer-wise result stays (``RecoveryResult.kept``)."""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from harp_trt.errors import PreconditionError
from harp_trt.memory import peak_rss_bytes
from harp_trt.ppl import PAD

__all__ = ["RecoverySettings", "RecoveryResult", "DenseTeacher", "dense_teacher", "recover", "trainable_tensors"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoverySettings:
    """Adam's learning rate, the most steps, windows per step, and the early-stopping cadence."""

    steps: int = 200
    lr: float = 1e-4
    batch: int = 1
    eval_every: int = 20
    patience: int = 3
    seed: int = 0


@dataclass
class DenseTeacher:
    """Per window: the state entering layer ``lo`` and the dense model's final state (before the
    final norm), both ``[1, S, h]`` on the model's device; ``windows`` the token ids."""

    lo: int
    windows: torch.Tensor
    entering: list[torch.Tensor]
    final: list[torch.Tensor]
    kwargs: dict[int, dict[str, Any]]


@dataclass
class RecoveryResult:
    kept: bool                       # True: the trained state beat the start on the select text
    layers: list[int]
    tensors: dict[str, torch.Tensor]  # checkpoint name -> trained tensor (empty when not kept)
    record: dict[str, Any] = field(default_factory=dict)


def _plain(x: Any) -> Any:
    """An inference-mode tensor (or a tuple/dict of them) as an ordinary one autograd may save."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def dense_teacher(stack, windows: torch.Tensor, lo: int) -> DenseTeacher:
    """Run the dense model once over ``windows``: keep the state entering ``lo`` and the final state.
    Call before any layer is pruned."""
    cap = stack.capture(windows)
    entering = stack.run(cap.h0, cap, 0, lo)
    final = stack.run(entering, cap, lo)
    return DenseTeacher(lo, windows, [_plain(x) for x in entering], [_plain(x) for x in final],
                        {i: _plain(cap.kwargs[i]) for i in range(lo, stack.num_layers)})


def _modules(stack, layers: Sequence[int]) -> dict[int, dict[str, nn.Linear]]:
    """The trainable Linear modules of each pruned layer: lmmse's ``harp_linear`` or V and O."""
    from harp_trt.harp import HarpAttention

    out = {}
    for l in layers:
        attn = stack.family.layers(stack.model)[l].self_attn
        if not isinstance(attn, HarpAttention):
            raise PreconditionError("calibrate", f"layer {l} is not pruned; recovery trains pruned layers only")
        if attn.v_proj is None:
            continue  # alpha 0: the block is removed, nothing to train
        out[l] = {"harp_linear": attn.harp_linear} if attn.harp_linear is not None else \
            {"v_proj": attn.v_proj, "o_proj": attn.o_proj}
    return out


def _fold_alpha(stack, layers: Sequence[int]) -> None:
    """Move each pruned layer's alpha into its o_proj (or lmmse map) and set alpha to 1: the state
    recovery trains, and the one a fitted layer of a plan has."""
    from harp_trt.harp import set_alpha

    for l, mods in _modules(stack, layers).items():
        attn = stack.family.layers(stack.model)[l].self_attn
        a = attn.alpha
        if a != 1.0:
            with torch.no_grad():
                last = mods.get("o_proj") or mods["harp_linear"]
                last.weight.mul_(a)
                if last.bias is not None:
                    last.bias.mul_(a)
        set_alpha(stack.model, l, 1.0, stack.family)


def trainable_tensors(stack, layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the trained parameters (``calib.fit.hf_tensors``' names)."""
    from harp_trt.plan import FITTED_LINEAR

    fam, out = stack.family, {}
    cpu = lambda t: t.detach().to("cpu", torch.float32).contiguous()  # noqa: E731
    for l, mods in _modules(stack, layers).items():
        pre = fam.layer_prefix.format(i=l)
        if "harp_linear" in mods:
            out[f"{pre}{FITTED_LINEAR}.weight"] = cpu(mods["harp_linear"].weight)
            out[f"{pre}{FITTED_LINEAR}.bias"] = cpu(mods["harp_linear"].bias)
            continue
        out[fam.weight_name("v", l)] = cpu(mods["v_proj"].weight)
        out[fam.weight_name("o", l)] = cpu(mods["o_proj"].weight)
        if mods["v_proj"].bias is not None:
            out[fam.weight_name("vb", l)] = cpu(mods["v_proj"].bias)
    return out


def _kl(stack, student: torch.Tensor, teacher: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed ``KL(p_teacher || p_student)`` over the window's scored positions (``ppl.window_nll``'s
    rule: a label >= 0; padding and context marks out)."""
    keep = (window[0, 1:] >= 0).to(student.device)
    s = stack.family.logits(stack.model, student[:, :-1]).float().log_softmax(-1)[0][keep]
    with torch.no_grad():
        t = stack.family.logits(stack.model, teacher[:, :-1]).float().log_softmax(-1)[0][keep]
    return nn.functional.kl_div(s, t, log_target=True, reduction="sum"), int(keep.sum())


def _forward(stack, teacher: DenseTeacher, w: int) -> torch.Tensor:
    h = teacher.entering[w]
    for i in range(teacher.lo, stack.num_layers):
        h = stack.call(stack.family.layers(stack.model)[i], h, teacher.kwargs[i])
    return h


def _mean_kl(stack, teacher: DenseTeacher) -> float:
    total, n = 0.0, 0
    with torch.no_grad():
        for w in range(len(teacher.entering)):
            s, k = _kl(stack, _forward(stack, teacher, w), teacher.final[w], teacher.windows[w: w + 1])
            total, n = total + float(s), n + k
    return total / max(n, 1)


def recover(stack, layers: Sequence[int], fit: DenseTeacher, select: DenseTeacher,
            settings: RecoverySettings = RecoverySettings()) -> RecoveryResult:
    """Train the replacement parameters of ``layers`` (already pruned, with their layer-wise
    alphas or maps installed) to minimise the fit text's KL to the dense model; keep the state with
    the lowest select-text KL. On return the model holds the kept state (the start if nothing beat
    it), every pruned layer at alpha 1 with its alpha folded into its weights."""
    if stack.sequential:
        raise PreconditionError("calibrate", "--recover trains the pruned layers end to end and needs the model "
                                "in memory; this run reads it one layer at a time", "give the run more memory, "
                                "or drop --recover")
    if stack.family.alpha_after_post_attn_norm:
        raise PreconditionError("calibrate", f"--recover does not support {stack.family.name}: its alpha sits after "
                                "the post-attention norm and cannot be folded into o_proj", "drop --recover")
    if fit.lo != min(layers) or select.lo != min(layers):
        raise ValueError("the teachers' states must enter the lowest pruned layer")
    t0 = time.perf_counter()
    _fold_alpha(stack, layers)
    mods = _modules(stack, layers)
    linears = [lin for m in mods.values() for lin in m.values()]
    dtype = linears[0].weight.dtype if linears else torch.float32
    start = [p.detach().clone() for lin in linears for p in lin.parameters()]
    for lin in linears:  # float32 master weights; a bf16 / fp16 model runs the step under autocast
        lin.float()
    params = [p for lin in linears for p in lin.parameters()]
    amp = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(stack.device.type, dtype=dtype)
    run = _Run(stack, fit, select, params, settings, amp)
    frozen = [p for p in stack.model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    try:
        run.train()
    finally:
        with torch.no_grad():
            for p, b in zip(params, run.best_params):
                p.copy_(b)
        for p in params:
            p.requires_grad_(False)
        for lin in linears:
            lin.to(dtype)
        for p in frozen:
            p.requires_grad_(True)
    kept = math.isfinite(run.best) and run.best < run.start_kl
    if not kept:
        with torch.no_grad():
            for p, s in zip([p for lin in linears for p in lin.parameters()], start):
                p.copy_(s)
    seconds = time.perf_counter() - t0
    record = {"kept": kept, **run.record(), "fit_windows": len(fit.entering),
              "fit_tokens": int((fit.windows != PAD).sum()), "select_tokens": int((select.windows != PAD).sum()),
              "lr": settings.lr, "batch": settings.batch, "eval_every": settings.eval_every,
              "patience": settings.patience, "seconds": round(seconds, 3),
              "seconds_per_step": round(seconds / max(run.step, 1), 3), "peak_rss_bytes": peak_rss_bytes(),
              "trained": "lmmse W, b" if any("harp_linear" in m for m in mods.values()) else "V, O"}
    return RecoveryResult(kept, sorted(mods), trainable_tensors(stack, sorted(mods)) if kept else {}, record)


class _Run:
    """Adam over ``params`` on the fit teacher's windows (shuffled, ``settings.batch`` per step);
    the select teacher's KL every ``eval_every`` steps, the best parameters kept, a stop after
    ``patience`` reads without a gain."""

    def __init__(self, stack, fit: DenseTeacher, select: DenseTeacher, params: list, settings: RecoverySettings, amp):
        self.stack, self.fit, self.select, self.params, self.settings, self.amp = stack, fit, select, params, settings, amp
        self.best_params = [p.detach().clone() for p in params]
        with amp:
            self.start_kl = self.best = _mean_kl(stack, select)
        self.best_step, self.step, self.tokens = 0, 0, 0
        self.curve: list[dict] = [{"step": 0, "select_kl": self.start_kl}]
        self.train_kl: list[float] = []

    def train(self) -> None:
        s = self.settings
        opt = torch.optim.Adam(self.params, lr=s.lr)
        gen = torch.Generator().manual_seed(s.seed)
        n_win, order, bad = len(self.fit.entering), [], 0
        for self.step in range(1, s.steps + 1):
            opt.zero_grad(set_to_none=True)
            loss_sum, n = None, 0
            for _ in range(s.batch):
                if not order:
                    order = torch.randperm(n_win, generator=gen).tolist()
                w = order.pop()
                with self.amp:
                    kl, k = _kl(self.stack, _forward(self.stack, self.fit, w), self.fit.final[w],
                                self.fit.windows[w: w + 1])
                loss_sum, n = (kl if loss_sum is None else loss_sum + kl), n + k
            loss = loss_sum / max(n, 1)
            loss.backward()
            opt.step()
            self.tokens += n
            self.train_kl.append(float(loss.detach()))
            if self.step % s.eval_every == 0 or self.step == s.steps:
                bad = 0 if self._read() else bad + 1
                if bad >= s.patience:
                    break

    def _read(self) -> bool:
        """The select KL now; True (and the parameters kept) when it is the best so far."""
        with self.amp:
            kl = _mean_kl(self.stack, self.select)
        recent = self.train_kl[-self.settings.eval_every:]
        self.curve.append({"step": self.step, "select_kl": kl, "fit_kl": sum(recent) / len(recent)})
        log.info("recovery step %d: fit KL %.4f, select KL %.4f (start %.4f)", self.step, self.curve[-1]["fit_kl"], kl,
                 self.start_kl)
        if kl >= self.best:
            return False
        self.best, self.best_step = kl, self.step
        self.best_params = [p.detach().clone() for p in self.params]
        return True

    def record(self) -> dict[str, Any]:
        return {"steps": self.step, "best_step": self.best_step, "tokens_seen": self.tokens,
                "select_kl_start": self.start_kl, "select_kl_best": self.best, "curve": self.curve}
