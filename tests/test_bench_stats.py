"""Bench arithmetic without an engine: the ideal speed-up counted by hand, the paired bootstrap
confidence intervals and the gates read on them."""
from __future__ import annotations

import numpy as np
import pytest


# ---- the ideal, counted by hand -------------------------------------------------------------
def test_ideal_speedup_hand_counted():
    """Tiny llama: h=64, 4 heads x 16 (q=64), 2 KV heads (kv=32), MLP 128, vocab 128, 4 layers;
    layer 3 pruned at alpha=1. Decode after 9 tokens attends to T=10 keys."""
    from harp_trt.dims import ModelDims
    from harp_trt.flops import decode_flops, ideal_speedups, prefill_flops
    from harp_trt.families import FAMILIES

    d = ModelDims.from_config(FAMILIES.get("llama")().tiny_config())
    assert (d.hidden, d.q_dim, d.kv_dim, d.intermediate, d.vocab, d.num_layers) == (64, 64, 32, 128, 128, 4)
    # kept layer: Q 2*64*64 + K,V 2*2*64*32 + O 2*64*64 = 24576; MLP 3*2*64*128 = 49152;
    # scores 2*64*10 + softmax 4*4*10 + AV 2*64*10 = 2720  -> 76448
    # pruned layer: V 2*64*32 + folded O 2*32*64 + MLP = 57344; LM head 2*64*128 = 16384
    assert decode_flops(d, 9) == 4 * 76448 + 16384 == 322176
    assert decode_flops(d, 9, {3: 1.0}) == 3 * 76448 + 57344 + 16384 == 303072
    assert decode_flops(d, 9, {3: 0.0}) == 3 * 76448 + 49152 + 16384  # alpha = 0: MLP only
    # prefill of 3 tokens, last logits: kept = 73728*3 + 272*(1+2+3); pruned = 57344*3
    assert prefill_flops(d, 3) == 4 * (73728 * 3 + 272 * 6) + 16384 == 907648
    assert prefill_flops(d, 3, {3: 1.0}) == 3 * 222816 + 172032 + 16384 == 856864
    assert prefill_flops(d, 3, None, logits="all") == 907648 + 2 * 16384
    ideal = ideal_speedups(d, {3: 1.0}, [3], decode_context=9)
    assert ideal["prefill"][3]["ideal"] == pytest.approx(907648 / 856864, rel=1e-12)
    assert ideal["decode"]["ideal"] == pytest.approx(322176 / 303072, rel=1e-12)
    # bytes: weights (fp32) + KV of 9 tokens; pruned layer keeps V + folded O (2*64*32), no KV
    dense_params = 64 * 128 + 4 * (3 * 64 * 128 + 64 * 64 + 2 * 64 * 32 + 64 * 64)
    harp_params = 64 * 128 + 4 * 3 * 64 * 128 + 3 * (64 * 64 + 2 * 64 * 32 + 64 * 64) + 2 * 64 * 32
    assert ideal["decode_bytes"]["dense_bytes"] == 4 * (dense_params + 4 * 2 * 32 * 9)
    assert ideal["decode_bytes"]["harp_bytes"] == 4 * (harp_params + 3 * 2 * 32 * 9)
    # llama.cpp's deci GGUF stores the pruned layer as one h x h matrix (64*64), not V + O (2*64*32)
    from harp_trt.flops import decode_bytes_per_token
    folded_params = harp_params - 2 * 64 * 32 + 64 * 64
    assert decode_bytes_per_token(d, 9, {3: 1.0}, 2, 2, "folded") == 2 * (folded_params + 3 * 2 * 32 * 9)
    assert prefill_flops(d, 3, {3: 1.0}, pruned_form="folded") == 3 * 222816 + (2 * 64 * 64 + 49152) * 3 + 16384
    with pytest.raises(ValueError, match="pruned_form"):
        decode_bytes_per_token(d, 9, {3: 1.0}, pruned_form="hxh")


def test_sliding_window_caps_keys():
    from harp_trt.dims import ModelDims
    from harp_trt.flops import prefill_flops

    full = ModelDims(1, 8, 1, 1, 8, 8, 8, (None,))
    win = ModelDims(1, 8, 1, 1, 8, 8, 8, (2,))
    per_key = 2 * 8 + 4 * 1 + 2 * 8
    # keys over 4 tokens: full 1+2+3+4 = 10, window 2: 1+2+2+2 = 7
    assert prefill_flops(full, 4, logits="none") - prefill_flops(win, 4, logits="none") == per_key * 3


def _ci(point, low, high, pairs=5):
    return {"speedup": point, "speedup_ci95_low": low, "speedup_ci95_high": high, "pairs": pairs}


def test_check_gates_names_each_figure():
    from harp_trt.bench.stage.stage import check_gates
    from harp_trt.errors import GateError

    s = {"prefill_speedup": {"128": 1.3, "4096": 1.05}, "ppl": {"dense": 10.0, "harp": 10.4, "increase": 0.04},
         "decode_speedup": 1.2, "decode_context": 512,
         "speedups": {"prefill_128": _ci(1.3, 1.2, 1.4), "prefill_4096": _ci(1.05, 0.99, 1.09),
                      "inter_token_latency": _ci(1.2, 1.1, 1.3)}}
    assert len(check_gates(s, max_ppl_increase=0.05, min_speedup=0.98)) == 2
    with pytest.raises(GateError) as e:
        check_gates(s, max_ppl_increase=0.03, min_speedup=1.1)
    msg = str(e.value)
    assert ("prefill_4096 1.050x (95% CI 0.990-1.090): upper bound 1.090 below --min-speedup 1.1 "
            "(5 interleaved pairs)") in msg
    assert "held-out perplexity increase 4.00 %" in msg and e.value.exit_code == 1
    with pytest.raises(GateError, match="inter_token_latency at 512 tokens 1.200x .95% CI 1.100-1.300.: upper bound"):
        check_gates({"decode_speedup": 1.2, "decode_context": 512,
                     "speedups": {"inter_token_latency": _ci(1.2, 1.1, 1.3)}}, min_speedup=1.5)


def test_min_speedup_gate_fails_only_below_the_upper_bound():
    """The point estimate under the threshold is not a failure while the interval reaches it."""
    from harp_trt.bench.stage.stage import check_gates
    from harp_trt.errors import GateError

    s = {"prefill_speedup": {"2048": 1.031}, "speedups": {"prefill_2048": _ci(1.031, 0.992, 1.071)}}
    # point 1.031 < 1.05 <= upper 1.071: passes, says the comparison is not resolved
    (line,) = check_gates(s, min_speedup=1.05)
    assert line.startswith("prefill_2048 1.031x (95% CI 0.992-1.071) vs --min-speedup 1.05x: not resolved")
    (line,) = check_gates(s, min_speedup=1.071)  # threshold at the upper bound: still inside
    assert "not resolved" in line
    (line,) = check_gates(s, min_speedup=1.0)   # point above, lower bound below: not resolved either
    assert "not resolved" in line
    (line,) = check_gates(s, min_speedup=0.99)
    assert "resolved: the whole interval is at or above it" in line
    with pytest.raises(GateError) as e:
        check_gates(s, min_speedup=1.1)
    assert ("prefill_2048 1.031x (95% CI 0.992-1.071): upper bound 1.071 below --min-speedup 1.1 "
            "(5 interleaved pairs)") in str(e.value)


def test_min_speedup_gate_reads_summaries_without_intervals():
    """A cached summary from bench config version 1 (no ``speedups``): the point is both bounds."""
    from harp_trt.bench.stage.stage import check_gates, headline_speedup
    from harp_trt.errors import GateError

    old = {"prefill_speedup": {"128": 1.3, "4096": 1.05}, "decode_speedup": 1.2, "decode_context": 512}
    assert headline_speedup(old) == ("prefill_4096", 1.05, 1.05, 1.05, None)
    with pytest.raises(GateError) as e:
        check_gates(old, min_speedup=1.1)
    assert ("prefill_4096 1.050x (95% CI 1.050-1.050): upper bound 1.050 below --min-speedup 1.1 (no interval "
            "in this summary: the point value stands for both bounds)") in str(e.value)
    (line,) = check_gates(old, min_speedup=1.02)
    assert "1.050x" in line and "resolved" in line and "not resolved" not in line
    assert headline_speedup({"decode_speedup": 1.2, "decode_context": 512}) == (
        "inter_token_latency at 512 tokens", 1.2, 1.2, 1.2, None)
    assert headline_speedup({"prefill_speedup": {}}) is None


# ---- the paired interval ------------------------------------------------------------------------
def _pairs(rng, n, ratio, noise, drift=0.0):
    """Dense and HARP times of n interleaved pairs with a known dense/HARP ratio: lognormal noise per
    run, and a shared per-pair load factor (drift) that pairing must cancel."""
    load = np.exp(rng.normal(0.0, drift, n))
    dense = 100.0 * load * np.exp(rng.normal(0.0, noise, n))
    harp = 100.0 / ratio * load * np.exp(rng.normal(0.0, noise, n))
    return dense, harp


def test_ceiling_bounds_every_ideal_and_flags_only_whole_intervals_above_it():
    """L / (L - P) for SmolLM2's 30 layers at P = 8 is 1.3636; the FLOP and byte ideals never exceed
    it (they keep the MLPs, V.O and the LM head); a row is flagged only when its lower bound is above."""
    from harp_trt.flops import above_ceiling, ideal_speedups, speedup_ceiling
    from harp_trt.dims import ModelDims

    assert speedup_ceiling(30, 8) == pytest.approx(30 / 22) and speedup_ceiling(30, 0) == 1.0
    assert speedup_ceiling(4, 4) == float("inf")
    with pytest.raises(ValueError):
        speedup_ceiling(4, 5)
    d = ModelDims(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, num_layers=30, vocab=49152)
    ideal = ideal_speedups(d, {l: 1.0 for l in range(22, 30)}, [512, 8192], 8192)
    assert ideal["ceiling"] == pytest.approx(30 / 22)
    for v in (*(p["ideal"] for p in ideal["prefill"].values()), ideal["decode"]["ideal"],
              ideal["decode_bytes"]["ideal"], ideal["ttft"]["ideal"]):
        assert 1.0 < v < ideal["ceiling"]
    assert not above_ceiling(1.30, 30 / 22) and not above_ceiling(30 / 22, 30 / 22)
    assert above_ceiling(1.442, 30 / 22)  # genai's 8192 x 4 interval [1.442, 1.472] would be flagged
    assert not above_ceiling(None, 30 / 22)


def test_t_quantile_matches_scipy():
    from scipy import stats

    from harp_trt.stats import t_quantile

    for df in [1, 2, 3, 4, 5, 7, 10, 30, 100, 1000]:
        for p in (0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9), (p, df)
    assert t_quantile(0.975, 4) == pytest.approx(2.776, abs=1e-3)  # the 5-pair multiplier
    with pytest.raises(ValueError):
        t_quantile(0.4, 3)


def test_ratio_interval_across_runs_is_scipys_t_interval_on_log_ratios():
    """The interval the docs print beside a median of runs: scipy's t interval of the runs' log ratios,
    exponentiated; wider than the runs' range for 3 close runs; none for one run."""
    from scipy import stats

    from harp_trt.stats import ratio_ci95_across_runs

    runs = [1.313, 1.305, 1.299]
    logs = np.log(runs)
    lo, hi = stats.t.interval(0.95, len(runs) - 1, loc=logs.mean(), scale=stats.sem(logs))
    got = ratio_ci95_across_runs(runs)
    assert got == pytest.approx((np.exp(lo), np.exp(hi)), rel=1e-9)
    assert got[0] < min(runs) and got[1] > max(runs)
    assert ratio_ci95_across_runs([1.3]) is None


def test_paired_speedup_point_and_degenerate_cases():
    from harp_trt.bench.stage.latency import paired_speedup

    r = paired_speedup([2.0, 8.0], [1.0, 2.0])  # ratios 2 and 4: geometric mean sqrt(8)
    assert r["speedup"] == pytest.approx(8 ** 0.5) and r["pairs"] == 2
    # by hand: logs ln2, ln4; mean 1.5 ln2, sd ln2 / sqrt2; half = 12.706 * sd / sqrt2 = 12.706 * ln2 / 2
    half = 12.7062047 * np.log(2) / 2
    assert r["speedup_ci95_low"] == pytest.approx(np.exp(1.5 * np.log(2) - half), rel=1e-6)
    assert r["speedup_ci95_high"] == pytest.approx(np.exp(1.5 * np.log(2) + half), rel=1e-6)
    assert paired_speedup([3.0], [2.0]) == {"speedup": 1.5, "speedup_ci95_low": 1.5, "speedup_ci95_high": 1.5,
                                            "pairs": 1}
    with pytest.raises(ValueError, match="equally many"):
        paired_speedup([1.0, 2.0], [1.0])


def test_paired_speedup_ci_contains_the_true_ratio_and_scales_with_noise():
    from harp_trt.bench.stage.latency import paired_speedup

    rng = np.random.default_rng(0)
    # the same standardised noise at two scales, centred so that the sample's geometric mean ratio
    # is the true one: the interval must sit around it, and its width must follow the noise
    z = rng.normal(0.0, 1.0, 10)
    z = (z - z.mean()) / z.std()
    low_noise = paired_speedup(100.0 * np.exp(0.002 * z), np.full(10, 100.0 / 1.05))
    high_noise = paired_speedup(100.0 * np.exp(0.10 * z), np.full(10, 100.0 / 1.05))
    for r in (low_noise, high_noise):
        assert r["speedup"] == pytest.approx(1.05, rel=1e-12)
        assert r["speedup_ci95_low"] < 1.05 < r["speedup_ci95_high"]
    width = {k: r["speedup_ci95_high"] - r["speedup_ci95_low"] for k, r in (("low", low_noise), ("high", high_noise))}
    assert width["low"] < 0.005 and width["high"] > 0.05 and width["high"] > 20 * width["low"]


def _percentile_bootstrap(d, h, rng, resamples=2000):
    """The interval the bench used before the across-runs statistics: 2.5/97.5 percentiles of resampled mean log ratios."""
    logs = np.log(np.asarray(d) / np.asarray(h))
    means = logs[rng.integers(0, logs.size, size=(resamples, logs.size))].mean(axis=1)
    return np.exp(np.percentile(means, [2.5, 97.5]))


@pytest.mark.parametrize("pairs", [3, 5])
def test_the_interval_covers_what_it_states_at_the_pair_counts_used(pairs):
    """By simulation, at the pair counts the benches use (``bench --repeats`` 5, long_context's
    prefill 3): the t interval covers the true ratio in >= 93 % of runs (nominal 95 %); the percentile
    bootstrap it replaced covers far less (about 76 % at 3 pairs, 84 % at 5), the review's finding."""
    from harp_trt.bench.stage.latency import paired_speedup

    rng = np.random.default_rng(pairs)
    runs, hits, boot_hits = 2000, 0, 0
    for _ in range(runs):
        d, h = _pairs(rng, pairs, 1.2, 0.04, drift=0.2)
        r = paired_speedup(d, h)
        hits += r["speedup_ci95_low"] <= 1.2 <= r["speedup_ci95_high"]
        lo, hi = _percentile_bootstrap(d, h, rng, 400)
        boot_hits += lo <= 1.2 <= hi
    assert 0.93 <= hits / runs <= 0.97, hits / runs
    assert boot_hits / runs < (0.80 if pairs == 3 else 0.88), boot_hits / runs


def test_pairing_cancels_shared_drift():
    """Load that hits both runs of a pair (the reason the bench interleaves) leaves the paired
    interval narrow; the same times unpaired would spread over the load's range."""
    from harp_trt.bench.stage.latency import paired_speedup

    d, h = _pairs(np.random.default_rng(1), 8, 1.05, 0.002, drift=0.3)
    r = paired_speedup(d, h)
    assert r["speedup_ci95_low"] < 1.05 < r["speedup_ci95_high"] < 1.06
    shuffled = paired_speedup(d, np.roll(h, 3))
    assert shuffled["speedup_ci95_high"] - shuffled["speedup_ci95_low"] > 10 * (
        r["speedup_ci95_high"] - r["speedup_ci95_low"])
