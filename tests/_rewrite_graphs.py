"""The rewrite tests' graphs it did not export, built with onnx.helper from numpy weights: a tiny
Llama forward in numpy (the reference, HARP per arXiv 2507.01900 Eq. 4-5 from the *unfolded*
weights), an optimum-style graph and an onnxruntime-genai-style GroupQueryAttention graph, and the
step runner that compares them through prefill and decode with the KV cache."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper as oh, numpy_helper as onh

from harp_trt.rewrite.passes import HarpRewritePass

F = TensorProto.FLOAT
I64 = TensorProto.INT64
EPS = 1e-6


# ---- a tiny Llama in numpy --------------------------------------------------------------------
def make_weights(L=3, D=32, H=4, KV=2, hd=8, V=50, I=48, bias=False, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    w = {"cfg": dict(L=L, D=D, H=H, KV=KV, hd=hd, V=V, I=I, bias=bias), "embed": r(V, D) * 5,
         "norm": 1 + r(D), "lm_head": r(D, V), "layers": []}
    for _ in range(L):
        lw = {"in_norm": 1 + r(D), "wq": r(D, H * hd), "wk": r(D, KV * hd), "wv": r(D, KV * hd),
              "wo": r(H * hd, D), "post_norm": 1 + r(D), "wg": r(D, I), "wu": r(D, I), "wd": r(I, D)}
        if bias:
            lw.update(bq=r(H * hd), bk=r(KV * hd), bv=r(KV * hd))
        lw["pa_norm"] = 1 + r(D)  # used only by graphs built with a post-attention norm (Gemma2-like)
        w["layers"].append(lw)
    return w


def rope_tables(hd, max_pos=64, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(max_pos)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)  # [max_pos, hd/2]


def rms(x, g):
    return x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + EPS).astype(np.float32) * g


def np_forward(w, ids, mask, pos, past, alphas, post_attn=False):
    """Logits and present KV (pruned layers keep none). ``past``: {layer: (k, v)} [B,KV,P,hd].
    ``post_attn``: Gemma2-style norm of the attention output before the residual add."""
    c = w["cfg"]
    H, KV, hd = c["H"], c["KV"], c["hd"]
    cos_t, sin_t = rope_tables(hd)
    cos = np.concatenate([cos_t[pos]] * 2, -1)[:, None]  # [B,1,S,hd]
    sin = np.concatenate([sin_t[pos]] * 2, -1)[:, None]
    rot = lambda t: t * cos + np.concatenate([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
    B, S = ids.shape
    T = mask.shape[1]
    P = T - S
    allowed = (np.arange(T)[None, :] <= (P + np.arange(S))[:, None])[None] & (mask[:, None, :] > 0)
    h = w["embed"][ids]
    present = {}
    for i, lw in enumerate(w["layers"]):
        x = rms(h, lw["in_norm"])
        v = x @ lw["wv"] + (lw["bv"] if c["bias"] else 0)
        if i in alphas:  # HARP Eq. 4-5: h <- h + alpha * o_proj(repeat_kv(v_proj(x)))
            v_rep = np.repeat(v.reshape(B, S, KV, hd), H // KV, axis=2).reshape(B, S, H * hd)
            o = v_rep @ lw["wo"]
            h = h + alphas[i] * (rms(o, lw["pa_norm"]) if post_attn else o)
        else:
            q = x @ lw["wq"] + (lw["bq"] if c["bias"] else 0)
            k = x @ lw["wk"] + (lw["bk"] if c["bias"] else 0)
            q = rot(q.reshape(B, S, H, hd).transpose(0, 2, 1, 3))
            k = rot(k.reshape(B, S, KV, hd).transpose(0, 2, 1, 3))
            v = v.reshape(B, S, KV, hd).transpose(0, 2, 1, 3)
            pk, pv = past[i]
            k, v = np.concatenate([pk, k], 2), np.concatenate([pv, v], 2)
            present[i] = (k, v)
            kr, vr = np.repeat(k, H // KV, 1), np.repeat(v, H // KV, 1)
            s = q @ kr.transpose(0, 1, 3, 2) / np.sqrt(hd)
            s = np.where(allowed[:, None], s, -1e9)
            p = np.exp(s - s.max(-1, keepdims=True))
            p = p / p.sum(-1, keepdims=True)
            o = (p @ vr).transpose(0, 2, 1, 3).reshape(B, S, H * hd) @ lw["wo"]
            h = h + (rms(o, lw["pa_norm"]) if post_attn else o)
        y = rms(h, lw["post_norm"])
        g = y @ lw["wg"]
        h = h + ((g / (1 + np.exp(-g))) * (y @ lw["wu"])) @ lw["wd"]
    return rms(h, w["norm"]) @ w["lm_head"], present


# ---- graph builders ---------------------------------------------------------------------------
class _G:
    def __init__(self):
        self.nodes, self.inits, self.k = [], [], 0

    def c(self, arr, name=None):
        self.k += 1
        name = name or f"const_{self.k}"
        self.inits.append(onh.from_array(np.asarray(arr), name))
        return name

    def n(self, op, ins, name, outs=1, domain="", **attrs):
        out = [f"{name}_output_{j}" for j in range(outs)]
        self.nodes.append(oh.make_node(op, ins, out, name=name, domain=domain, **attrs))
        return out[0] if outs == 1 else out


def _rms_decomposed(g, x, gamma, p, gain=None):
    sq = g.n("Pow", [x, g.c(np.float32(2))], f"{p}/Pow")
    ms = g.n("ReduceMean", [sq, g.c(np.array([-1], np.int64))], f"{p}/ReduceMean", keepdims=1)
    sd = g.n("Sqrt", [g.n("Add", [ms, g.c(np.float32(EPS))], f"{p}/Add")], f"{p}/Sqrt")
    inv = g.n("Div", [g.c(np.float32(1)), sd], f"{p}/Div")
    return g.n("Mul", [g.n("Mul", [x, inv], f"{p}/Mul"), gain or g.c(gamma, f"{p}.weight")], f"{p}/Mul_1")


def _mlp(g, h, lw, p):
    y = _rms_decomposed(g, h, lw["post_norm"], f"{p}/post_attention_layernorm")
    gt = g.n("MatMul", [y, g.c(lw["wg"], f"{p}.mlp.gate_proj.weight")], f"{p}/mlp/gate_proj/MatMul")
    act = g.n("Mul", [gt, g.n("Sigmoid", [gt], f"{p}/mlp/act/Sigmoid")], f"{p}/mlp/act/Mul")
    up = g.n("MatMul", [y, g.c(lw["wu"], f"{p}.mlp.up_proj.weight")], f"{p}/mlp/up_proj/MatMul")
    dn = g.n("MatMul", [g.n("Mul", [act, up], f"{p}/mlp/Mul"), g.c(lw["wd"], f"{p}.mlp.down_proj.weight")],
             f"{p}/mlp/down_proj/MatMul")
    return g.n("Add", [h, dn], f"{p}/Add_1")


def _io(c, extra_inputs=()):
    ins = [oh.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
           oh.make_tensor_value_info("attention_mask", I64, ["batch", "total"]),
           *extra_inputs]
    outs = [oh.make_tensor_value_info("logits", F, ["batch", "seq", c["V"]])]
    for i in range(c["L"]):
        for kind in ("key", "value"):
            ins.append(oh.make_tensor_value_info(f"past_key_values.{i}.{kind}", F, ["batch", c["KV"], "past", c["hd"]]))
            outs.append(oh.make_tensor_value_info(f"present.{i}.{kind}", F, ["batch", c["KV"], "total", c["hd"]]))
    return ins, outs


def _rotary_and_mask(g, hd):
    """The rotary tables [B,1,S,hd] (gathered by ``position_ids``) and the additive mask [B,1,S,T]
    (padding and causal: query s sits at position P + s), as optimum writes them."""
    cos_t, sin_t = rope_tables(hd)
    cos = g.n("Gather", [g.c(np.concatenate([cos_t] * 2, -1), "cos_cached"), "position_ids"], "/model/rotary/Gather")
    sin = g.n("Gather", [g.c(np.concatenate([sin_t] * 2, -1), "sin_cached"), "position_ids"], "/model/rotary/Gather_1")
    ax1 = g.c(np.array([1], np.int64), "axis_1")
    cos = g.n("Unsqueeze", [cos, ax1], "/model/rotary/Unsqueeze")
    sin = g.n("Unsqueeze", [sin, ax1], "/model/rotary/Unsqueeze_1")
    # additive mask [B,1,S,T]: padding and causal (query s sits at position P + s)
    tot = g.n("Shape", ["attention_mask"], "/model/mask/Shape", start=1, end=2)
    new = g.n("Shape", ["input_ids"], "/model/mask/Shape_1", start=1, end=2)
    z = g.c(np.array(0, np.int64))
    one = g.c(np.array(1, np.int64))
    tot_s = g.n("Squeeze", [tot], "/model/mask/Squeeze")
    past_s = g.n("Squeeze", [g.n("Sub", [tot, new], "/model/mask/Sub")], "/model/mask/Squeeze_1")
    rows = g.n("Range", [past_s, tot_s, one], "/model/mask/Range")
    cols = g.n("Range", [z, tot_s, one], "/model/mask/Range_1")
    causal = g.n("Greater", [g.n("Unsqueeze", [cols, g.c(np.array([0], np.int64))], "/model/mask/Unsqueeze"),
                             g.n("Unsqueeze", [rows, ax1], "/model/mask/Unsqueeze_1")], "/model/mask/Greater")
    pad = g.n("Equal", [g.n("Unsqueeze", ["attention_mask", g.c(np.array([1, 2], np.int64))], "/model/mask/Unsqueeze_2"),
                        z], "/model/mask/Equal")
    blocked = g.n("Or", [g.n("Unsqueeze", [causal, g.c(np.array([0, 1], np.int64))], "/model/mask/Unsqueeze_3"), pad],
                  "/model/mask/Or")
    mask = g.n("Where", [blocked, g.c(np.float32(-1e9)), g.c(np.float32(0))], "/model/mask/Where")
    return cos, sin, mask


def _optimum_attention(g, x, lw, i, c, cos, sin, mask, k, sdpa):
    """Layer ``i``'s attention on the normed input ``x``: projections (with bias where ``c["bias"]``),
    decomposed rotary, the KV concat into ``present.{i}.*``, repeat_kv, the scores (``sdpa``, see
    ``build_optimum``) and o_proj. ``k``: the shared constants."""
    H, KV, hd = c["H"], c["KV"], c["hd"]
    scale, sqrt_scale, zero_f, half, end, start0, lastax = (k[n] for n in ("scale", "sqrt_scale", "zero_f", "half",
                                                                          "end", "start0", "lastax"))
    p = f"/model/layers.{i}"
    heads = {}
    for name, nh in (("q", H), ("k", KV), ("v", KV)):
        t = g.n("MatMul", [x, g.c(lw[f"w{name}"], f"model.layers.{i}.self_attn.{name}_proj.weight")],
                f"{p}/self_attn/{name}_proj/MatMul")
        if c["bias"]:
            t = g.n("Add", [g.c(lw[f"b{name}"], f"model.layers.{i}.self_attn.{name}_proj.bias"), t],
                    f"{p}/self_attn/{name}_proj/Add")
        t = g.n("Reshape", [t, g.c(np.array([0, 0, nh, hd], np.int64))], f"{p}/self_attn/Reshape_{name}")
        heads[name] = g.n("Transpose", [t], f"{p}/self_attn/Transpose_{name}", perm=[0, 2, 1, 3])
    for name in ("q", "k"):  # rotate_half rotary, decomposed
        t = heads[name]
        x1 = g.n("Slice", [t, start0, half, lastax], f"{p}/self_attn/rotary_{name}/Slice")
        x2 = g.n("Slice", [t, half, end, lastax], f"{p}/self_attn/rotary_{name}/Slice_1")
        rh = g.n("Concat", [g.n("Neg", [x2], f"{p}/self_attn/rotary_{name}/Neg"), x1],
                 f"{p}/self_attn/rotary_{name}/Concat", axis=-1)
        heads[name] = g.n("Add", [g.n("Mul", [t, cos], f"{p}/self_attn/rotary_{name}/Mul"),
                                  g.n("Mul", [rh, sin], f"{p}/self_attn/rotary_{name}/Mul_1")],
                          f"{p}/self_attn/rotary_{name}/Add")
    g.nodes.append(oh.make_node("Concat", [f"past_key_values.{i}.key", heads["k"]], [f"present.{i}.key"],
                                name=f"{p}/self_attn/Concat_k", axis=2))
    g.nodes.append(oh.make_node("Concat", [f"past_key_values.{i}.value", heads["v"]], [f"present.{i}.value"],
                                name=f"{p}/self_attn/Concat_v", axis=2))
    rep = {}
    for kind in ("key", "value"):  # repeat_kv: [B,KV,T,hd] -> [B,KV,n,T,hd] -> [B,H,T,hd]
        t = f"present.{i}.{kind}"
        shp = g.n("Shape", [t], f"{p}/self_attn/repeat_{kind}/Shape")
        tgt = g.n("Concat", [g.n("Slice", [shp, start0, g.c(np.array([2], np.int64))], f"{p}/self_attn/repeat_{kind}/Slice"),
                             g.c(np.array([H // KV], np.int64)),
                             g.n("Slice", [shp, g.c(np.array([2], np.int64)), g.c(np.array([4], np.int64))],
                                 f"{p}/self_attn/repeat_{kind}/Slice_1")], f"{p}/self_attn/repeat_{kind}/Concat", axis=0)
        t = g.n("Expand", [g.n("Unsqueeze", [t, g.c(np.array([2], np.int64))], f"{p}/self_attn/repeat_{kind}/Unsqueeze"), tgt],
                f"{p}/self_attn/repeat_{kind}/Expand")
        rep[kind] = g.n("Reshape", [t, g.c(np.array([0, H, -1, hd], np.int64))], f"{p}/self_attn/repeat_{kind}/Reshape")
    kt = g.n("Transpose", [rep["key"]], f"{p}/self_attn/Transpose_kt", perm=[0, 1, 3, 2])
    if sdpa == "plain":
        s = g.n("Mul", [g.n("MatMul", [heads["q"], kt], f"{p}/self_attn/MatMul"), scale], f"{p}/self_attn/Mul")
        pr = g.n("Softmax", [g.n("Add", [s, mask], f"{p}/self_attn/Add")], f"{p}/self_attn/Softmax", axis=-1)
    else:
        q = g.n("Mul", [heads["q"], sqrt_scale], f"{p}/self_attn/Mul_q")
        kt = g.n("Mul", [sqrt_scale, kt], f"{p}/self_attn/Mul_k")  # commuted: constant first
        s = g.n("MatMul", [q, kt], f"{p}/self_attn/MatMul")
        pr = g.n("Softmax", [g.n("Add", [mask, s], f"{p}/self_attn/Add")], f"{p}/self_attn/Softmax", axis=-1)
        nan = g.n("IsNaN", [pr], f"{p}/self_attn/IsNaN")
        if sdpa == "split-guard":
            pr = g.n("Where", [nan, zero_f, pr], f"{p}/self_attn/Where")
        else:
            pr = g.n("Where", [g.n("Not", [nan], f"{p}/self_attn/Not"), pr, zero_f], f"{p}/self_attn/Where")
    o = g.n("MatMul", [pr, rep["value"]], f"{p}/self_attn/MatMul_1")
    o = g.n("Reshape", [g.n("Transpose", [o], f"{p}/self_attn/Transpose_o", perm=[0, 2, 1, 3]),
                        g.c(np.array([0, 0, H * hd], np.int64))], f"{p}/self_attn/Reshape_o")
    o = g.n("MatMul", [o, g.c(lw["wo"], f"model.layers.{i}.self_attn.o_proj.weight")], f"{p}/self_attn/o_proj/MatMul")
    return o


def build_optimum(w, post_attn=None, sdpa="plain") -> onnx.ModelProto:
    """Llama/Qwen2 as optimum exports it (opset 18, no fused ops). ``post_attn``: add a
    decomposed post-attention RMSNorm before the residual add, whose gain is stored as the
    effective gain (``"gain"``) or as ``w`` with ``1 + w`` computed in the graph (``"offset"``).
    ``sdpa``: ``"plain"`` (scale after QK^T), or torch's SDPA decomposition as optimum-onnx 0.1.0
    writes it, ``sqrt(scale)`` on Q and on K^T, the mask added first, and a NaN guard after the
    softmax, ``Where(IsNaN(p), 0, p)`` (``"split-guard"``) or ``Where(Not(IsNaN(p)), p, 0)``
    (``"split-notguard"``). The real exports are tested in ``test_rewrite_real_exports.py``."""
    c = w["cfg"]
    hd = c["hd"]
    g = _G()
    h = g.n("Gather", [g.c(w["embed"], "model.embed_tokens.weight"), "input_ids"], "/model/embed_tokens/Gather")
    cos, sin, mask = _rotary_and_mask(g, hd)
    scale = g.c(np.float32(1 / np.sqrt(hd)), "attn_scale")
    sqrt_scale = g.c(np.float32(hd ** -0.25), "attn_sqrt_scale")
    zero_f = g.c(np.float32(0), "attn_zero")
    half = g.c(np.array([hd // 2], np.int64))
    end = g.c(np.array([hd], np.int64))
    start0 = g.c(np.array([0], np.int64))
    lastax = g.c(np.array([-1], np.int64))
    k = {"scale": scale, "sqrt_scale": sqrt_scale, "zero_f": zero_f, "half": half, "end": end, "start0": start0,
         "lastax": lastax}
    for i, lw in enumerate(w["layers"]):
        p = f"/model/layers.{i}"
        x = _rms_decomposed(g, h, lw["in_norm"], f"{p}/input_layernorm")
        o = _optimum_attention(g, x, lw, i, c, cos, sin, mask, k, sdpa)
        if post_attn == "gain":
            o = _rms_decomposed(g, o, lw["pa_norm"], f"{p}/post_attention_norm")
        elif post_attn == "offset":
            o = _rms_decomposed(g, o, None, f"{p}/post_attention_norm",
                                gain=g.n("Add", [g.c(lw["pa_norm"] - 1, f"{p}/post_attention_norm.weight"),
                                                 g.c(np.float32(1))], f"{p}/post_attention_norm/Add_1"))
        h = g.n("Add", [h, o], f"{p}/Add")
        h = _mlp(g, h, lw, p)
    hn = _rms_decomposed(g, h, w["norm"], "/model/norm")
    g.nodes.append(oh.make_node("MatMul", [hn, g.c(w["lm_head"], "lm_head.weight")], ["logits"], name="/lm_head/MatMul"))
    ins, outs = _io(c, [oh.make_tensor_value_info("position_ids", I64, ["batch", "seq"])])
    graph = oh.make_graph(g.nodes, "optimum_llama", ins, outs, g.inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9)


def build_gqa(w, packed=True, skip_norm=False) -> onnx.ModelProto:
    """Llama as onnxruntime-genai builds it: GroupQueryAttention with in-op rotary; with
    ``skip_norm`` the residual add and post-attention norm are one fused
    ``com.microsoft::SkipSimplifiedLayerNormalization`` (outputs: norm, -, -, residual sum)."""
    c = w["cfg"]
    H, KV, hd = c["H"], c["KV"], c["hd"]
    g = _G()
    cos_t, sin_t = rope_tables(hd)
    cos_c, sin_c = g.c(cos_t, "cos_cache"), g.c(sin_t, "sin_cache")
    h = g.n("Gather", [g.c(w["embed"], "model.embed_tokens.weight"), "input_ids"], "/model/embed_tokens/Gather")
    seqlens = g.n("Cast", [g.n("Sub", [g.n("ReduceSum", ["attention_mask", g.c(np.array([1], np.int64))],
                                               "/model/attn_mask_reformat/ReduceSum", keepdims=0),
                                       g.c(np.array(1, np.int64))], "/model/attn_mask_reformat/Sub")],
                  "/model/attn_mask_reformat/Cast", to=TensorProto.INT32)
    total = g.n("Cast", [g.n("Squeeze", [g.n("Shape", ["attention_mask"], "/model/attn_mask_reformat/Shape", start=1, end=2)],
                             "/model/attn_mask_reformat/Squeeze")], "/model/attn_mask_reformat/Cast_1", to=TensorProto.INT32)
    for i, lw in enumerate(w["layers"]):
        p = f"/model/layers.{i}"
        x = g.n("RMSNormalization", [h, g.c(lw["in_norm"], f"model.layers.{i}.input_layernorm.weight")],
                f"{p}/input_layernorm/RMSNorm", epsilon=EPS, axis=-1)
        if packed:
            wqkv = np.concatenate([lw["wq"], lw["wk"], lw["wv"]], 1)
            qkv = g.n("MatMul", [x, g.c(wqkv, f"model.layers.{i}.attn.qkv_proj.weight")], f"{p}/attn/qkv_proj/MatMul")
            if c["bias"]:
                qkv = g.n("Add", [qkv, g.c(np.concatenate([lw["bq"], lw["bk"], lw["bv"]]), f"model.layers.{i}.attn.qkv_proj.bias")],
                          f"{p}/attn/qkv_proj/Add")
            qkv_in = [qkv, "", ""]
        else:
            qkv_in = []
            for name in "qkv":
                t = g.n("MatMul", [x, g.c(lw[f"w{name}"], f"model.layers.{i}.attn.{name}_proj.weight")], f"{p}/attn/{name}_proj/MatMul")
                if c["bias"]:
                    t = g.n("Add", [t, g.c(lw[f"b{name}"], f"model.layers.{i}.attn.{name}_proj.bias")], f"{p}/attn/{name}_proj/Add")
                qkv_in.append(t)
        out = f"{p}/attn/GroupQueryAttention_output_0"
        g.nodes.append(oh.make_node(
            "GroupQueryAttention",
            qkv_in + [f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens, total, cos_c, sin_c],
            [out, f"present.{i}.key", f"present.{i}.value"], name=f"{p}/attn/GroupQueryAttention",
            domain="com.microsoft", num_heads=H, kv_num_heads=KV, do_rotary=1, rotary_interleaved=0,
            scale=float(1 / np.sqrt(hd))))
        o = g.n("MatMul", [out, g.c(lw["wo"], f"model.layers.{i}.attn.o_proj.weight")], f"{p}/attn/o_proj/MatMul")
        if skip_norm:
            y, _, _, h = g.n("SkipSimplifiedLayerNormalization", [o, h, g.c(lw["post_norm"], f"model.layers.{i}.post_norm.weight")],
                             f"{p}/post_attention_layernorm/SkipLayerNorm", outs=4, domain="com.microsoft", epsilon=EPS)
            gt = g.n("MatMul", [y, g.c(lw["wg"], f"{p}.mlp.gate_proj.weight")], f"{p}/mlp/gate_proj/MatMul")
            act = g.n("Mul", [gt, g.n("Sigmoid", [gt], f"{p}/mlp/act/Sigmoid")], f"{p}/mlp/act/Mul")
            up = g.n("MatMul", [y, g.c(lw["wu"], f"{p}.mlp.up_proj.weight")], f"{p}/mlp/up_proj/MatMul")
            dn = g.n("MatMul", [g.n("Mul", [act, up], f"{p}/mlp/Mul"), g.c(lw["wd"], f"{p}.mlp.down_proj.weight")],
                     f"{p}/mlp/down_proj/MatMul")
            h = g.n("Add", [h, dn], f"{p}/Add_1")
        else:
            h = g.n("Add", [h, o], f"{p}/residual_add/Add")
            h = _mlp(g, h, lw, p)
    hn = g.n("RMSNormalization", [h, g.c(w["norm"], "model.norm.weight")], "/model/norm/RMSNorm", epsilon=EPS, axis=-1)
    g.nodes.append(oh.make_node("MatMul", [hn, g.c(w["lm_head"], "lm_head.weight")], ["logits"], name="/lm_head/MatMul"))
    ins, outs = _io(c)
    graph = oh.make_graph(g.nodes, "genai_llama", ins, outs, g.inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23), oh.make_opsetid("com.microsoft", 1)], ir_version=10)


# ---- running ----------------------------------------------------------------------------------
def run_steps(sess_or_none, w, ids, mask, alphas, steps=3, use_pos=True, post_attn=False):
    """Prefill then ``steps`` decode steps (teacher-forced with the numpy argmax); returns the
    max |diff| between ORT and numpy over all valid logits, and how many KV inputs ORT needed."""
    c = w["cfg"]
    B = ids.shape[0]
    sess = sess_or_none
    names = {i.name for i in sess.get_inputs()}
    past_ort = {n: np.zeros((B, c["KV"], 0, c["hd"]), np.float32) for n in names if n.startswith("past")}
    past_np = {i: (np.zeros((B, c["KV"], 0, c["hd"]), np.float32),) * 2 for i in range(c["L"]) if i not in alphas}
    worst = 0.0
    cur, m = ids, mask
    for step in range(steps + 1):
        S = cur.shape[1]
        pos = (np.cumsum(m, -1) - 1).clip(min=0)[:, -S:]
        feeds = {"input_ids": cur, "attention_mask": m, **past_ort}
        if use_pos:
            feeds["position_ids"] = pos
        outs = sess.run(None, feeds)
        onames = [o.name for o in sess.get_outputs()]
        ref, pres = np_forward(w, cur, m, pos, past_np, alphas, post_attn=post_attn)
        valid = m[:, -S:] > 0
        worst = max(worst, float(np.abs(outs[0] - ref)[valid].max()))
        for n, v in zip(onames[1:], outs[1:]):
            past_ort[n.replace("present", "past_key_values")] = v
        past_np = pres
        nxt = ref[:, -1].argmax(-1)[:, None].astype(np.int64)
        cur, m = nxt, np.concatenate([m, np.ones((B, 1), np.int64)], 1)
    return worst, len(past_ort)


def session_of(model: onnx.ModelProto | ir.Model):
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def rewrite_proto(proto: onnx.ModelProto, alphas, num_layers):
    model = ir.from_proto(proto)
    result = HarpRewritePass(alphas, num_layers)(model)
    out = ir.to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    onnx.shape_inference.infer_shapes(out, strict_mode=True)
    return model, result


IDS = np.array([[5, 9, 13, 2, 7, 11], [0, 0, 4, 8, 15, 16]], np.int64)
MASK = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], np.int64)
