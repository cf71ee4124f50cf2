"""The suite's ``tritonserver``: ``harp_trt.triton_runtime`` with its wheels from the wheelhouse
(a missing one fails the test with one line naming it). Not a test module."""
from __future__ import annotations

from pathlib import Path

import wheelhouse
from harp_trt.triton_runtime import PYTRITON, STUB_NUMPY, Server, available, free_ports  # noqa: F401
from harp_trt.triton_runtime import fetch_server as _fetch
from harp_trt.triton_runtime import start as _start


def start(repo: Path, root: Path, timeout: float = 120.0) -> Server:
    wheelhouse.require(STUB_NUMPY)
    return _start(repo, root, timeout, wheel=wheelhouse.require(PYTRITON))


def fetch_server(root: Path) -> Path:
    return _fetch(root, wheel=wheelhouse.require(PYTRITON))
