"""Devices, dtypes and the sequential (one layer resident) mode: the same search results whether
the model is resident, spread by a device map, or read layer by layer from disk; bad device
requests get a one-line error and exit 2; device kind and dtype enter the calibrate key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harp_trt.calib.search import search_alphas
from conftest import save_tiny
from harp_trt.device import choose_sequential, resolve_placement
from harp_trt.errors import ConfigError
from harp_trt.layerwise import LayerStack
from test_calibrate_cli import calib_args, run_json, write_corpus

REL = 1e-6  # the bound; the paths are in fact bit-identical on one device


def _windows():
    return torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_sequential_search_equals_in_memory(tmp_path, family):
    folder = save_tiny(family, tmp_path / "m", num_hidden_layers=5)
    results = {}
    for mode in ("memory", "sequential", "device-map"):
        placement = resolve_placement("cpu", "float32", device_map="auto" if mode == "device-map" else None,
                                      sequential=(mode == "sequential") if mode != "device-map" else None)
        stack = LayerStack.open(folder, placement)
        assert stack.sequential is (mode == "sequential")
        res = search_alphas(stack, stack.family, _windows(), [1, 3, 4], grid=(0.0, 0.3, 0.7, 1.0),
                            state_budget_bytes=2 * 3 * 24 * 64 * 4)  # two candidates per pass: grouping exercised
        results[mode] = (res, stack.perplexity(_windows()), stack.loads)
    ref, ref_ppl, _ = results["memory"]
    for mode in ("sequential", "device-map"):
        res, ppl, loads = results[mode]
        assert res.alphas == ref.alphas
        assert abs(res.ppl_searched / ref.ppl_searched - 1) <= REL
        assert abs(ppl / ref_ppl - 1) <= REL
        for a, b in zip(res.trace, ref.trace):
            assert (a["layer"], a["alpha"]) == (b["layer"], b["alpha"]) and abs(a["ppl"] / b["ppl"] - 1) <= REL
    assert results["sequential"][2] > 5  # layers really were read from disk, more than once


def test_naive_search_on_a_sequential_stack(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "m")
    got = {}
    for seq in (False, True):
        stack = LayerStack.open(folder, resolve_placement("cpu", "float32", sequential=seq))
        got[seq] = search_alphas(stack, stack.family, _windows(), [2, 3], grid=(0.0, 1.0), naive=True)
    assert got[True].alphas == got[False].alphas
    assert abs(got[True].ppl_searched / got[False].ppl_searched - 1) <= REL


def test_auto_choice_follows_free_memory():
    p = resolve_placement("cpu", "float32")
    assert choose_sequential(p, 1) is False
    assert choose_sequential(p, 1 << 50) is True          # a petabyte of weights cannot be resident
    assert choose_sequential(resolve_placement("cpu", "float32", sequential=False), 1 << 50) is False
    assert choose_sequential(resolve_placement("cpu", "float32", device_map="auto"), 1 << 50) is False


def test_defaults_by_device():
    p = resolve_placement("cpu")
    assert (p.device, p.dtype, p.kind) == ("cpu", "float32", "cpu")
    if not torch.cuda.is_available():
        assert resolve_placement("auto").device == "cpu"


@pytest.mark.parametrize("kw,match", [
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"device": "cuda:x"}, "unknown device"),
    ({"device": "cpu:1"}, "unknown device"),
    ({"device": "cpu", "dtype": "float8"}, "--dtype must be one of"),
    ({"device": "cpu", "device_map": "everywhere"}, "--device-map must be one of"),
    ({"device": "cpu", "device_map": "auto", "sequential": True}, "exclude each other"),
])
def test_bad_placements(kw, match):
    with pytest.raises(ConfigError, match=match):
        resolve_placement(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_a_one_line_error(tmp_path, capsys):
    folder = save_tiny("llama", tmp_path / "m")
    corpus = write_corpus(tmp_path / "c.txt")
    capsys.readouterr()  # drop the save's progress output
    code, res, err = run_json(capsys, *calib_args(folder, corpus, tmp_path / "cache", "--device", "cuda"))
    assert code == 2 and res is None and "torch sees none" in err and len(err.strip().splitlines()) <= 2
    assert not list((tmp_path / "cache").glob("calibrate-*"))


def test_bf16_refused_on_a_gpu_without_it():
    from harp_trt.device import check_dtype

    with pytest.raises(ConfigError, match="cannot run bfloat16"):
        check_dtype("cuda", "bfloat16", bf16_supported=False)
    check_dtype("cpu", "bfloat16", bf16_supported=True)


@pytest.mark.slow
def test_calibrate_cli_sequential_same_plan_same_key(tmp_path, capsys):
    """--sequential gives the in-memory plan and hits its cache entry (placement is not in the key);
    another dtype is another artifact; the plan records which path ran."""
    folder = save_tiny("llama", tmp_path / "m")
    corpus = write_corpus(tmp_path / "c.txt")
    cache = tmp_path / "cache"
    code, a, _ = run_json(capsys, *calib_args(folder, corpus, cache, "--device", "cpu"))
    assert code == 0 and a["placement"]["path"] == "in-memory" and a["placement"]["dtype"] == "float32"
    code, b, _ = run_json(capsys, *calib_args(folder, corpus, tmp_path / "cache2", "--sequential"))
    assert code == 0 and b["placement"]["path"] == "sequential" and b["placement"]["layer_loads"] > 4
    assert b["alphas"] == a["alphas"] and b["layers"] == a["layers"]
    for k in ("dense", "searched", "heldout_searched"):
        assert abs(b["ppl"][k] / a["ppl"][k] - 1) <= REL
    assert Path(a["artifact"]).name == Path(b["artifact"]).name  # same key in both caches
    code, c, _ = run_json(capsys, *calib_args(folder, corpus, cache, "--dtype", "bfloat16"))
    assert code == 0 and Path(c["artifact"]).name != Path(a["artifact"]).name
    plan = json.loads((Path(c["artifact"]) / "plan.json").read_text())
    assert plan["extra"]["placement"]["dtype"] == "bfloat16"



