"""HARP in PyTorch: the reference every later stage is checked against.

For a pruned layer l (arXiv 2507.01900, Sec. 3), with x = input_layernorm(h):

    h <- h + alpha_l * o_proj(repeat_kv(v_proj(x)))                      (HARP, Eq. 4-5)
    h <- h + alpha_l * post_attention_layernorm(o_proj(repeat_kv(v_proj(x))))   (Gemma2)

With its queries and keys removed the block is a per-token linear map V.O (no softmax, no RoPE),
so the layer needs no KV cache; alpha_l comes from the greedy search of Algorithm 1 and
``alpha_l = 0`` drops the block.

``apply_harp`` patches a Hugging Face ``*ForCausalLM`` in place: pruned layers get a
``HarpAttention`` (only v_proj/o_proj are kept, so Q/K memory is really freed) and every cache
the model sees holds a ``DummyLayer`` for them, so ``generate()`` allocates no KV for them."""
from __future__ import annotations

import logging
from typing import Mapping

import torch
from torch import nn

from .dims import ModelDims
from .families import FamilySpec, family_of
from .hf_compat import cache_kwarg, holds_no_kv, no_kv_layer
from .plan import FITTED_LINEAR

__all__ = ["HarpAttention", "ScaledNorm", "apply_harp", "set_alpha", "harp_alphas", "vo_output", "install_fitted"]

log = logging.getLogger(__name__)


class HarpAttention(nn.Module):
    """Drop-in replacement for ``self_attn`` of a pruned layer. Returns ``(alpha * V.O(x), None)``.

    ``alpha`` is applied here, except for families whose alpha sits after the post-attention
    norm (Gemma2), where ``ScaledNorm`` applies it and ``self.alpha`` stays 1."""

    def __init__(self, v_proj: nn.Linear | None, o_proj: nn.Linear | None, num_heads: int,
                 num_kv_heads: int, head_dim: int, layer_idx: int, alpha: float):
        super().__init__()
        self.v_proj = v_proj
        self.o_proj = o_proj
        self.harp_linear: nn.Linear | None = None  # a fitted full-rank map (calib.fit "lmmse") instead of V.O
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.alpha = float(alpha)

    def vo(self, x: torch.Tensor) -> torch.Tensor:
        """``o_proj(repeat_kv(v_proj(x)))`` per token; each query head h reads KV head h // n_rep
        (or the fitted ``harp_linear(x)`` where one is installed)."""
        if self.harp_linear is not None:
            return self.harp_linear(x)
        v = self.v_proj(x)
        n_rep = self.num_heads // self.num_kv_heads
        if n_rep > 1:
            v = v.unflatten(-1, (self.num_kv_heads, 1, self.head_dim))
            v = v.expand(*v.shape[:-3], self.num_kv_heads, n_rep, self.head_dim).flatten(-3)
        return self.o_proj(v)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.v_proj is None:  # alpha == 0: the block is removed entirely
            return torch.zeros_like(hidden_states), None
        out = self.vo(hidden_states)
        return (out if self.alpha == 1.0 else out * self.alpha), None

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, alpha={self.alpha}, heads={self.num_heads}, kv_heads={self.num_kv_heads}"


class ScaledNorm(nn.Module):
    """``alpha * norm(x)``: where Gemma2's HARP alpha sits (after post_attention_layernorm)."""

    transparent_child = "norm"  # checkpoint names skip the wrapper: post_attention_layernorm.weight

    def __init__(self, norm: nn.Module, alpha: float):
        super().__init__()
        self.norm = norm
        self.alpha = float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y if self.alpha == 1.0 else y * self.alpha



def apply_harp(model: nn.Module, alphas: Mapping[int, float], family: FamilySpec | None = None) -> nn.Module:
    """Prune the layers in ``alphas`` (layer index -> alpha) in place and return the model.

    Layers already pruned only get their alpha updated. Works for any set of layers."""
    family = family or family_of(model.config)
    layers = family.layers(model)
    d = ModelDims.from_config(model.config)
    heads, kv, hd = d.heads, d.kv_heads, d.head_dim
    for idx, alpha in sorted(alphas.items()):
        if not 0 <= idx < len(layers):
            raise IndexError(f"layer {idx} out of range 0..{len(layers) - 1}")
        layer = layers[idx]
        if not isinstance(layer.self_attn, HarpAttention):
            old = layer.self_attn
            keep = alpha != 0.0
            layer.self_attn = HarpAttention(old.v_proj if keep else None, old.o_proj if keep else None,
                                            heads, kv, hd, idx, 1.0)
            del old  # q_proj / k_proj (and the rotary use) go with it
        set_alpha(model, idx, alpha, family)
    _install_cache_hook(model, family)
    model.config.harp_alphas = {int(k): float(v) for k, v in harp_alphas(model, family).items()}
    return model


def set_alpha(model: nn.Module, idx: int, alpha: float, family: FamilySpec | None = None) -> None:
    """Change the alpha of an already pruned layer (used by the naive search)."""
    family = family or family_of(model.config)
    layer = family.layers(model)[idx]
    attn = layer.self_attn
    if not isinstance(attn, HarpAttention):
        raise ValueError(f"layer {idx} is not pruned")
    if alpha != 0.0 and attn.v_proj is None:
        raise ValueError(f"layer {idx} was pruned with alpha=0 (its V/O weights are gone)")
    if family.alpha_after_post_attn_norm:
        norm = layer.post_attention_layernorm
        if not isinstance(norm, ScaledNorm):
            layer.post_attention_layernorm = norm = ScaledNorm(norm, 1.0)
        norm.alpha = float(alpha)
        attn.alpha = 1.0
    else:
        attn.alpha = float(alpha)
    model.config.harp_alphas = {**getattr(model.config, "harp_alphas", {}), int(idx): float(alpha)}


def harp_alphas(model: nn.Module, family: FamilySpec | None = None) -> dict[int, float]:
    family = family or family_of(model.config)
    out = {}
    for i, layer in enumerate(family.layers(model)):
        if isinstance(layer.self_attn, HarpAttention):
            norm = layer.post_attention_layernorm
            out[i] = norm.alpha if isinstance(norm, ScaledNorm) else layer.self_attn.alpha
            if layer.self_attn.v_proj is None:
                out[i] = 0.0
    return out


def vo_output(family: FamilySpec, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The unscaled contribution of a pruned layer's attention block to the residual stream,
    i.e. the term alpha multiplies (after the post-attention norm for Gemma2)."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    if attn.v_proj is None:
        return torch.zeros_like(h)
    out = attn.vo(x)
    if family.alpha_after_post_attn_norm:
        norm = layer.post_attention_layernorm
        out = (norm.norm if isinstance(norm, ScaledNorm) else norm)(out)
    return out


def install_fitted(model: nn.Module, layer_idx: int, tensors: Mapping[str, torch.Tensor],
                   family: FamilySpec | None = None) -> None:
    """Put a fitted map (``calib.fit.hf_tensors``: checkpoint names -> tensors) into pruned layer
    ``layer_idx``: new v_proj/o_proj weights (``rrr``) or a ``harp_linear`` (``lmmse``). A layer
    whose parameters are on ``meta`` (a sequential ``LayerStack``) only gets the modules' shapes;
    the stack reads the tensors by name (``LayerStack.overlay``)."""
    family = family or family_of(model.config)
    layer = family.layers(model)[layer_idx]
    attn = layer.self_attn
    if not isinstance(attn, HarpAttention) or attn.v_proj is None:
        raise ValueError(f"layer {layer_idx} is not pruned with its V/O kept")
    prefix = family.layer_prefix.format(i=layer_idx) + "self_attn."
    local = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    meta = attn.o_proj.weight.device.type == "meta"
    linear = FITTED_LINEAR.removeprefix("self_attn.")
    if f"{linear}.weight" in local:
        w = local[f"{linear}.weight"]
        lin = nn.Linear(w.shape[1], w.shape[0], bias=f"{linear}.bias" in local, device=attn.o_proj.weight.device,
                        dtype=attn.o_proj.weight.dtype)
        if not meta:
            with torch.no_grad():
                lin.weight.copy_(w)
                if lin.bias is not None:
                    lin.bias.copy_(local[f"{linear}.bias"])
        attn.harp_linear = lin.requires_grad_(False)
        return
    if meta:
        return
    with torch.no_grad():
        for name in ("v_proj.weight", "o_proj.weight", "v_proj.bias"):
            if name in local:
                mod, _, p = name.partition(".")
                getattr(getattr(attn, mod), p).copy_(local[name])


# ---- KV cache: no entries for pruned layers ----------------------------------------------------
def _pruned_indices(model: nn.Module, family: FamilySpec) -> list[int]:
    return [i for i, l in enumerate(family.layers(model)) if isinstance(l.self_attn, HarpAttention)]


def _strip_cache(cache, pruned: list[int]) -> None:
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    for i in pruned:
        if i < len(layers):
            if not holds_no_kv(layers[i]):
                raise RuntimeError(f"cache already holds keys for pruned layer {i}")
            layers[i] = no_kv_layer(cache)


def _install_cache_hook(model: nn.Module, family: FamilySpec) -> None:
    """Make every cache the decoder receives (from ``generate()`` or created in forward) hold a
    ``DummyLayer`` for pruned layers, so no K/V is allocated for them and sequence-length queries
    go to the first kept layer."""
    decoder = family.decoder(model)
    if getattr(decoder, "_harp_cache_hook", None) is not None:
        return

    def hook(module, args, kwargs):
        pruned = _pruned_indices(model, family)
        name = cache_kwarg(module)  # "cache" (transformers >= 5.24) or "past_key_values"
        cache = kwargs.get(name)
        if cache is None and kwargs.get("use_cache", getattr(model.config, "use_cache", False)):
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=model.config)
            kwargs[name] = cache
        # with every layer pruned nothing reads the cache (no attention, no RoPE anywhere); keeping
        # its empty slots lets transformers' sequence-length queries still work
        if cache is not None and len(pruned) < len(family.layers(model)):
            _strip_cache(cache, pruned)
        return args, kwargs

    decoder._harp_cache_hook = decoder.register_forward_pre_hook(hook, with_kwargs=True)
