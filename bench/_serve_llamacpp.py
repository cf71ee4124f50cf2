"""llama.cpp's own OpenAI-compatible server beside Triton: ``python -m llama_cpp.server``
(llama-cpp-python's ``[server]`` extra, our ``serve-llamacpp`` extra) serving the plan's dense and HARP
deci GGUFs, one server process each, driven by the same AIPerf through its standard ``completions``
endpoint.

That server holds one ``Llama`` object and serves one request at a time (llama_cpp/server/app.py:
``get_llama_proxy`` takes ``llama_outer_lock``, then ``llama_inner_lock``, which it holds until the
response has ended). By default (``interrupt_requests=True``) a request that arrives while another
streams cuts that stream short (``get_event_publisher`` sends ``[DONE]`` once the outer lock is
taken); it is started here with ``--interrupt_requests False`` so requests queue and each gets its
tokens. AIPerf's per-request records show the serialisation: ``streams_in_flight`` stays at 1 at any
concurrency. EOS and the other special tokens are banned (``logit_bias``), so every request produces
``--osl`` tokens as Triton's ``ignore_eos`` does."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

from harp_trt.errors import HarpError

__all__ = ["MODULES", "available", "LlamaServer", "banned_special_tokens", "start_pair", "describe", "extra_inputs"]

# llama_cpp.server imports these (llama-cpp-python's [server] extra)
MODULES = ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
# llama-cpp-python 0.3.36 segfaults decoding a q4_0 or q8_0 model with llama.cpp's extra CPU buffer types
# (weight repacking for AMX) on a CPU with AMX tiles, as harp_trt/llamacpp_runtime.py: LlamaModel records;
# its Llama() has no switch for them (llama_cpp/llama.py: Llama.__init__ takes llama_model_default_params()),
# so a quantized GGUF's server starts with those defaults patched to the plain CPU buffers
PLAIN_CPU_BUFFERS = ("import runpy\nimport llama_cpp.llama_cpp as C\n_default = C.llama_model_default_params\n"
                     "def _plain():\n    p = _default()\n    p.use_extra_bufts = False\n    return p\n"
                     "C.llama_model_default_params = _plain\n"
                     "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n")


def available() -> str | None:
    """None when ``python -m llama_cpp.server`` can start here, else why not (one line)."""
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    return (f"llama-cpp-python's server needs {', '.join(missing)}: pip install 'harp-trt[serve-llamacpp]'"
            if missing else None)


class LlamaServer:
    """One ``llama_cpp.server`` process serving ``gguf`` as model ``name`` on a free local port."""

    def __init__(self, gguf: Path, name: str, n_ctx: int, threads: int, log: Path, timeout: float = 300.0,
                 plain_cpu_buffers: bool = False):
        from harp_trt.triton_runtime import free_ports, http_ok, wait_ready

        self.name, self.port = name, free_ports(1)[0]
        self.log = log
        launch = ["-c", PLAIN_CPU_BUFFERS] if plain_cpu_buffers else ["-m", "llama_cpp.server"]
        cmd = [sys.executable, *launch, "--model", str(gguf), "--model_alias", name,
               "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(n_ctx),
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--flash_attn", "True",
               "--interrupt_requests", "False"]
        self.command = cmd
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        startup = wait_ready(self.proc, lambda: http_ok(f"{self.http}/v1/models", timeout=2), timeout, poll=0.5)
        if startup is None:
            self.stop()
            raise HarpError(f"llama_cpp.server for {gguf} did not come up: {log.read_text()[-1500:]}")
        self.startup_s = startup

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def banned_special_tokens(tokenizer: Path) -> dict[str, float]:
    """``logit_bias`` that bans every special token of the model's tokenizer (EOS among them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    return {str(i): -1e9 for i in sorted(set(tok.all_special_ids))}


def start_pair(ggufs: dict[str, Path], n_ctx: int, threads: int, out: Path,
               quantized: bool = False) -> dict[str, LlamaServer]:
    """A server per model (``dense``, ``harp``); both stay up, only the one AIPerf loads computes.
    ``quantized``: llama.cpp-quantized files, served on the plain CPU buffers (``PLAIN_CPU_BUFFERS``)."""
    servers: dict[str, LlamaServer] = {}
    try:
        for name, path in ggufs.items():
            servers[name] = LlamaServer(path, name, n_ctx, threads, out / f"llamacpp-server-{name}.log",
                                        plain_cpu_buffers=quantized)
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers


def describe(servers: dict[str, LlamaServer]) -> dict[str, Any]:
    """What the JSON records of each server: its command and start-up time."""
    return {n: {"command": s.command, "startup_s": round(s.startup_s, 1)} for n, s in servers.items()}


def extra_inputs(tokenizer: Path) -> dict[str, Any]:
    """Merged into every AIPerf request body: the ban on special tokens."""
    return {"logit_bias": banned_special_tokens(tokenizer)}

