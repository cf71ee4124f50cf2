"""The bench on the runtimes people run themselves: ``--engine genai`` (onnxruntime-genai's
og.Generator on the dense and HARP genai folders) next to ``--engine ort`` on the same graphs, from
one ``build --backend genai --bench`` on a tiny llama: the same summary fields, KV bytes per token as
the runtime allocates them ((L-P)/L of dense), logits equal to ONNX Runtime's on the same graph, and
the CLI's engine choices and errors."""
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
BENCH = ["--bench", "--bench-seq-lens", "16", "--bench-repeats", "2", "--bench-batch-sizes", "2"]


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
    from bench.stage.config import BenchConfig
    from bench.stage.engine_genai import load_genai_pair
    from bench.stage.engine_ort import load_ort_pair
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


def test_genai_pair_refuses_folders_of_another_plan(pairs, genai_build):
    from bench.stage.config import BenchConfig
    from bench.stage.engine_genai import load_genai_pair
    from harp_trt.errors import PreconditionError
    from harp_trt.plan import Plan

    st = genai_build["genai"]["stages"]
    plan = Plan.load(Path(st["calibrate"]["artifact"]))
    swapped = {"dense": st["build:genai"]["artifact"], "harp": st["build:genai-dense"]["artifact"]}
    with pytest.raises(PreconditionError, match=r"genai holds KV for layers \[0, 1, 2, 3\].*plan keeps \[0, 1\]"):
        load_genai_pair(plan, swapped, BenchConfig())


# ---- the CLI ------------------------------------------------------------------------------------
def test_engine_choices_and_errors(genai_build, tiny, capsys):
    from harp_trt.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "{genai,ort,torch}" in out.replace("llamacpp,", "")
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
    from bench.stage.config import ENGINES
    from harp_trt.registry import BACKENDS

    for name in BACKENDS.names():
        spec = BACKENDS.get(name)
        steps = {s.name for s in spec.steps}
        for engine in spec.bench_names():
            ENGINES.check(engine)
            assert all(step in steps for _, step in spec.bench_engines(engine)), (name, engine)
    assert BACKENDS.get("genai").bench == "genai" and BACKENDS.get("ort").bench == "ort"
