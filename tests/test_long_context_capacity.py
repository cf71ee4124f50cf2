"""``bench/_long_context_capacity.py``: KV capacity measured in child processes under a real
``RLIMIT_AS`` cap, on a tiny llama (head_dim 64 so one sequence's KV is 8 MiB at the contexts used:
fp32 4096 B/token x 2048 on ONNX Runtime, f16 2048 B/token x 4096 on llama.cpp). A try without a cap
fits and its KV is resident; a cap below the base fails; ``largest_batch``'s B fits and B + 1 does
not (again, in fresh children); the RSS split is positive and KV grows with B; ``measure_capacity``
puts dense and HARP under one cap with the formula beside them."""
from __future__ import annotations

import pytest

from conftest import make_tiny, save_tiny

import llama_cpp  # noqa: F401  (the test extra installs both: a missing runtime fails, never skips)
import onnxruntime  # noqa: F401

KW = dict(head_dim=64, max_position_embeddings=4096)
PRUNED = {2: 0.5, 3: 1.0}                 # HARP on layers 2 and 3 of 4: L/(L-P) = 2
CONTEXT = {"ort": 2048, "llamacpp": 4096}
KV_PER_TOKEN = {"ort": 4096, "llamacpp": 2048}   # dense: 4 layers x K,V x 2 heads x 64 x (fp32 | f16)
MIB = 2 ** 20


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Dense and HARP engines of one tiny llama: ORT engine folders (GroupQueryAttention) and deci GGUFs."""
    from harp_trt.builders.gguf.vocab import no_vocab
    from harp_trt.builders.gguf.writer import write_deci_gguf
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.export.export import export_dense
    from harp_trt.harp import apply_harp

    d = tmp_path_factory.mktemp("capacity")
    folder = save_tiny("llama", d / "tiny", seed=3, **KW)
    out = {"ort": {}, "llamacpp": {}}
    for v, alphas in (("dense", {}), ("harp", PRUNED)):
        model = make_tiny("llama", seed=3, **KW)
        if alphas:
            apply_harp(model, dict(alphas))
        OrtBuilder().build(export_dense(model, d / f"onnx-{v}"), d / f"ort-{v}",
                           OrtBuildConfig(attention="gqa", intra_op_threads=1))
        out["ort"][v] = d / f"ort-{v}"
        out["llamacpp"][v] = d / f"{v}.gguf"
        write_deci_gguf(folder, alphas, out["llamacpp"][v], dtype="f16", vocab=no_vocab("token ids only"))
    return out


def _probe(rt, engine, batch, cap=0, fill="short"):
    from harp_trt.bench._long_context_capacity import probe

    return probe(rt, engine, CONTEXT[rt], batch, cap, 1, fill=fill, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("rt", ["ort", "llamacpp"])
def test_a_try_without_a_cap_fits_with_its_kv_resident(engines, rt):
    p = _probe(rt, engines[rt]["dense"], 2)
    assert p["fits"] and p["returncode"] == 0 and p["error"] is None, p["error"]
    assert p["kv_bytes_per_token"] == KV_PER_TOKEN[rt]
    assert p["kv_bytes"] == 2 * CONTEXT[rt] * KV_PER_TOKEN[rt]       # 16 MiB, exact on both runtimes
    # the fill touched every page: RSS grew by the KV (ORT: written in place; llama.cpp: cleared at creation)
    assert p["rss_after_kv"] - p["base_rss"] >= 0.95 * p["kv_bytes"]
    assert p["vm_after_kv"] - p["base_vm"] >= p["kv_bytes"]
    assert p["peak_rss"] >= p["rss_after_kv"] and p["peak_vm"] >= p["vm_after_kv"]
    if rt == "ort":
        assert p["static_cache"] and p["fill"] == "direct"
    else:   # the KV is resident as soon as the context exists
        assert p["rss_after_context"] - p["base_rss"] >= 0.95 * p["kv_bytes"]
    base = _probe(rt, engines[rt]["dense"], 0)
    assert base["fits"] and "kv_bytes" not in base and base["base_vm"] > base["base_rss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("rt", ["ort", "llamacpp"])
def test_a_cap_below_the_base_does_not_fit(engines, rt):
    base = _probe(rt, engines[rt]["dense"], 0)
    p = _probe(rt, engines[rt]["dense"], 1, cap=base["base_vm"] // 2)
    assert not p["fits"]
    assert p["error"] and (p["returncode"] != 0 or p["error"].split(":")[0] in ("MemoryError", "PreconditionError"))


@pytest.mark.slow
@pytest.mark.parametrize("rt", ["ort", "llamacpp"])
def test_largest_batch_fits_and_one_more_does_not(engines, rt):
    from harp_trt.bench._long_context_capacity import largest_batch

    e = engines[rt]["dense"]
    base = _probe(rt, e, 0)
    per_seq = KV_PER_TOKEN[rt] * CONTEXT[rt]
    cap = int(base["base_vm"] + 10.5 * per_seq)
    expected = int((cap - base["base_vm"]) // per_seq)
    r = largest_batch(rt, e, CONTEXT[rt], cap, 1, expected, timeout=120)
    b, fill = r["batch"], "prefill" if rt == "llamacpp" else "short"
    assert 1 <= b <= expected == 10
    tried = {t["batch"]: t["fits"] for t in r["tries"]}
    assert tried.get(b + 1) is False or any(t["batch"] == b + 1 and not t["fits"] for t in r["confirmed"])
    if rt == "llamacpp":   # the answer is the prefill's: its last confirmed try
        assert r["confirmed"][-1]["batch"] == b and r["confirmed"][-1]["fits"]
        assert r["confirmed"][-1]["fill"] == "prefill" and r["confirmed"][-1]["rss_after_kv"] > 0
    # again, each in a fresh child: B fits, B + 1 does not
    again = [_probe(rt, e, b, cap, fill), _probe(rt, e, 1, cap, fill)]
    assert again[0]["fits"] and again[1]["fits"]
    assert not _probe(rt, e, b + 1, cap, fill)["fits"]
    split = r["rss_split"]
    assert split["weights_runtime"] > 0 and split["kv"] >= 0.95 * b * per_seq and split["activations"] >= 0
    assert split["kv_allocated"] == b * per_seq
    # KV (resident) grows with B across the fitting tries of one fill (a prefill touches more pages)
    kv = sorted((t["batch"], t["rss_after_kv"] - t["base_rss"]) for t in again)
    assert b > 1 and kv[1][1] - kv[0][1] >= 0.9 * (b - 1) * per_seq
    kv = sorted((t["batch"], t["rss_after_kv"] - t["base_rss"]) for t in r["tries"] if t["fits"])
    for (b0, kv0), (b1, kv1) in zip(kv, kv[1:]):
        assert kv1 - kv0 >= 0.9 * (b1 - b0) * per_seq


@pytest.mark.slow
@pytest.mark.parametrize("rt", ["ort", "llamacpp"])
def test_measure_capacity_dense_and_harp_under_one_cap(engines, rt):
    from harp_trt.bench._long_context_capacity import AUTO_SEQUENCES, measure_capacity

    r = measure_capacity(rt, engines[rt], CONTEXT[rt], None, 1, timeout=120)
    per_seq = KV_PER_TOKEN[rt] * CONTEXT[rt]
    assert r["cap_bytes"] == int(r["base"]["dense"]["base_vm"] + AUTO_SEQUENCES * per_seq)
    assert "10.5" in r["cap_rule"]
    assert r["kv_bytes_per_token"] == {"dense": KV_PER_TOKEN[rt], "harp": KV_PER_TOKEN[rt] / 2}
    assert r["ideal"] == 2.0 and r["expected"]["dense"] == 10 and r["expected"]["harp"] >= 20
    d, h = r["dense"]["batch"], r["harp"]["batch"]
    assert 1 <= d <= r["expected"]["dense"] and d < h <= r["expected"]["harp"]
    assert r["ratio"] == h / d and r["granularity"] == 1 / d and r["fraction_of_ideal"] == r["ratio"] / 2
    assert r["dense"]["cap_bytes"] == r["harp"]["cap_bytes"] == r["cap_bytes"]
    if rt == "ort":   # ~0.5 MiB of activations: the formula's counts, to one sequence
        assert d >= 9 and r["fraction_of_ideal"] >= 0.9


@pytest.mark.slow
def test_bad_arguments_are_errors_not_failed_tries(engines, capsys):
    from harp_trt.bench._long_context_capacity import largest_batch, main, probe
    from harp_trt.errors import ConfigError

    with pytest.raises(ConfigError, match="0 < steps < context"):
        probe("ort", engines["ort"]["dense"], 3, 1, 0, 1)
    with pytest.raises(ConfigError, match="valid are ort, llamacpp"):
        probe("vllm", engines["ort"]["dense"], 64, 1, 0, 1)
    with pytest.raises(ConfigError, match="needs a cap"):
        largest_batch("ort", engines["ort"]["dense"], 64, 0, 1, 1)
    assert main(["probe", "--runtime", "ort", "--engine", str(engines["ort"]["dense"]), "--context", "2",
                 "--batch", "1", "--steps", "3"]) == 2
    assert "0 < steps < context" in capsys.readouterr().err


@pytest.mark.slow
def test_the_peak_is_the_childs_own(engines):
    """Linux keeps getrusage's ru_maxrss across fork and exec: a child that read it reported its
    parent's peak (5.5 GiB of "activations" on SmolLM2 from a bench process holding its engines). With
    1 GiB touched here first, the child's activations (peak RSS less RSS after the fill) stay small."""
    import numpy as np

    big = np.ones(2 ** 30 // 8)   # every page touched: this process's peak RSS rises by 1 GiB
    p = _probe("ort", engines["ort"]["dense"], 1)
    del big
    assert p["fits"] and p["peak_rss"] - p["rss_after_kv"] < 64 * MIB, (p["peak_rss"], p["rss_after_kv"])


def test_peak_rss_bytes_is_the_processs_own():
    """``harp_trt.memory.peak_rss_bytes`` (every benchmark's peak RSS) reads VmHWM: a child started
    after this process touched 1 GiB reports its own small peak, and this process its 1 GiB."""
    import subprocess
    import sys

    import numpy as np

    from harp_trt.memory import peak_rss_bytes

    big = np.ones(2 ** 30 // 8)
    child = subprocess.run([sys.executable, "-c", "from harp_trt.memory import peak_rss_bytes as p; print(p())"],
                           capture_output=True, text=True, check=True)
    assert peak_rss_bytes() >= 2 ** 30
    del big
    assert 0 < int(child.stdout.strip()) < 512 * MIB, child.stdout
