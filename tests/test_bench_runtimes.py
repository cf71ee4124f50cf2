"""The bench on the runtimes people run themselves: ``--engine genai`` (onnxruntime-genai's
og.Generator on the dense and HARP genai folders) next to ``--engine ort`` on the same graphs, from
one ``build --backend genai --bench`` on a tiny llama, and ``--engine llamacpp`` (llama.cpp on the
dense and HARP deci GGUFs, flash attention on) from ``build --backend gguf --bench`` on the same
plan: the same summary fields as the ORT bench, KV bytes per token as each runtime allocates them
((L-P)/L of dense), logits equal to ONNX Runtime's, and the CLI's engine choices and errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import save_tiny
from test_calibrate_cli import run_json, write_corpus

import onnxruntime_genai  # noqa: F401  (the test extra installs it: a missing runtime fails, never skips)

LAYERS, KEPT = 4, 2           # tiny llama, --layers 2: 2 of 4 layers keep a KV cache
LOGIT_TOL = 1e-5              # genai vs our ORT session on the same graph (measured: 0 to 2e-7)
KV_RATIO_TOL = 0.0            # KV bytes per allocated position: exactly kept/total
# llama.cpp (f16 GGUF weights, f16 KV cache) vs ORT's fp32 graph: max |diff| <= this x max(1, max |logit|),
# builders/gguf's f16 bound; measured 5e-4 at 9 tokens, growing to 3e-3 at 250 decoded ones
LLAMACPP_LOGIT_TOL = 1e-2
LLAMACPP_PPL_RTOL = 1e-3      # held-out perplexity, llama.cpp vs ORT (measured 2e-5)
# llama.cpp logs its KV size in MiB with 2 decimals: the tiny model's 1024 cells x 512 B = 0.50 MiB
# (dense), 0.25 MiB (HARP) are exact; the bound is the log's resolution over the smaller size
LLAMACPP_KV_TOL = 0.005 / 0.25
BENCH = ["--bench", "--bench-seq-lens", "16", "--bench-repeats", "2", "--bench-batch-sizes", "2",
         "--bench-threads", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("runtimes")
    folder = save_tiny("llama", d / "tiny", seed=7, max_position_embeddings=1024)
    corpus = write_corpus(d / "corpus.txt")
    return ["build", "--model", str(folder), "--layers", "2", "--tokens", "256", "--seq-len", "64",
            "--corpus", str(corpus), "--alpha-grid", "0,0.5,1", "--workdir", str(d / "cache"), "--json"]


@pytest.fixture(scope="module")
def genai_build(tiny):
    """``build --backend genai --bench`` (the genai bench, the backend's default) and the same
    build with ``--bench-engine ort`` (every step cached, the ORT engines benched)."""
    code, genai, err = _run(*tiny, "--backend", "genai", *BENCH)
    assert code == 0, err
    code, ort, err = _run(*tiny, "--backend", "genai", *BENCH, "--bench-engine", "ort")
    assert code == 0, err
    return {"genai": genai, "ort": ort}


@pytest.fixture(scope="module")
def gguf_build(tiny, genai_build):
    """``build --backend gguf --bench`` on the same model and plan (calibrate is a cache hit): the
    llamacpp bench of the dense and HARP GGUFs."""
    code, res, err = _run(*tiny, "--backend", "gguf", *BENCH)
    assert code == 0, err
    return res


def _run(*argv) -> tuple[int, dict | None, str]:
    """``run_json`` for module-scoped fixtures (no capsys there): the CLI's last JSON line."""
    import contextlib
    import io

    from harp_trt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    last = out.getvalue().strip().splitlines()[-1] if out.getvalue().strip() else ""
    return code, (json.loads(last) if last.startswith("{") else None), err.getvalue()


def _keys(d, prefix=""):
    """Every key path of a nested summary, lists and numbers as leaves."""
    out = set()
    for k, v in d.items():
        path = f"{prefix}{k}"
        out.add(path)
        if isinstance(v, dict) and k not in ("tasks", "task_splits"):
            out |= _keys(v, path + ".")
    return out


@pytest.mark.slow
def test_build_genai_bench_steps_and_fields(genai_build):
    g, o = genai_build["genai"], genai_build["ort"]
    assert list(g["stages"]) == ["calibrate", "export", "rewrite", "build", "build:dense", "build:genai",
                                 "build:genai-dense", "bench"]
    # the ORT comparison still works from the same build: only the bench is new
    assert list(o["stages"]) == ["calibrate", "export", "rewrite", "build", "build:dense", "build:genai", "bench"]
    assert all(o["stages"][s]["cached"] for s in o["stages"] if s != "bench")
    sg, so = g["bench"], o["bench"]
    assert (sg["engine"], so["engine"]) == ("genai", "ort")
    assert _keys(sg) == _keys(so)
    assert sg["layers"] == so["layers"] == [2, 3]
    # the same graphs: perplexity equal to the ORT bench's, greedy and teacher-forced agreement too
    assert sg["ppl"]["dense"] == pytest.approx(so["ppl"]["dense"], rel=1e-5)
    assert sg["ppl"]["harp"] == pytest.approx(so["ppl"]["harp"], rel=1e-5)
    assert sg["top1_agreement"] == so["top1_agreement"] and sg["greedy_match"] == so["greedy_match"]
    for name in ("prefill_16", "time_to_first_token", "inter_token_latency", "throughput_bs2"):
        ci = sg["speedups"][name]
        assert ci["pairs"] == 2 and ci["speedup_ci95_low"] <= ci["speedup"] <= ci["speedup_ci95_high"]
    assert sg["prefill_ideal"] == so["prefill_ideal"]   # both graphs compute every position's logits


@pytest.mark.slow
def test_genai_kv_bytes_as_allocated(genai_build):
    """KV bytes per position of the buffers genai allocated (present.* outputs): HARP keeps
    kept/total of dense (tolerance 0: both are whole buffers), equal to the counted figure and to
    the ORT bench's measured one (fp32, 2 KV heads x 16, K and V, 4 B)."""
    sg, so = genai_build["genai"]["bench"], genai_build["ort"]["bench"]
    kv, counted = sg["kv_bytes_per_token"], sg["kv_bytes_per_token_counted"]
    assert kv["harp"] < kv["dense"]
    assert abs(kv["harp"] / kv["dense"] - KEPT / LAYERS) <= KV_RATIO_TOL
    assert kv == {"dense": LAYERS * 2 * 32 * 4, "harp": KEPT * 2 * 32 * 4} == counted
    assert so["kv_bytes_per_token"] == kv and so["kv_bytes_per_token_counted"] == counted
    bench = Path(genai_build["genai"]["stages"]["bench"]["artifact"])
    assert "counted from the dimensions: dense 1024, HARP 512 B/token" in (bench / "report.md").read_text()


@pytest.fixture(scope="module")
def pairs(genai_build):
    """The genai and ORT engine pairs on the build's folders."""
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.bench.stage.engine_genai import load_genai_pair
    from harp_trt.bench.stage.engine_ort import load_ort_pair
    from harp_trt.plan import Plan

    st = genai_build["genai"]["stages"]
    plan = Plan.load(Path(st["calibrate"]["artifact"]))
    cfg = BenchConfig(decode_tokens=2, greedy_tokens=2, threads=1)
    g = load_genai_pair(plan, {"dense": st["build:genai-dense"]["artifact"], "harp": st["build:genai"]["artifact"]},
                        cfg)
    o = load_ort_pair(plan, {"dense": st["build:dense"]["artifact"], "harp": st["build"]["artifact"]}, cfg)
    yield g, o
    g.close()
    o.close()


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_genai_engine_logits_equal_ort(pairs, batch):
    """prefill, 6 decode steps (past the prefill's headroom of 3: batch 1 regrows its generator)
    and teacher-forced logits equal OrtCausalLM's on the same graph within LOGIT_TOL."""
    g, o = pairs
    ids = torch.randint(3, 100, (batch, 9), generator=torch.Generator().manual_seed(batch))
    for v in ("dense", "harp"):
        ge, oe = g.engines()[v], o.engines()[v]
        assert (ge.logits(ids) - oe.logits(ids)).abs().max() <= LOGIT_TOL
        lg, sg = ge.prefill(ids)
        lo, so = oe.prefill(ids)
        diffs = [float((lg - lo).abs().max())]
        steps = 6 if batch == 1 else 3
        for _ in range(steps):
            tok = lg.argmax(-1, keepdim=True)
            lg, sg = ge.decode(tok, sg)
            lo, so = oe.decode(tok, so)
            diffs.append(float((lg - lo).abs().max()))
        assert max(diffs) <= LOGIT_TOL, (v, diffs)
        kv_layers = LAYERS if v == "dense" else KEPT
        slots = ge.cache_tokens(sg)
        assert slots >= 9 + steps and ge.cache_bytes(sg) == batch * kv_layers * 2 * 32 * 4 * slots
    assert g.info["harp"]["kv_layers"] == [0, 1] and g.info["dense"]["kv_layers"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_genai_pair_refuses_folders_of_another_plan(pairs, genai_build):
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.bench.stage.engine_genai import load_genai_pair
    from harp_trt.errors import PreconditionError
    from harp_trt.plan import Plan

    st = genai_build["genai"]["stages"]
    plan = Plan.load(Path(st["calibrate"]["artifact"]))
    swapped = {"dense": st["build:genai"]["artifact"], "harp": st["build:genai-dense"]["artifact"]}
    with pytest.raises(PreconditionError, match=r"genai holds KV for layers \[0, 1, 2, 3\].*plan keeps \[0, 1\]"):
        load_genai_pair(plan, swapped, BenchConfig())


# ---- the CLI ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_choices_and_errors(genai_build, tiny, capsys):
    from harp_trt.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "{genai,llamacpp,ort,torch}" in out
    st = genai_build["genai"]["stages"]
    plan = st["calibrate"]["artifact"]
    base = ["bench", "--plan", plan, "--workdir", str(Path(plan).parent), "--json"]
    assert main(base + ["--engine", "genai"]) == 2
    assert "--engine genai needs --dense-engine DIR and --harp-engine DIR" in capsys.readouterr().err
    assert main(tiny + ["--backend", "genai", "--bench", "--bench-engine", "gena"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench engine 'gena'" in err and "did you mean 'genai'?" in err
    assert main(tiny + ["--backend", "ort", "--bench", "--bench-engine", "genai"]) == 2
    assert "backend ort builds no engines for the genai bench; its bench engines: ort, torch" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_cli_engine_genai_on_folders(genai_build, capsys):
    """`harp-trt bench --engine genai --dense-engine DIR --harp-engine DIR` on the build's folders."""
    from harp_trt.cli import main

    st = genai_build["genai"]["stages"]
    plan = st["calibrate"]["artifact"]
    code, res, err = run_json(capsys, "bench", "--plan", plan, "--workdir", str(Path(plan).parent), "--engine",
                              "genai", "--dense-engine", st["build:genai-dense"]["artifact"], "--harp-engine",
                              st["build:genai"]["artifact"], "--seq-lens", "16", "--decode-context", "16",
                              "--decode-tokens", "2", "--repeats", "1", "--batch-sizes", "none", "--no-accuracy",
                              "--json")
    assert code == 0, err
    assert res["engine"] == "genai" and res["kv_reduction"] == pytest.approx(LAYERS / KEPT, abs=0)
    assert json.loads((Path(res["artifact"]) / "summary.json").read_text())["kv_bytes_per_token"]["harp"] == 512


def test_backends_declare_registered_bench_engines():
    """Every backend's bench engines are registered bench engines and name steps it has."""
    from harp_trt.bench.stage.config import ENGINES
    from harp_trt.registry import BACKENDS

    for name in BACKENDS.names():
        spec = BACKENDS.get(name)
        steps = {s.name for s in spec.steps}
        for engine in spec.bench_names():
            ENGINES.check(engine)
            assert all(step in steps for _, step in spec.bench_engines(engine)), (name, engine)
    assert BACKENDS.get("genai").bench == "genai" and BACKENDS.get("ort").bench == "ort"


# ---- llama.cpp ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_build_gguf_bench_llamacpp_fields_and_kv(gguf_build, genai_build):
    """The llamacpp bench has the ORT bench's summary fields; llama.cpp's own KV accounting (flash
    attention on, f16 cache) gives HARP kept/total of dense, equal to the counted f16 figure; its
    held-out perplexity equals the ORT bench's within LLAMACPP_PPL_RTOL."""
    s, so = gguf_build["bench"], genai_build["ort"]["bench"]
    assert list(gguf_build["stages"]) == ["calibrate", "build", "build:dense", "bench"]
    assert gguf_build["stages"]["calibrate"]["cached"]
    assert s["engine"] == "llamacpp" and _keys(s) == _keys(so)
    kv, counted = s["kv_bytes_per_token"], s["kv_bytes_per_token_counted"]
    assert kv["harp"] < kv["dense"]
    assert abs(kv["harp"] / kv["dense"] - KEPT / LAYERS) <= LLAMACPP_KV_TOL
    assert counted == {"dense": LAYERS * 2 * 32 * 2, "harp": KEPT * 2 * 32 * 2}   # f16: 2 B per element
    for v in ("dense", "harp"):
        assert abs(kv[v] - counted[v]) <= LLAMACPP_KV_TOL * counted[v]
    assert s["ppl"]["dense"] == pytest.approx(so["ppl"]["dense"], rel=LLAMACPP_PPL_RTOL)
    assert s["ppl"]["harp"] == pytest.approx(so["ppl"]["harp"], rel=LLAMACPP_PPL_RTOL)
    # llama.cpp computes the last position's logits in a prefill (ORT's graph every position's): the
    # ideal counts one LM head, the same in dense and HARP, so it dilutes the ratio less
    from harp_trt.flops import prefill_flops
    from harp_trt.plan import Plan

    plan = Plan.load(Path(gguf_build["stages"]["calibrate"]["artifact"]))
    d = _dims(gguf_build)
    want = prefill_flops(d, 16, None, "last") / prefill_flops(d, 16, plan.alpha_map, "last")
    assert s["prefill_ideal"]["16"] == pytest.approx(want, rel=1e-12) and want > so["prefill_ideal"]["16"]
    for name in ("prefill_16", "time_to_first_token", "inter_token_latency", "throughput_bs2"):
        ci = s["speedups"][name]
        assert ci["pairs"] == 2 and ci["speedup_ci95_low"] <= ci["speedup"] <= ci["speedup_ci95_high"]


def _dims(build):
    from harp_trt.dims import ModelDims
    from transformers import AutoConfig

    plan = json.loads((Path(build["stages"]["calibrate"]["artifact"]) / "plan.json").read_text())
    return ModelDims.from_config(AutoConfig.from_pretrained(plan["model_ref"]))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_llamacpp_engine_logits_match_ort(gguf_build, pairs, batch):
    """llama.cpp's prefill, decode steps (batch 2 runs past its context's room: rebuilt and
    replayed) and teacher-forced logits against OrtCausalLM on the same plan, within
    LLAMACPP_LOGIT_TOL x max(1, max |logit|)."""
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.bench.stage.engine_llamacpp import load_llamacpp_pair
    from harp_trt.plan import Plan

    st = gguf_build["stages"]
    _, o = pairs
    pair = load_llamacpp_pair(Plan.load(Path(st["calibrate"]["artifact"])),
                              {"dense": st["build:dense"]["artifact"], "harp": st["build"]["artifact"]},
                              BenchConfig(decode_tokens=2, greedy_tokens=2, threads=1))
    try:
        ids = torch.randint(3, 100, (batch, 9), generator=torch.Generator().manual_seed(batch))
        for v in ("dense", "harp"):
            le, oe = pair.engines()[v], o.engines()[v]
            ref = oe.logits(ids)
            scale = max(1.0, float(ref.abs().max()))
            assert float((le.logits(ids) - ref).abs().max()) <= LLAMACPP_LOGIT_TOL * scale
            ll, sl = le.prefill(ids)
            lo, so = oe.prefill(ids)
            diffs = [float((ll - lo).abs().max())]
            cells = sl.context.cells
            for _ in range(cells - 9 + 2 if batch == 2 else 6):
                tok = lo.argmax(-1, keepdim=True)
                ll, sl = le.decode(tok, sl)
                lo, so = oe.decode(tok, so)
                diffs.append(float((ll - lo).abs().max()))
            assert max(diffs) <= LLAMACPP_LOGIT_TOL * scale, (v, max(diffs), scale)
            if batch == 2:
                assert sl.context.cells > cells   # rebuilt past its room
    finally:
        pair.close()


@pytest.mark.slow
def test_llamacpp_pair_refuses_gguf_of_another_plan(gguf_build):
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.bench.stage.engine_llamacpp import load_llamacpp_pair
    from harp_trt.errors import PreconditionError
    from harp_trt.plan import Plan

    st = gguf_build["stages"]
    plan = Plan.load(Path(st["calibrate"]["artifact"]))
    swapped = {"dense": st["build"]["artifact"], "harp": st["build:dense"]["artifact"]}
    with pytest.raises(PreconditionError, match=r"has no KV heads in layers \[\]; the plan prunes \[2, 3\]"):
        load_llamacpp_pair(plan, swapped, BenchConfig())


@pytest.mark.slow
def test_bench_cli_llamacpp_reads_the_gguf_context(gguf_build, capsys):
    """A GGUF engine's limit is its own ``{arch}.context_length`` (no config.json beside it)."""
    from harp_trt.cli import main

    st = gguf_build["stages"]
    plan = st["calibrate"]["artifact"]
    dense = str(Path(st["build:dense"]["artifact"]) / "model.gguf")
    assert main(["bench", "--plan", plan, "--workdir", str(Path(plan).parent), "--engine", "llamacpp",
                 "--dense-engine", dense, "--harp-engine", st["build"]["artifact"], "--seq-lens", "2000",
                 "--tasks", "none", "--json"]) == 2
    err = capsys.readouterr().err
    assert "--seq-lens [2000] exceed the model's context of 1024 tokens" in err and "model.gguf" in err
