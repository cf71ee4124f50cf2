"""A real ``tritonserver`` (2.51 from the nvidia-pytriton wheel, CPU) serving repositories written by
``harp-trt deploy triton``:

* the ORT engine of a tiny HARP model (and of a tiny Qwen3 and Gemma3, the QK-norm families) as the
  text-in/text-out Python-backend model: HTTP
  ``generate`` and gRPC streaming give exactly ``harp-trt generate``'s greedy text, 8 concurrent
  streaming clients all get complete answers (and were batched together), bad requests get error
  responses and the server keeps serving;
* the TensorRT-LLM repository's Python pre/post-processing models, in the same server, around a
  stand-in for the C++ tensorrt_llm model (same config, Python backend).
Skipped with the reason where the server cannot run (not x86-64 Linux, static libpython)."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

import _tritonserver
from conftest import save_tiny
from harp_trt.cli import main
from test_calibrate_cli import run_json, write_corpus

pytestmark = pytest.mark.slow  # a real server or runtime behind every test



@pytest.fixture(autouse=True)
def _server_can_run():
    """A machine where the pytriton tritonserver cannot run fails these tests with the reason (one
    line): the suite's Triton coverage never vanishes in a green run."""
    if (why := _tritonserver.available()) is not None:
        pytest.fail(f"tritonserver cannot run here: {why}", pytrace=False)

PROMPT = "the model layer attention"
MAX_TOKENS = 10


def _http_json(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _sse(url: str, body: dict, timeout: float = 60.0) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


@pytest.fixture(scope="module")
def server(tmp_path_factory, test_cache):
    root = tmp_path_factory.mktemp("triton")
    cache = root / "cache"
    folder = save_tiny("llama", root / "tiny")
    corpus = write_corpus(root / "corpus.txt")
    assert main(["build", "--model", str(folder), "--layers", "2", "--tokens", "256", "--seq-len", "64",
                 "--alpha-grid", "0,0.5,1", "--corpus", str(corpus), "--workdir", str(cache), "--json"]) == 0
    engine = next(p for p in cache.glob("build-ort-*") if (p / "engine.json").is_file())
    repo = root / "repo"
    assert main(["deploy", "triton", "--artifact", str(engine), "--out", str(repo), "--prompt-limit", "40",
                 "--context-limit", "64", "--json"]) == 0
    # the QK-norm families (GroupQueryAttention fused around their per-head norms) beside it, as harp_<family>
    qk_engines = {}
    for fam in ("qwen3", "gemma3"):
        fam_cache = root / f"{fam}-cache"
        # Gemma3's tokenizer starts a prompt with BOS, as Gemma's does: the served model must feed it too
        tiny = save_tiny(fam, root / f"tiny_{fam}", seed=4, add_bos=fam == "gemma3")
        assert main(["build", "--model", str(tiny), "--layers", "2",
                     "--tokens", "256", "--seq-len", "64", "--alpha-grid", "0.5,1", "--corpus", str(corpus),
                     "--workdir", str(fam_cache), "--json"]) == 0
        fam_engine = next(p for p in fam_cache.glob("build-ort-*") if (p / "engine.json").is_file())
        assert main(["deploy", "triton", "--artifact", str(fam_engine), "--out", str(root / f"{fam}-repo"),
                     "--model-name", f"harp_{fam}", "--prompt-limit", "40", "--context-limit", "64", "--json"]) == 0
        shutil.move(str(root / f"{fam}-repo" / f"harp_{fam}"), str(repo / f"harp_{fam}"))
        qk_engines[fam] = (fam_engine, fam_cache)
    # the TensorRT-LLM repository of a tiny Qwen2, its C++ model replaced by a Python stand-in
    from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
    from harp_trt.builders.triton import TritonRepoConfig, write_repository
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    qwen = save_tiny("qwen2", root / "qwen")
    resolved = resolve_model(str(qwen), cache)
    plan = Plan(str(qwen), resolved.digest, "qwen2", 4, "test", (2, 3), (0.7, 0.0))
    art = TrtllmCheckpointStage().execute(ArtifactStore(cache), TrtllmCheckpointConfig(
        dtype="float32", max_batch_size=4, max_input_len=32, max_seq_len=64), {"plan": plan, "model": resolved})
    write_repository(art.path, root / "trt", TritonRepoConfig())
    for m in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing"):
        shutil.move(str(root / "trt" / m), str(repo / m))
    cfg = repo / "tensorrt_llm" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('backend: "tensorrtllm"', 'backend: "python"'))
    shutil.copy2(Path(__file__).parent / "assets" / "trtllm_standin.py", repo / "tensorrt_llm" / "1" / "model.py")
    srv = _tritonserver.start(repo, test_cache / "tritonserver")
    try:
        yield {"server": srv, "repo": repo, "engine": engine, "cache": cache, "qwen": qwen, "qk_norm": qk_engines}
    finally:
        srv.stop()


def _generate_cli(capsys, engine, cache) -> str:
    capsys.readouterr()
    code, res, _ = run_json(capsys, "generate", "--artifact", str(engine), "--prompt", PROMPT, "--max-new-tokens",
                            str(MAX_TOKENS), "--workdir", str(cache), "--json")
    assert code == 0
    return res["text"]


def test_http_and_grpc_match_harp_trt_generate(server, capsys):
    srv = server["server"]
    want = _generate_cli(capsys, server["engine"], server["cache"])
    params = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0})
    code, body = _http_json(f"{srv.http}/v2/models/harp/generate",
                            {"text_input": PROMPT, "stream": False, "sampling_parameters": params,
                             "exclude_input_in_output": True})
    assert code == 200 and body["text_output"] == want
    code, body = _http_json(f"{srv.http}/v2/models/harp/generate",
                            {"text_input": PROMPT, "stream": False, "sampling_parameters": params})
    assert body["text_output"] == PROMPT + want  # the prompt first unless exclude_input_in_output
    events = _sse(f"{srv.http}/v2/models/harp/generate_stream",
                  {"text_input": PROMPT, "stream": True, "sampling_parameters": params})
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == want
    client = _load_client(server["repo"])
    assert client.stream_text(srv.grpc, "harp", PROMPT, {"max_tokens": MAX_TOKENS}) == want


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qk_norm_engines_serve_harp_trt_generates_text(server, family, capsys):
    """A QK-norm family's HARP engine (Qwen3; Gemma3 with local and global layers), served by the same
    Python-backend model, gives exactly ``harp-trt generate``'s greedy text. Gemma3's tokenizer adds
    BOS: its repository says so (``add_special_tokens``) and the served prompt starts with it, as
    `harp-trt generate`'s does (tests/test_bos.py holds that to transformers' own encoding): a prompt
    of 40 characters, the repository's prompt limit in tokens, is 41 tokens there and 40 for Qwen3."""
    srv = server["server"]
    cfg = (server["repo"] / f"harp_{family}" / "config.pbtxt").read_text()
    import re

    flag = re.search(r'key: "add_special_tokens"\s*value\s*\{\s*string_value: "(\w+)"', cfg)
    assert flag and flag.group(1) == ("true" if family == "gemma3" else "false"), cfg
    want = _generate_cli(capsys, *server["qk_norm"][family])
    params = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0})
    code, body = _http_json(f"{srv.http}/v2/models/harp_{family}/generate",
                            {"text_input": PROMPT, "stream": False, "sampling_parameters": params,
                             "exclude_input_in_output": True})
    assert code == 200 and body["text_output"] == want and want
    code, body = _http_json(f"{srv.http}/v2/models/harp_{family}/generate",
                            {"text_input": "a" * 40, "stream": False, "sampling_parameters": params})
    if family == "gemma3":
        assert code != 200 and "prompt has 41 tokens, over the limit of 40" in json.dumps(body), body
    else:
        assert code == 200, body


def _largest_batches_logged(srv, since: int, timeout: float = 10.0) -> list[int]:
    """The model's "largest decode batch so far" log lines written after byte ``since`` of the
    server log (the Python-backend stub relays them asynchronously: wait for one)."""
    import re
    import time

    t0 = time.monotonic()
    while True:
        found = [int(n) for n in re.findall(rb"harp\[\w+\]: largest decode batch so far: (\d+) sequences",
                                            srv.log.read_bytes()[since:])]
        if found or time.monotonic() - t0 > timeout:
            return found
        time.sleep(0.2)


def test_eight_concurrent_streams_complete(server):
    srv = server["server"]
    client = _load_client(server["repo"])
    log_start = srv.log.stat().st_size
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    results: dict[int, str] = {}
    errors: list[str] = []

    def one(i):
        try:
            results[i] = client.stream_text(srv.grpc, "harp", prompts[i], {"max_tokens": 24, "ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(8))
    # batched together: the model decoded several of these streams in one graph call (its own log;
    # Triton's statistics count one execution per request, as the model batches inside itself)
    batches = _largest_batches_logged(srv, log_start)
    assert batches and max(batches) >= 2, (batches, srv.log_tail())
    # complete: each equals the same request served alone (greedy; batched decoding is exact here)
    for i, p in enumerate(prompts):
        code, alone = _http_json(f"{srv.http}/v2/models/harp/generate",
                                 {"text_input": p, "stream": False, "exclude_input_in_output": True,
                                  "sampling_parameters": json.dumps({"max_tokens": 24, "ignore_eos": True})})
        assert code == 200 and results[i] == alone["text_output"] and results[i]


@pytest.mark.parametrize("body,match", [
    ({"text_input": "", "stream": False}, "text_input is empty"),
    ({"text_input": "x" * 60, "stream": False}, "over the limit of 40"),
    ({"text_input": PROMPT, "stream": False, "sampling_parameters": json.dumps({"max_tokenz": 3})},
     "unknown sampling parameter"),
    ({"text_input": PROMPT, "stream": False, "sampling_parameters": json.dumps({"max_tokens": 60})},
     "exceeds the limit of 64"),
])
def test_bad_requests_get_errors_and_the_server_keeps_serving(server, body, match):
    srv = server["server"]
    code, reply = _http_json(f"{srv.http}/v2/models/harp/generate", body)
    assert code == 400 and match in reply.get("error", ""), reply
    ok_code, ok = _http_json(f"{srv.http}/v2/models/harp/generate",
                             {"text_input": PROMPT, "stream": False, "sampling_parameters": '{"max_tokens": 3}'})
    assert ok_code == 200 and ok["text_output"] and srv.ready()


def test_trtllm_pre_and_postprocessing_in_the_server(server):
    """text -> preprocessing (real tokenizer) -> stand-in -> postprocessing (real detokenizer), compared
    with the tokenizer folder the repository ships (the model folder's own config.json would make
    transformers 5 rebuild this tiny tokenizer as a Qwen2 one; the shipped folder is what the
    container's transformers 4.x reads: tokenizer.json as written)."""
    from transformers import AutoTokenizer

    srv = server["server"]
    tok = AutoTokenizer.from_pretrained(server["repo"] / "preprocessing" / "1" / "tokenizer")
    code, body = _http_json(f"{srv.http}/v2/models/ensemble/generate", {"text_input": "hello world", "max_tokens": 5})
    assert code == 200, body
    ids = tok("hello world", add_special_tokens=True)["input_ids"]
    assert body["text_output"] == tok.decode(ids[::-1][:5], skip_special_tokens=True)


def _load_client(repo: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("harp_llm_client", repo / "client.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
