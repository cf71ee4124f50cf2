"""HARP in PyTorch (harp_trt.harp) against independent re-implementations, all four families."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny
from harp_trt.families import family_of
from harp_trt.harp import HarpAttention, apply_harp, harp_alphas
from harp_trt.hf_compat import holds_no_kv

TOL = 1e-5  # fp32, same math in a different order


# How each family's decoder layer is built, read off transformers' modeling code (modeling_llama.py,
# modeling_mistral.py, modeling_qwen2.py: ``LlamaDecoderLayer.forward``; modeling_gemma2.py:
# ``Gemma2DecoderLayer.forward``, ``Gemma2RMSNorm``), written here and not taken from ``FamilySpec``:
#   "pre-norm"  h += attn(input_ln(h));            h += mlp(post_attention_ln(h))        RMSNorm gain w
#   "sandwich"  h += post_attention_ln(attn(...)); h += post_ff_ln(mlp(pre_ff_ln(h)))    RMSNorm gain 1 + w
# HARP's alpha scales the attention block's contribution to the residual: o_proj(repeat_kv(v_proj(x)))
# for the pre-norm families, the post-attention norm's output for Gemma2 (README, the formula at the top).
# Qwen3 (modeling_qwen3.py ``Qwen3DecoderLayer.forward``) is pre-norm and Gemma3 (modeling_gemma3.py
# ``Gemma3DecoderLayer.forward``) is Gemma2's sandwich; their q_norm / k_norm sit on the Q/K paths HARP
# removes, so they do not enter the pruned layer.
LAYOUT = {"llama": ("pre-norm", 0.0), "mistral": ("pre-norm", 0.0), "qwen2": ("pre-norm", 0.0),
          "gemma2": ("sandwich", 1.0), "qwen3": ("pre-norm", 0.0), "gemma3": ("sandwich", 1.0)}


def _rms(x, norm, gain_offset):
    """RMSNorm by hand: x / sqrt(mean(x^2) + eps) * (gain_offset + w)."""
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (gain_offset + norm.weight)


def _expected_layer(family: str, layer, h, alpha):
    """One decoder layer with a HARP-pruned attention block, from the ORIGINAL module weights:
    repeat_kv as an explicit per-head loop, every projection, norm and the gated MLP by hand."""
    from transformers.activations import ACT2FN

    layout, offset = LAYOUT[family]
    attn, mlp = layer.self_attn, layer.mlp
    cfg = attn.config
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = _rms(h, layer.input_layernorm, offset)
    v = x @ attn.v_proj.weight.T + (attn.v_proj.bias if attn.v_proj.bias is not None else 0)
    blocks = [v[..., (i // (heads // kv)) * d: (i // (heads // kv) + 1) * d] for i in range(heads)]
    o = torch.cat(blocks, -1) @ attn.o_proj.weight.T + (attn.o_proj.bias if attn.o_proj.bias is not None else 0)
    act = ACT2FN[cfg.hidden_activation if layout == "sandwich" else cfg.hidden_act]

    def gated_mlp(y):
        return (act(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T

    if layout == "pre-norm":
        h = h + alpha * o
        return h + gated_mlp(_rms(h, layer.post_attention_layernorm, offset))
    h = h + alpha * _rms(o, layer.post_attention_layernorm, offset)
    return h + _rms(gated_mlp(_rms(h, layer.pre_feedforward_layernorm, offset)), layer.post_feedforward_layernorm, offset)


def _rope(decoder, h, pos):
    """The decoder's rotary tables (Gemma3 keeps one per layer type; a pruned layer reads none)."""
    import inspect

    if "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters:
        return decoder.rotary_emb(h, pos, "full_attention")
    return decoder.rotary_emb(h, pos)


@torch.inference_mode()
def test_pruned_layer_equals_formula(family):
    dense = make_tiny(family)
    h = torch.randn(2, 7, dense.config.hidden_size)
    layers = dense.model.layers
    expected = {l: _expected_layer(family, layers[l], h, a) for l, a in {1: 0.3, 3: 1.0}.items()}
    harp = apply_harp(make_tiny(family), {1: 0.3, 3: 1.0})
    rot = _rope(harp.model, h, torch.arange(7)[None])
    for l, exp in expected.items():
        got = harp.model.layers[l](h, attention_mask=None, position_embeddings=rot)
        assert (got - exp).abs().max() < TOL, f"layer {l}: max |diff| {(got - exp).abs().max():.3g}"


@torch.inference_mode()
def test_vo_equals_attention_restricted_to_self(family):
    """A standard attention block whose mask lets each token see only itself returns exactly
    o_proj(repeat_kv(v)): softmax over one key is 1 and RoPE does not touch V. HarpAttention must
    agree with the untouched module under that mask (independent of our repeat_kv)."""
    model = make_tiny(family, attn="eager")
    fam = family_of(model.config)
    orig = fam.layers(model)[2].self_attn
    x = torch.randn(2, 6, model.config.hidden_size)
    eye = torch.full((6, 6), float("-inf")).fill_diagonal_(0.0)[None, None].expand(2, 1, 6, 6)
    rot = _rope(fam.decoder(model), x, torch.arange(6)[None])
    ref, _ = orig(x, position_embeddings=rot, attention_mask=eye)
    apply_harp(model, {2: 1.0})
    got, _ = fam.layers(model)[2].self_attn(x)
    assert (got - ref).abs().max() < TOL


def test_q_and_k_are_deleted(family):
    model = make_tiny(family)
    before = sum(p.numel() for p in model.parameters())
    attn = family_of(model.config).layers(model)[1].self_attn
    qk_modules = [getattr(attn, n) for n in ("q_proj", "k_proj", "q_norm", "k_norm") if hasattr(attn, n)]
    qk = sum(p.numel() for m in qk_modules for p in m.parameters())   # QK-norm gains go with Q and K
    apply_harp(model, {1: 0.5, 2: 0.5})
    after = sum(p.numel() for p in model.parameters())
    assert before - after == 2 * qk
    names = [n for n, _ in model.named_parameters()]
    assert not any(("layers.1." in n or "layers.2." in n) and any(f"{r}_{m}" in n for r in "qk" for m in ("proj", "norm"))
                   for n in names)
    assert any("layers.0.self_attn.q_proj" in n for n in names)


@pytest.mark.parametrize("layers", [{2: 0.7, 3: 0.4}, {0: 0.5, 2: 1.0}, {0: 1.0, 1: 0.2, 3: 0.0},
                                    {0: 0.3, 1: 1.0, 2: 0.5, 3: 0.9}])
def test_generate_with_cache_matches_recompute(family, layers):
    """Greedy generate() through the KV cache equals full recomputation without a cache, and
    pruned layers hold no cache entries (also when layer 0 is pruned)."""
    model = apply_harp(make_tiny(family), layers)
    model.generation_config.eos_token_id = None  # compare full-length sequences
    ids = torch.randint(4, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    x = ids
    with torch.inference_mode():
        for _ in range(8):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, x)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    if len(layers) == 4:  # every layer pruned: nothing is cached at all
        assert all(getattr(l, "keys", None) is None or l.keys.numel() == 0 for l in cache.layers)
        return
    for i, layer in enumerate(cache.layers):
        assert holds_no_kv(layer) == (i in layers), i  # a DummyLayer (an empty layer before transformers 5.24)
        if i not in layers:
            assert layer.get_seq_length() == 5 + 8 - 1 and layer.keys.numel() > 0
    assert cache.get_seq_length() == 5 + 8 - 1


@torch.inference_mode()
def test_eager_and_sdpa_agree():
    a = apply_harp(make_tiny("llama", attn="eager"), {1: 0.4, 3: 0.9})
    b = apply_harp(make_tiny("llama", attn="sdpa"), {1: 0.4, 3: 0.9})
    ids = torch.randint(0, 128, (2, 9))
    assert (a(ids).logits - b(ids).logits).abs().max() < 1e-4


@torch.inference_mode()
def test_alpha_zero_removes_block(family):
    model = apply_harp(make_tiny(family), {2: 0.0})
    fam = family_of(model.config)
    layer = fam.layers(model)[2]
    assert isinstance(layer.self_attn, HarpAttention) and layer.self_attn.v_proj is None
    assert harp_alphas(model) == {2: 0.0}
    h = torch.randn(1, 4, model.config.hidden_size)
    rot = _rope(fam.decoder(model), h, torch.arange(4)[None])
    assert torch.allclose(layer(h, attention_mask=None, position_embeddings=rot), fam.mlp_residual(layer, h))


def test_layer_out_of_range():
    with pytest.raises(IndexError):
        apply_harp(make_tiny("llama"), {4: 1.0})


def test_pruned_layer_0_slot_defers_to_first_kept_layer():
    """The cache slot of a pruned layer 0 holds nothing, and the cache's length and mask sizes are
    those of the first kept layer (not 0, which would restart positions): through ``Cache``, which
    in transformers 5.17/5.24 skips the slot and in 5.25 asks it directly, and through the slot
    itself, so the answer holds whichever release is installed."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    from harp_trt import hf_compat

    k = torch.zeros(1, 2, 5, 4)
    kept = DynamicLayer()
    kept.lazy_initialization(k, k)
    kept.keys, kept.values = k, k
    cache = DynamicCache()
    pruned = hf_compat.no_kv_layer(cache)
    cache.layers = [pruned, kept]
    assert hf_compat.holds_no_kv(pruned) and not hf_compat.holds_no_kv(kept)
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(1, 0) == (6, 0)
    assert pruned.get_seq_length() == 5 and pruned.get_mask_sizes(1) == (6, 0)
    assert hf_compat.no_kv_layer(DynamicCache()).get_seq_length() == 0  # a cache with no kept layer
    copied = copy.deepcopy(cache)  # the copied slot answers from the copied cache
    copied.layers[1].keys = copied.layers[1].values = torch.zeros(1, 2, 7, 4)
    assert copied.layers[0].get_seq_length() == 7 and pruned.get_seq_length() == 5
    cache.reset()  # every slot takes the whole-cache edits
    with pytest.raises(RuntimeError, match="keeps no KV cache"):
        pruned.update(k, k)


def test_cache_with_pruned_slot_is_freed_without_the_cycle_collector():
    """A cache whose pruned slots link back to it is freed when its last reference goes, not only
    by the cyclic garbage collector: a 7B decode batch's KV must not outlive its ``del``."""
    import gc
    import weakref

    from transformers.cache_utils import DynamicCache

    from harp_trt import hf_compat

    gc.disable()
    try:
        cache = DynamicCache()
        cache.layers = [hf_compat.no_kv_layer(cache)]
        alive = weakref.ref(cache)
        del cache
        assert alive() is None
    finally:
        gc.enable()
