"""What ``bench/serve_load.py`` checks beside the figures: nothing is lost under load.

* ``bad_requests``: malformed requests sent while AIPerf keeps the server busy get Triton error
  responses with a clear message, and AIPerf's requests around them complete (its error count).
* ``greedy_matches``: greedy answers from the loaded server equal ``harp-trt generate``'s text
  (``OrtCausalLM.generate`` on the same engine and tokenizer).
* ``server_rss``: resident memory of the server and its Python-backend stubs (the models live there).
* ``kill_and_restart``: SIGKILL the server mid-load; the repository and the engines it serves are
  byte for byte unchanged, and a new server on the same repository serves again (seconds to the
  first good answer)."""
from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

__all__ = ["BAD_REQUESTS", "post", "bad_requests", "greedy_matches", "server_rss", "tree_digest",
           "kill_and_restart", "in_background"]

# (what, request body or None for a body that is not JSON, raw body); each must get an error response
BAD_REQUESTS: tuple[tuple[str, Any], ...] = (
    ("malformed sampling JSON", {"text_input": "hello", "sampling_parameters": "{max_tokens: 3"}),
    ("unknown sampling key", {"text_input": "hello", "sampling_parameters": json.dumps({"max_tokenz": 3})}),
    ("empty prompt", {"text_input": "", "sampling_parameters": json.dumps({"max_tokens": 3})}),
    ("prompt over the context", {"text_input": "word " * 20000, "sampling_parameters": json.dumps({"max_tokens": 3})}),
    ("max_tokens 0", {"text_input": "hello", "sampling_parameters": json.dumps({"max_tokens": 0})}),
    ("max_tokens huge", {"text_input": "hello", "sampling_parameters": json.dumps({"max_tokens": 10**9})}),
    ("wrong input type", {"text_input": "hello", "stream": "yes please"}),
    ("no text_input", {"sampling_parameters": json.dumps({"max_tokens": 3})}),
    ("body not JSON", b"{this is not json"),
)


def post(url: str, body: Any, timeout: float = 120.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": raw.decode(errors="replace")}


def bad_requests(http: str, model: str) -> list[dict[str, Any]]:
    """Each of ``BAD_REQUESTS`` once through ``generate``: status and Triton's error message."""
    rows = []
    for what, body in BAD_REQUESTS:
        t0 = time.perf_counter()
        status, res = post(f"{http}/v2/models/{model}/generate", body)
        rows.append({"request": what, "status": status, "error": str(res.get("error", ""))[:200],
                     "ok": status >= 400 and bool(res.get("error")), "seconds": round(time.perf_counter() - t0, 3)})
    return rows


def greedy_matches(http: str, model: str, engine: Path, prompts: list[str], max_tokens: int,
                   workdir: Path) -> list[dict[str, Any]]:
    """Greedy answers from the server against ``harp-trt generate``'s for the same engine and
    prompt (the CLI itself, run in this process: its stdout's last line is its JSON)."""
    import contextlib
    import io

    from harp_trt.cli import main as cli

    rows = []
    for p in prompts:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli(["generate", "--artifact", str(engine), "--prompt", p, "--max-new-tokens", str(max_tokens),
                        "--workdir", str(workdir), "--json"])
        want = json.loads(buf.getvalue().strip().splitlines()[-1])["text"] if code == 0 else None
        status, res = post(f"{http}/v2/models/{model}/generate",
                           {"text_input": p, "exclude_input_in_output": True,
                            "sampling_parameters": json.dumps({"max_tokens": max_tokens})})
        rows.append({"prompt": p[:40], "status": status, "generate_exit": code,
                     "equal": status == 200 and want is not None and res.get("text_output") == want})
    return rows


def server_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (the Python-backend stubs hold the models)."""
    from harp_trt.memory import proc_kib

    kids = {pid}
    for _ in range(3):
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) in kids:
                kids.add(int(stat.parent.name))
    return sum(proc_kib(f"/proc/{k}/status", "VmRSS") or 0 for k in kids)


def tree_digest(*folders: Path) -> str:
    """One sha256 over every file's relative path, size and bytes under ``folders``."""
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted(p for p in Path(folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f"{f.relative_to(folder)}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def kill_and_restart(server, start: Callable[[], Any], load: Callable[[], Any], guarded: list[Path],
                     model: str, after_s: float) -> tuple[Any, dict[str, Any]]:
    """Start ``load`` against ``server``, SIGKILL it after ``after_s`` seconds, then start a new
    server with ``start()``; returns (the new server, what was measured)."""
    before = tree_digest(*guarded)
    thread, _ = in_background(load)
    time.sleep(after_s)
    code = server.kill()
    thread.join(timeout=120)
    unchanged = tree_digest(*guarded) == before
    t0 = time.monotonic()
    new = start()
    ready = time.monotonic() - t0
    status, res = post(f"{new.http}/v2/models/{model}/generate",
                       {"text_input": "the model", "sampling_parameters": json.dumps({"max_tokens": 4})})
    return new, {"killed_after_s": after_s, "exit_code": code, "repository_and_engines_unchanged": unchanged,
                 "ready_s": round(ready, 2), "first_answer_s": round(time.monotonic() - t0, 2),
                 "first_answer_ok": status == 200 and bool(res.get("text_output"))}
