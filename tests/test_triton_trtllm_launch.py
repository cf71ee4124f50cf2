"""A real tritonserver (2.51, the 24.10 release, from the ``nvidia-pytriton`` wheel in the wheelhouse)
takes the server command the TensorRT-LLM Triton README gives (``builders/triton/readme.py``:
``launch_command``; ``docs/trtllm-contract.md``, row triton-launch). No tensorrtllm backend runs here,
so the command starts the server on an empty repository: what it checks is that every flag and value
the README passes, the ones TensorRT-LLM's ``launch_triton_server.py`` passes, is one tritonserver
accepts, with the effect it names."""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

import _tritonserver
from conftest import TEST_CACHE
from harp_trt.triton_runtime import http_ok, wait_ready
from test_triton_trtllm import _docker_runs, _parse_docker_run, tp2  # noqa: F401 (tp2: the fixture)


def test_a_real_tritonserver_takes_the_readme_server_flags(tp2, tmp_path):
    """Every flag and value of the README's server command (tp=2, mpirun aside) is accepted by a real
    tritonserver (2.51 from the pytriton wheel, CPU): it becomes ready and its options table shows the
    pools at 0 and auto-complete off (strict model config)."""
    if (why := _tritonserver.available()) is not None:
        pytest.fail(f"tritonserver cannot run here: {why}", pytrace=False)
    _, _, readme = tp2
    _, _, command = _parse_docker_run(_docker_runs(readme)[1])
    assert command[:5] == ["mpirun", "--allow-run-as-root", "-n", "1", "tritonserver"]
    home = _tritonserver.fetch_server(TEST_CACHE)
    ts = home / "pytriton" / "tritonserver"
    (tmp_path / "models").mkdir()
    http, grpc, metrics = _tritonserver.free_ports(3)
    argv = [str(ts / "bin" / "tritonserver"), *[a.replace("=/models", f"={tmp_path / 'models'}") for a in command[5:]],
            f"--backend-directory={ts / 'backends'}", "--http-address=127.0.0.1", f"--http-port={http}",
            "--grpc-address=127.0.0.1", f"--grpc-port={grpc}", f"--metrics-port={metrics}", "--allow-metrics=false",
            "--exit-timeout-secs=5"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(home / "nvidia_pytriton.libs")}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = wait_ready(proc, lambda: http_ok(f"http://127.0.0.1:{http}/v2/health/ready"), 60, poll=0.2) is not None
        text = log.read_text(errors="replace")
        assert ready, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    table = {ln.split("|")[1].strip(): ln.split("|")[2].strip() for ln in text.splitlines() if ln.count("|") >= 3}
    assert table["pinned_memory_pool_byte_size"] == "0" and table["strict_model_config"] == "1"
    assert table["cuda_memory_pool_byte_size{0}"] == table["cuda_memory_pool_byte_size{1}"] == "0"
