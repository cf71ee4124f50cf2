"""Start the real ``tritonserver`` (2.51, the 24.10 release) from the ``nvidia-pytriton`` wheel on
PyPI, on the CPU: the test suite's server (``tests/_tritonserver.py``) and the serving benchmark's
(``bench/serve_load.py``).

What it takes (measured here; see docs/deploy.md, "Triton Inference Server"):
* the wheel, downloaded (never installed) and unzipped; the Python-backend stub for this Python
  copied into ``backends/python`` and exec bits restored (zip drops them);
* ``LD_LIBRARY_PATH`` with the wheel's libraries and this interpreter's ``libpython`` folder;
* a *stub venv* first on ``PATH``: the stub's embedded interpreter ignores ``PYTHONPATH`` and finds
  its ``site-packages`` from the ``python3`` on ``PATH``; it must hold numpy < 2 (the 24.10 stub
  corrupts string tensors under numpy 2), and reaches this project's packages through a ``.pth``;
* free loopback ports, a unique shared-memory prefix per server.
``available()`` says why a server cannot run here. pip fetches the wheels with this process's
settings (in the suite: from its wheelhouse only)."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

PYTRITON = "nvidia-pytriton==0.7.0"
STUB_NUMPY = "numpy==1.26.4"


def available() -> str | None:
    """None when a server can run here, else the reason it cannot."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "the pytriton wheel's tritonserver is for x86-64 Linux"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return "the Python backend stub needs a shared libpython (this Python is a static build)"
    if f"{sys.version_info[0]}.{sys.version_info[1]}" not in ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13"):
        return "the wheel has no Python-backend stub for this Python"
    return None


def _pip_fetch(requirement: str, dest: Path) -> Path:
    """``requirement``'s wheel (no dependencies), downloaded by pip into ``dest``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                    "-d", str(dest), requirement], check=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    return next(f for f in dest.glob("*.whl") if f.name.lower().startswith(name))


def fetch_server(root: Path, wheel: Path | None = None) -> Path:
    """The unzipped wheel, in a folder under ``root`` named by the pinned requirement and this
    Python (``root`` is the tests' persistent cache): downloaded once, unzipped into a temporary
    folder and renamed into place, so an interrupted download never looks complete and another pin
    gets a folder of its own (a warm cache holds exactly what a cold run would fetch)."""
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    home = root / f"{PYTRITON.replace('==', '-')}-py{ver}"
    if (home / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        return home
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=root))
    try:
        whl = wheel or _pip_fetch(PYTRITON, tmp)
        tree = tmp / "tree"
        with zipfile.ZipFile(whl) as z:
            z.extractall(tree)
        ts = tree / "pytriton" / "tritonserver"
        stub = ts / "backends" / "python" / "triton_python_backend_stub"
        stub.write_bytes((ts / "python_backend_stubs" / ver / "triton_python_backend_stub").read_bytes())
        for f in (ts / "bin" / "tritonserver", stub):
            f.chmod(0o755)
        try:
            os.rename(tree, home)
        except OSError:  # another session renamed its copy first: the same pinned files
            if not home.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return home


def stub_venv(dest: Path) -> Path:
    """A venv from this interpreter's base with only numpy<2, plus this environment's site-packages."""
    import site

    py = dest / "bin" / "python3"
    sp = dest / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    if not py.exists():
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(dest)], check=True)
    if not (sp / "numpy").is_dir():  # installed beside, then renamed: never half a numpy
        part = Path(tempfile.mkdtemp(prefix=".site-packages-", dir=dest))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--target", str(part), STUB_NUMPY], check=True)
        shutil.rmtree(sp, ignore_errors=True)
        os.rename(part, sp)
    (sp / "zz_project_site.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n"
                                                   for d in site.getsitepackages()))
    return dest


def free_ports(n: int) -> list[int]:
    """n free local TCP ports (bound once to port 0, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether a GET of ``url`` answers 200 (a server's readiness endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def wait_ready(proc: subprocess.Popen, ready, timeout: float, poll: float = 0.1) -> float | None:
    """Seconds until ``ready()`` held for the server process ``proc``; None when it exited first or
    ``timeout`` seconds passed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if ready():
            return time.monotonic() - t0
        time.sleep(poll)
    return None


@dataclass
class Server:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path
    shm_prefix: str
    startup_s: float = 0.0

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def ready(self) -> bool:
        return http_ok(self.http + "/v2/health/ready")

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""

    def kill(self) -> int:
        """SIGKILL the server and its stubs mid-work (what an OOM killer or a node loss does)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait()

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its stubs (own session)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for f in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            Path(f).unlink(missing_ok=True)
        return self.proc.returncode


def start(repo: Path | list[Path], root: Path, timeout: float = 120.0, wheel: Path | None = None) -> Server:
    """Start tritonserver on ``repo`` (one repository or several) and wait until it is ready (raises
    with the log tail). ``root``: where the unzipped wheel, its stub venv and the server logs live."""
    root = fetch_server(root, wheel)
    venv = stub_venv(root / "stubvenv")
    ts = root / "pytriton" / "tritonserver"
    http, grpc, metrics = free_ports(3)
    prefix = f"harp{os.getpid()}_{uuid.uuid4().hex[:6]}_"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(root / "nvidia_pytriton.libs"),
                                                         sysconfig.get_config_var("LIBDIR"),
                                                         env.get("LD_LIBRARY_PATH")) if p)
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    repos = [repo] if isinstance(repo, (str, Path)) else list(repo)
    cmd = [str(ts / "bin" / "tritonserver"), *(f"--model-repository={r}" for r in repos),
           f"--backend-directory={ts / 'backends'}", f"--cache-directory={ts / 'caches'}",
           "--http-address=127.0.0.1", f"--http-port={http}", "--grpc-address=127.0.0.1", f"--grpc-port={grpc}",
           f"--metrics-port={metrics}", "--allow-metrics=false", "--pinned-memory-pool-byte-size=0",
           "--exit-timeout-secs=10", f"--backend-config=python,shm-region-prefix-name={prefix}",
           "--backend-config=python,shm-default-byte-size=1048576"]
    log = root / f"server-{prefix}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(proc, http, grpc, log, prefix)
    t0 = time.monotonic()
    startup = wait_ready(proc, srv.ready, timeout)
    if startup is not None:
        srv.startup_s = startup
        return srv
    srv.stop(5)
    raise RuntimeError(f"tritonserver not ready after {time.monotonic() - t0:.0f} s (exit {proc.returncode}):\n"
                       f"{srv.log_tail()}")
