"""Fitted replacements of a pruned attention block, beyond HARP's one scale.

HARP replaces layer l's attention output by ``alpha * W_O' W_V x`` (x the normed input, W_O' the
output projection with the GQA repeat folded in): a map of rank <= kv_dim, scaled by one grid
value. With X (h x n) the layer's normed inputs and Y (h x n) its dense attention outputs on the
calibration tokens, the best linear maps in closed form are:

- ``lmmse`` (Neural Block Linearization, arXiv 2505.21077): ``W* = C_yx (C_xx + lambda I)^-1`` on
  centred statistics, with bias ``b = mean(Y) - W* mean(X)``; full rank, ``h x h`` per layer.
- ``rrr`` (reduced-rank regression at r = kv_dim, HARP's cost): ``W* = Y X^T (X X^T + lambda I)^-1``
  and ``W_r = P_r W*``, P_r the projection on the top r eigenvectors of ``W* X X^T W*^T`` (the
  fitted outputs' second moment), stored as ``B = U_r`` (h x r) and ``A = U_r^T W*`` (r x h). It is
  HARP's V.O shape: ``A`` becomes v_proj and ``B`` o_proj (each KV group's first head; the other
  heads of the group read zeros), so every engine that carries HARP carries it unchanged.

Which activations: ``sequential`` (the default) fits the selected layers bottom-up, each on the
inputs of the model whose lower selected layers already carry their fitted maps (the inputs the
deployed map sees); ``dense`` fits every layer from one pass of the dense model. Either way one
layer is resident at a time and its moments, ``X X^T``, ``Y X^T``, ``sum ||Y||^2`` and the sums, are
accumulated in float64 on the activations' device. The maps are fitted on the ``fit`` text's
windows; ridge lambda is the one with the lowest squared error on the ``select`` text's windows,
which the fit never reads (``harp_trt.data``: fit / select / held-out). Y is the block's output before Gemma2's
post-attention norm (the term that norm and alpha follow, as HARP's V.O is)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from harp_trt.dims import ModelDims
from harp_trt.families import FamilySpec
from harp_trt.plan import FITTED_LINEAR
from harp_trt.ppl import PAD

__all__ = ["LAMBDAS", "FIT_INPUTS", "Moments", "LayerStats", "FittedMap", "layer_moments", "fit_layer", "hf_tensors",
           "fit_candidates", "cost_record"]

log = logging.getLogger(__name__)

LAMBDAS = (1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 3.0)  # ridge, relative to the mean eigenvalue of C_xx


@dataclass
class Moments:
    """Second moments of one layer's (x, y) pairs, float64: ``xx = sum x x^T``, ``yx = sum y x^T``,
    ``yy = sum ||y||^2``, ``sx``/``sy`` the sums, ``n`` the tokens. They live on ``device``, which
    the first ``add`` sets to the activations' device (a CUDA model accumulates on the GPU)."""

    h: int
    full_yy: bool = False   # also ``yyt = sum y y^T`` (the CCA bound of calib/strategies/cca.py needs it)
    device: torch.device | str = "cpu"
    xx: torch.Tensor = field(init=False)
    yx: torch.Tensor = field(init=False)
    sx: torch.Tensor = field(init=False)
    sy: torch.Tensor = field(init=False)
    yy: float = 0.0
    n: int = 0

    def __post_init__(self):
        self._zero(self.device)

    def _zero(self, device) -> None:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.device = torch.device(device)
        self.xx, self.yx, self.sx, self.sy = z(self.h, self.h), z(self.h, self.h), z(self.h), z(self.h)
        self.yyt = z(self.h, self.h) if self.full_yy else None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.n == 0 and x.device != self.device:
            self._zero(x.device)
        x, y = x.reshape(-1, self.h).double(), y.reshape(-1, self.h).to(x.device).double()
        self.xx += x.T @ x
        self.yx += y.T @ x
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.yy += float((y * y).sum())
        if self.yyt is not None:
            self.yyt += y.T @ y
        self.n += x.shape[0]

    def __add__(self, other: "Moments") -> "Moments":
        out = Moments(self.h, device=self.device)
        for k in ("xx", "yx", "sx", "sy"):
            setattr(out, k, getattr(self, k) + getattr(other, k).to(self.device))
        out.yy, out.n = self.yy + other.yy, self.n + other.n
        return out

    def centred(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(C_xx, C_yx) about the means, summed (not divided by n)."""
        mx, my = self.sx / self.n, self.sy / self.n
        return self.xx - self.n * torch.outer(mx, mx), self.yx - self.n * torch.outer(my, mx)

    def sq_error(self, w: torch.Tensor, b: torch.Tensor | None) -> float:
        """``sum ||y - (W x + b)||^2`` over these tokens, from the moments alone."""
        w = w.to(self.xx)
        e = self.yy - 2 * float((w * self.yx).sum()) + float((w @ self.xx * w).sum())
        if b is not None:
            b = b.to(self.xx)
            e += -2 * float(b @ self.sy) + 2 * float(b @ (w @ self.sx)) + self.n * float(b @ b)
        return e


@dataclass
class FittedMap:
    """One layer's fitted map: ``y = B (A x) + bias`` (rrr: B h x r, A r x h; lmmse: A = W*, B None).
    The relative errors are squared errors over ``sum ||y||^2``: on the fit text (in-sample) and on
    the select text (the one lambda was chosen on), and HARP's unscaled V.O on the select text."""

    method: str
    a: torch.Tensor
    b: torch.Tensor | None
    bias: torch.Tensor | None
    lam: float
    select_rel_error: float = float("nan")
    harp_rel_error: float = float("nan")
    fit_rel_error: float = float("nan")

    def weight(self) -> torch.Tensor:
        return self.a if self.b is None else self.b @ self.a

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The map on ``x`` in ``x``'s dtype and device, factor by factor, as the installed
        weights compute it (rrr: v_proj = A, then o_proj = B; lmmse: one Linear)."""
        out = x @ self.a.to(x).T
        if self.b is not None:
            out = out @ self.b.to(x).T
        return out if self.bias is None else out + self.bias.to(x)

    def record(self) -> dict:
        return {"lambda": self.lam, "fit_rel_error": round(self.fit_rel_error, 6),
                "select_rel_error": round(self.select_rel_error, 6),
                "harp_rel_error": round(self.harp_rel_error, 6), "rank": int(self.a.shape[0]),
                "bias": self.bias is not None}


@dataclass
class LayerStats:
    """One layer's moments on the fit windows and on the select (lambda-choice) windows, and HARP's own
    unscaled V.O (``W``, h x h, and its bias from a v_proj bias) for the baseline error."""

    fit: Moments
    val: Moments
    harp_w: torch.Tensor
    harp_b: torch.Tensor | None


@torch.inference_mode()
def layer_moments(stack, windows: torch.Tensor, layers: Sequence[int], split: int,
                  full_yy: bool = False, refresh: bool = False,
                  pairs: str = "attention") -> Iterator[tuple[int, LayerStats]]:
    """One pass over ``windows``, yielding ``(layer, stats)`` for each layer of ``layers`` as the
    pass leaves it: the moments of the windows before ``split`` (fit) and from ``split`` on (select);
    padded positions are left out. One layer is resident at a time (a sequential stack streams
    them) and one layer's moments are held (four h x h float64 matrices) until the caller has
    reduced them to a map.

    ``refresh``: the caller may change a yielded layer (install its fitted map) before the pass
    goes on; the layer's outputs are then recomputed, so the layers above see its new form (the
    sequential fit). Without it the pass is the model as it stood (the dense fit, the CCA score).

    ``pairs``: ``attention`` = (the sublayer's normed input, its output), what a fitted map
    replaces; ``residual`` = (the layer's un-normed input X, the stream after the sublayer X + Y),
    Neural Block Linearization's pair (``calib/strategies/cca.py``)."""
    if pairs not in ("attention", "residual"):
        raise ValueError(f"pairs must be attention or residual, got {pairs!r}")
    from harp_trt.fold import fold_vo

    wanted = set(int(l) for l in layers)
    dims = ModelDims.from_config(stack.model.config)
    cap = stack.capture(windows)
    h = cap.h0
    for i in range(max(wanted) + 1):
        with stack.layer(i) as layer:
            handle, stats, cur = None, None, {"w": 0}
            if i in wanted:
                stats = LayerStats(Moments(dims.hidden, full_yy), Moments(dims.hidden, full_yy),
                                   *_harp_map(layer, dims, fold_vo))

                def hook(mod, args, kwargs, output, stats=stats, cur=cur, layer=layer):
                    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                    y = output[0] if isinstance(output, tuple) else output
                    if pairs == "residual":
                        if stack.family.alpha_after_post_attn_norm:  # Gemma2: the norm comes before the add
                            norm = layer.post_attention_layernorm
                            y = getattr(norm, "norm", norm)(y)
                        x = cur["h"]
                        y = x + y
                    keep = (windows[cur["w"]] != PAD).reshape(-1).to(x.device)
                    part = stats.fit if cur["w"] < split else stats.val
                    part.add(x.reshape(-1, x.shape[-1])[keep], y.reshape(-1, y.shape[-1])[keep])

                handle = layer.self_attn.register_forward_hook(hook, with_kwargs=True)
            nxt = []
            for w, x in enumerate(h):
                cur["w"], cur["h"] = w, x
                nxt.append(stack.call(layer, x, cap.kwargs[i]))
            if handle is not None:
                handle.remove()
        if stats is not None:
            yield i, stats
            del stats
            if refresh:
                with stack.layer(i) as layer:
                    nxt = [stack.call(layer, x, cap.kwargs[i]) for x in h]
        h = nxt


def _harp_map(layer, dims: ModelDims, fold_vo) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HARP's unscaled V.O of a dense layer as ``(W, b)``: ``W = W_O' W_V``, ``b = W_O' b_V``."""
    attn = layer.self_attn
    w = fold_vo(attn.v_proj.weight, attn.o_proj.weight, dims, 1.0).double()
    if attn.v_proj.bias is None:
        return w, None
    eye = torch.eye(dims.kv_heads * dims.head_dim, device=attn.o_proj.weight.device, dtype=attn.o_proj.weight.dtype)
    o_fold = fold_vo(eye, attn.o_proj.weight, dims, 1.0).double()
    return w, o_fold @ attn.v_proj.bias.double()


def fit_layer(stats: LayerStats, method: str, rank: int, lambdas: Sequence[float] = LAMBDAS) -> FittedMap:
    """Fit ``method`` on the fit moments for each lambda and keep the one with the lowest squared
    error on the select moments. The map is fitted on the fit text alone: the select text stays
    unseen by the fit, so the later map-or-alpha choice on it is out of sample. HARP's unscaled
    V.O error on the select text is recorded beside."""
    fit, val = stats.fit, stats.val
    scale = float(torch.diagonal(fit.xx).mean()) / max(fit.n, 1)
    best = None
    for lam in lambdas:
        f = _solve(fit, method, rank, lam * scale)
        e = val.sq_error(f.weight(), f.bias)
        if best is None or e < best[0]:
            best = (e, lam, f)
    e, lam, f = best
    f.lam = lam
    denom = max(val.yy, 1e-30)
    f.select_rel_error = e / denom
    f.harp_rel_error = val.sq_error(stats.harp_w, stats.harp_b) / denom
    f.fit_rel_error = fit.sq_error(f.weight(), f.bias) / max(fit.yy, 1e-30)
    return f


def _solve(m: Moments, method: str, rank: int, ridge: float) -> FittedMap:
    eye = torch.eye(m.h, dtype=torch.float64, device=m.xx.device)
    if method == "lmmse":
        cxx, cyx = m.centred()
        w = torch.linalg.solve(cxx + ridge * m.n * eye, cyx.T).T
        bias = (m.sy - w @ m.sx) / m.n
        return FittedMap("lmmse", w, None, bias, ridge)
    if method != "rrr":
        raise ValueError(f"unknown fitted replacement {method!r}; rrr or lmmse")
    w = torch.linalg.solve(m.xx + ridge * m.n * eye, m.yx.T).T
    fitted_cov = w @ m.xx @ w.T
    _, vecs = torch.linalg.eigh((fitted_cov + fitted_cov.T) / 2)
    u = vecs[:, -rank:].flip(-1)   # top r eigenvectors, largest first
    return FittedMap("rrr", u.T @ w, u, None, ridge)


def hf_tensors(fmap: FittedMap, family: FamilySpec, dims: ModelDims, layer: int,
               dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that carry ``fmap`` in layer ``layer``.

    ``rrr``: v_proj = A (kv_dim x h), o_proj = B placed on each KV group's first query head (the
    group's other heads read zero columns), so ``o_proj(repeat_kv(v_proj(x))) = B A x`` exactly
    (the fold of ``harp_trt.fold.fold_vo`` sums a group's o_proj blocks, giving B back); a v_proj
    bias (Qwen2) is zero. ``lmmse``: ``self_attn.harp_linear.{weight,bias}`` (h x h), a tensor no
    standard checkpoint has, read by ``harp_trt.harp.HarpAttention`` only."""
    pre = family.layer_prefix.format(i=layer)
    cpu = lambda t: t.detach().to("cpu", dtype).contiguous()  # noqa: E731  checkpoint tensors live on the CPU
    if fmap.method == "lmmse":
        return {f"{pre}{FITTED_LINEAR}.weight": cpu(fmap.a), f"{pre}{FITTED_LINEAR}.bias": cpu(fmap.bias)}
    hd, n_rep = dims.head_dim, dims.heads // dims.kv_heads
    b = fmap.b.detach().cpu()
    o = torch.zeros(dims.hidden, dims.heads * hd, dtype=torch.float64)
    for g in range(dims.kv_heads):
        o[:, g * n_rep * hd: (g * n_rep + 1) * hd] = b[:, g * hd: (g + 1) * hd]
    out = {family.weight_name("v", layer): cpu(fmap.a),
           family.weight_name("o", layer): o.to(dtype).contiguous()}
    if family.qkv_bias:
        out[family.weight_name("vb", layer)] = torch.zeros(dims.kv_heads * hd, dtype=dtype)
    return out


FIT_INPUTS = ("sequential", "dense")  # which activations a map is fitted on (module docstring)


def fit_candidates(stack, fit_windows: torch.Tensor, select_windows: torch.Tensor, layers: Sequence[int],
                   method: str, inputs: str = "sequential") -> dict[int, "Fitted"]:
    """The fitted candidate of every layer of ``layers`` (``calib.search.Fitted``): maps fitted on
    ``fit_windows``, lambda chosen on ``select_windows``. Call on the dense model. On return every
    layer of ``layers`` is pruned with its fitted map installed (alpha 1): the state the search
    starts from, and the one each layer's map was fitted under with ``inputs="sequential"``."""
    from harp_trt.harp import apply_harp

    from .search import Fitted

    if inputs not in FIT_INPUTS:
        raise ValueError(f"fit inputs must be one of {', '.join(FIT_INPUTS)}, got {inputs!r}")
    windows = _stack_windows(fit_windows, select_windows)
    dims = ModelDims.from_config(stack.model.config)
    rank = dims.kv_heads * dims.head_dim
    out = {}

    def install(layer: int) -> None:
        apply_harp(stack.model, {layer: 1.0}, stack.family)
        stack.install_fitted(layer, out[layer].tensors)

    sequential = inputs == "sequential"
    for layer, stats in layer_moments(stack, windows, layers, int(fit_windows.shape[0]), refresh=sequential):
        fmap = fit_layer(stats, method, rank)
        out[layer] = Fitted(fmap, hf_tensors(fmap, stack.family, dims, layer, torch.float32))
        log.info("layer %d: %s lambda=%g, relative error fit %.4f select %.4f (HARP's V.O: %.4f)", layer, method,
                 fmap.lam, fmap.fit_rel_error, fmap.select_rel_error, fmap.harp_rel_error)
        if sequential:
            install(layer)  # the pass recomputes this layer before the next one reads it
    if not sequential:
        for layer in out:
            install(layer)
    return out


def _stack_windows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` over ``b`` as one ``[n_a + n_b, W]`` batch, the narrower right-padded with ``PAD``."""
    width = max(a.shape[1], b.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD)  # noqa: E731
    return torch.cat([pad(a), pad(b)])


def cost_record(method: str, dims: ModelDims) -> dict:
    """Multiply-adds per token of one replaced block: HARP's V.O (and ``rrr``) ``2 h kv_dim``,
    ``lmmse`` ``h^2``."""
    kv = dims.kv_heads * dims.head_dim
    harp = 2 * dims.hidden * kv
    mine = dims.hidden * dims.hidden if method == "lmmse" else harp
    return {"macs_per_token": mine, "harp_macs_per_token": harp, "ratio_to_harp": round(mine / harp, 4)}
