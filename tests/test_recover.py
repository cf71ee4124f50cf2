"""End-to-end recovery (calibrate --recover maps, calib/recover.py): training the pruned layers'
replacement parameters lowers the select text's KL to the dense model and keeps every shape; a
recovery that does not win keeps the layer-wise model; the plan reads back with the same perplexity
one layer at a time; the rewritten ONNX with the trained tensors verifies against PyTorch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harp_trt.calib.recover import RecoverySettings, _mean_kl, dense_teacher, recover
from harp_trt.device import resolve_placement
from harp_trt.harp import apply_harp, harp_alphas
from harp_trt.layerwise import LayerStack
from harp_trt.plan import FITTED_FILE, Plan
from test_calibrate_cli import assert_refused, calib_args, run_json, tiny, write_corpus  # noqa: F401
from test_rewrite import _plan, exports  # noqa: F401  (fixtures)

PRUNED = {2: 1.0, 3: 0.5}


def _windows(folder: Path, tmp_path: Path, n: int, seed: int) -> torch.Tensor:
    from harp_trt.data import load_corpus, token_windows
    from harp_trt.models import load_tokenizer

    corpus = load_corpus(str(write_corpus(tmp_path / f"c{seed}.txt", docs=16, words=150, seed=seed)), tmp_path)
    return token_windows(load_tokenizer(folder), corpus, "calib", 64, 64 * n)


def _stack(folder: Path, dtype: str = "float32") -> LayerStack:
    return LayerStack.open(folder, resolve_placement("cpu", dtype))


def _recovered(folder, tmp_path, settings, dtype="float32"):
    """(stack, result, select teacher, the layer-wise model's select KL) for the top two layers of
    the tiny model in ``folder``, pruned at ``PRUNED``'s alphas, then recovered."""
    stack = _stack(folder, dtype)
    fit_w, sel_w = _windows(folder, tmp_path, 12, 1), _windows(folder, tmp_path, 6, 2)
    fit, sel = dense_teacher(stack, fit_w, 2), dense_teacher(stack, sel_w, 2)
    apply_harp(stack.model, PRUNED, stack.family)
    before = _mean_kl(stack, sel)
    return stack, recover(stack, sorted(PRUNED), fit, sel, settings), sel, before


def test_recovery_lowers_the_select_kl_and_keeps_every_shape(trained_qwen2, tmp_path):
    """On a trained tiny Qwen2 (GQA, a v bias) with its top two layers pruned (alphas 1 and 0.5),
    40 Adam steps lower the select text's KL to the dense model by over 10 %; the kept state is
    the one the record names (its KL recomputed, 1e-5 relative); every trained tensor has the shape
    of the weight it replaces; both layers end at alpha 1 (0.5 folded into o_proj)."""
    from safetensors import safe_open

    stack, out, sel, before = _recovered(trained_qwen2, tmp_path, RecoverySettings(steps=40, lr=1e-3, eval_every=10))
    rec = out.record
    assert out.kept and rec["select_kl_start"] == pytest.approx(before, rel=1e-6)
    assert rec["select_kl_best"] < 0.9 * rec["select_kl_start"], rec
    assert _mean_kl(stack, sel) == pytest.approx(rec["select_kl_best"], rel=1e-5)
    assert harp_alphas(stack.model, stack.family) == {2: 1.0, 3: 1.0}
    with safe_open(str(next(trained_qwen2.glob("*.safetensors"))), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert out.layers == [2, 3] and len(out.tensors) == 6  # v, o and the v bias of each layer
    for name, t in out.tensors.items():
        assert tuple(t.shape) == shapes[name], name
    assert rec["tokens_seen"] == 40 * 63 and rec["steps"] <= 40 and rec["peak_rss_bytes"] > 0


def test_a_recovery_that_does_not_win_keeps_the_layerwise_model(trained_qwen2, tmp_path):
    """A learning rate that diverges never beats the start on the select text: nothing is kept and
    the model computes the layer-wise plan's logits (alpha 0.5 folded into o_proj, 1e-5)."""
    stack = _stack(trained_qwen2)
    probe = _windows(trained_qwen2, tmp_path, 2, 3)
    apply_harp(stack.model, PRUNED, stack.family)
    ref = stack.model(probe).logits
    del stack
    stack, out, _, _ = _recovered(trained_qwen2, tmp_path, RecoverySettings(steps=6, lr=0.5, eval_every=2,
                                                                             patience=2))
    assert not out.kept and out.tensors == {} and out.record["select_kl_best"] == out.record["select_kl_start"]
    torch.testing.assert_close(stack.model(probe).logits, ref, rtol=1e-5, atol=1e-5)


def test_recovery_of_a_bf16_model_runs_under_autocast(trained_qwen2, tmp_path):
    """A bfloat16 model trains float32 master weights under autocast (the GPU path, here on the
    CPU): the select KL falls and the trained layers are bfloat16 again."""
    stack, out, _, _ = _recovered(trained_qwen2, tmp_path, RecoverySettings(steps=20, lr=1e-3, eval_every=10),
                                  dtype="bfloat16")
    assert out.kept and out.record["select_kl_best"] < 0.95 * out.record["select_kl_start"]
    attn = stack.family.layers(stack.model)[3].self_attn
    assert attn.v_proj.weight.dtype == attn.o_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("replacement", ["harp", "rrr"])
def test_calibrate_recover_writes_a_plan_that_reads_back(trained_qwen2, tmp_path, capsys, replacement):
    """calibrate --recover maps: the plan records the recovery and its layer-wise perplexities
    beside, its held-out perplexity is below the layer-wise one, every pruned layer is a fitted
    layer at alpha 1 carried by replacement.safetensors, and ``harp-trt eval`` rebuilds that model
    one layer at a time from the artifact with the plan's held-out perplexity (1e-5 relative)."""
    corpus = write_corpus(tmp_path / "c.txt", docs=40, words=150, seed=5)
    cache = tmp_path / "cache"
    args = calib_args(trained_qwen2, corpus, cache) + ["--tokens", "1024", "--replacement", replacement,
                                                       "--recover", "maps", "--recover-tokens", "2048",
                                                       "--recover-steps", "30", "--recover-lr", "0.001",
                                                       "--prune-layers", "0,1"]
    code, res, err = run_json(capsys, *args)
    assert code == 0, err
    art = Path(res["artifact"])
    plan = json.loads((art / "plan.json").read_text())
    rec, ppl = plan["extra"]["recovery"], plan["ppl"]
    assert rec["kept"] and rec["select_kl_best"] < 0.5 * rec["select_kl_start"], rec
    # the plan's figures are the recovered model's; the layer-wise ones stay beside (this tiny model's
    # layer-wise plan reads below dense perplexity on the search text, so KL, not perplexity, must fall)
    assert {"searched_layerwise", "select_searched_layerwise", "heldout_searched_layerwise"} <= set(ppl)
    assert ppl["heldout_searched"] != ppl["heldout_searched_layerwise"]
    assert res["fitted_layers"] == plan["layers"] and plan["alphas"] == [1.0, 1.0]
    assert plan["extra"]["replacement"]["method"] == replacement and (art / FITTED_FILE).is_file()
    split = plan["extra"]["search_split"]
    assert (split["search"]["documents"], split["select"]["documents"]) == ("even of even", "odd of even")
    code, ev, err = run_json(capsys, "eval", "--plan", str(art), "--tokens", "1024", "--seq-len", "64",
                             "--corpus", str(corpus), "--workdir", str(cache), "--json", "--sequential")
    assert code == 0, err
    assert ev["searched"] == pytest.approx(ppl["heldout_searched"], rel=1e-5)


def test_recovery_settings_are_in_the_key_only_with_recover():
    """A plan without recovery keeps the key it had before recovery existed; with it, each of its
    settings changes the key."""
    from dataclasses import replace

    from harp_trt.calib.config import CalibrateConfig

    base = CalibrateConfig()
    assert not any(k.startswith("recover") for k in base.key_material())
    assert replace(base, recover_tokens=1024).key_material() == base.key_material()
    on = replace(base, recover="maps")
    for field, value in (("recover_tokens", 1024), ("recover_steps", 10), ("recover_lr", 1e-3)):
        assert replace(on, **{field: value}).key_material() != on.key_material(), field


@pytest.mark.parametrize("extra, needle", [
    (["--recover", "maps", "--objective", "paper"], "--recover trains on fixed windows"),
    (["--recover", "maps", "--recover-lr", "2"], "--recover-lr must lie in (0, 1)"),
    (["--recover", "maps", "--recover-tokens", "8"], "--recover-tokens at least one window"),
    (["--recover", "maps", "--sequential"], "needs the model in memory, not --sequential"),
])
def test_recover_bad_flags_are_refused(tiny, capsys, extra, needle):  # noqa: F811
    assert_refused(capsys, tiny, extra, needle)


def test_recover_refuses_gemma2(tmp_path, capsys):
    """Gemma2's alpha sits after the post-attention norm, where o_proj cannot absorb it: a typed
    error naming the family, exit 2, no artifact."""
    from conftest import save_tiny

    folder = save_tiny("gemma2", tmp_path / "g")
    assert_refused(capsys, (folder, write_corpus(tmp_path / "c.txt"), tmp_path / "cache"), ["--recover", "maps"],
                   "--recover does not support gemma2")


def test_rewrite_with_recovered_tensors_verifies(exports, tmp_path):  # noqa: F811
    """The trained V and O of a GQA Llama (every query head's block of o_proj trained, not rrr's
    first-head pattern) through the ONNX rewrite: its verification against the PyTorch model with
    the same tensors passes (fp32 logits within 1e-4 of their scale, 32 equal greedy tokens), and the
    graph has HARP's ops and weight shapes."""
    from harp_trt.rewrite.stage import RewriteConfig, RewriteStage

    store, export, resolved = exports("llama")
    stack = _stack(resolved.folder)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 128, (6, 32), generator=g)
    fit, sel = dense_teacher(stack, windows[:4], 1), dense_teacher(stack, windows[4:], 1)
    apply_harp(stack.model, {1: 0.7, 3: 1.0}, stack.family)
    out = recover(stack, [1, 3], fit, sel, RecoverySettings(steps=12, lr=1e-3, eval_every=4))
    assert out.kept, out.record
    folder = tmp_path / "plan"
    folder.mkdir()
    save_file(out.tensors, str(folder / FITTED_FILE))
    base = _plan(resolved, "llama", (1, 3), (1.0, 1.0))
    Plan(**{**base.__dict__, "extra": {"replacement": {"method": "harp", "layers": [1, 3], "file": FITTED_FILE}}}
         ).save(folder / "plan.json")
    art = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": Plan.load(folder), "model": resolved})
    assert art.manifest["max_abs_diff"] <= art.manifest["tolerance"], art.manifest
