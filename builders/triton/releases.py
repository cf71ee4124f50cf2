"""Triton container releases as data: what each ``nvcr.io/nvidia/tritonserver`` release carries
(``docs/trtllm-contract.md``, rows ort-release and triton-trtllm-release). Light on purpose (no
onnx, no torch): ``TritonRepoConfig`` takes its default from here, the one place it is defined.

* ``TRITON_ORT``: release -> the ONNX Runtime its onnxruntime backend links
  (triton-inference-server/server ``build.py`` ``TRITON_VERSION_MAP`` / ``DEFAULT_TRITON_VERSION_MAP``
  ``ort_version`` on each ``rYY.MM`` branch).
* ``TRITON_TRTLLM``: release -> the TensorRT-LLM inside its ``-trtllm-python-py3`` image, one row per
  release with the line that pins it: ``ARG TENSORRTLLM_VER=`` in
  ``dockerfile/Dockerfile.triton.trt_llm_backend`` of triton-inference-server/tensorrtllm_backend,
  branch ``rYY.MM`` (read at the commit given in the row). An engine is built and served by one
  TensorRT-LLM version, and 1.0 ignores ``TRTLLM_WINDOW_SIZE_SHARES``, so a release whose
  TensorRT-LLM is not the one our checkpoints target is refused (exit 2).

``DEFAULT_TRITON_RELEASE`` is computed, not listed: the first release that carries the targeted
TensorRT-LLM (``harp_trt.versions.TRTLLM_VERSION``) and whose ONNX Runtime is known."""
from __future__ import annotations

from dataclasses import dataclass

from harp_trt.errors import ConfigError
from harp_trt.versions import TRTLLM_VERSION

__all__ = ["TRITON_ORT", "TRITON_TRTLLM", "TrtllmRelease", "DEFAULT_TRITON_RELEASE", "KNOWN_RELEASES",
           "ngc_image", "check_trtllm_release", "TRTLLM_VERSION"]

TRITON_ORT: dict[str, str] = {
    "24.10": "1.19.2", "24.11": "1.19.2", "24.12": "1.20.1", "25.01": "1.20.1", "25.02": "1.20.1",
    "25.03": "1.21.0", "25.04": "1.21.0", "25.05": "1.22.0", "25.06": "1.22.0", "25.07": "1.22.0",
    "25.08": "1.23.0", "25.09": "1.23.0", "25.10": "1.23.1", "25.11": "1.23.2", "25.12": "1.23.2",
    "26.01": "1.23.2", "26.02": "1.24.1", "26.03": "1.24.2", "26.04": "1.24.4", "26.05": "1.24.4",
    "26.06": "1.24.4", "26.07": "1.27.0",
}


@dataclass(frozen=True)
class TrtllmRelease:
    release: str        # tritonserver container release, YY.MM
    tensorrt_llm: str   # TENSORRTLLM_VER pinned by the backend's release branch
    source: str         # where: repository, branch, commit, file and line

    @property
    def image(self) -> str:
        return ngc_image(self.release, "trtllm")


_DOCKERFILE = "triton-inference-server/tensorrtllm_backend@{branch} ({commit}): " \
              "dockerfile/Dockerfile.triton.trt_llm_backend line {line}: ARG TENSORRTLLM_VER={ver}"


def _row(release: str, ver: str, commit: str, line: int) -> TrtllmRelease:
    return TrtllmRelease(release, ver, _DOCKERFILE.format(branch=f"r{release}", commit=commit, line=line, ver=ver))


TRITON_TRTLLM: dict[str, TrtllmRelease] = {r.release: r for r in (
    _row("25.09", "1.0.0", "2ee1ae5e7b", 22), _row("25.10", "1.0.0", "e2e72dc83f", 22),
    _row("25.11", "1.2.0rc2", "9f60afe80a", 21), _row("25.12", "1.1.0", "5419275f0e", 21),
    _row("26.01", "1.1.0", "5b0830fc38", 21), _row("26.02", "1.1.0", "47c80a3595", 21),
    _row("26.03", "1.2.0rc8", "9736c4df0f", 19), _row("26.04", "1.2.1", "ce68ff5fd0", 19),
    _row("26.05", "1.2.1", "a4f2f549f2", 19), _row("26.06", "1.2.1", "e1611ce861", 19),
    _row("26.07", "1.2.1", "3bc115373c", 19),
)}

KNOWN_RELEASES = tuple(sorted(set(TRITON_ORT) | set(TRITON_TRTLLM)))


def _default() -> str:
    carrying = [r for r, row in TRITON_TRTLLM.items() if row.tensorrt_llm == TRTLLM_VERSION and r in TRITON_ORT]
    return min(carrying)


DEFAULT_TRITON_RELEASE: str = _default()


def ngc_image(release: str, kind: str) -> str:
    """The NGC image of ``release``: ``onnx`` -> ``-py3`` (onnxruntime backend), ``trtllm`` ->
    ``-trtllm-python-py3`` (tensorrtllm and Python backends, TensorRT-LLM installed)."""
    return f"nvcr.io/nvidia/tritonserver:{release}-{'trtllm-python-py3' if kind == 'trtllm' else 'py3'}"


def check_trtllm_release(release: str, target: str) -> TrtllmRelease:
    """The table row of ``release``; a release whose TensorRT-LLM is not ``target`` (the version
    the checkpoint was written for) raises ``ConfigError`` naming both versions."""
    good = ", ".join(r for r, row in TRITON_TRTLLM.items() if row.tensorrt_llm == target) or "none known"
    row = TRITON_TRTLLM.get(release)
    if row is None:
        raise ConfigError(f"Triton release {release!r} has no known TensorRT-LLM version; known: "
                          f"{', '.join(TRITON_TRTLLM)}",
                          f"pass --triton-release with a release that carries TensorRT-LLM {target}: {good}")
    if row.tensorrt_llm != target:
        raise ConfigError(f"Triton {release} carries TensorRT-LLM {row.tensorrt_llm}, but this checkpoint targets "
                          f"TensorRT-LLM {target} (an engine runs only under the version that built it)",
                          f"pass --triton-release with one of: {good}")
    return row
