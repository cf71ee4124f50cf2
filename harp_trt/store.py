"""Content-addressed artifact store: ``<root>/<stage>-<sha256[:16]>/{manifest.json, ...}``.

The key hashes the stage name and version, its config, the upstream artifact keys and the model's
digest (``harp_trt.models.weight_digest``: weights, config, tokenizer, chat template, generation
config; never a path). Artifacts are written into a temporary folder under a per-key file
lock and renamed into place, so an interrupted or failed run leaves nothing half-written."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

from .config import digest_of
from .errors import CacheError

__all__ = ["ArtifactStore", "Artifact", "default_cache_root", "MANIFEST", "publishing"]

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


def default_cache_root() -> Path:
    env = os.environ.get("HARP_TRT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "harp-trt"


@contextlib.contextmanager
def publishing(final: Path, tmp_parent: Path, prefix: str) -> Iterator[Path]:
    """Yield a fresh temp folder under ``tmp_parent`` (same file system as ``final``); when the
    ``with`` body ends without an error it is renamed to ``final``, an existing ``final`` being moved
    aside first and removed after. The temp folder is gone afterwards either way, so ``final`` is
    never half-written: the one temp-dir -> checks -> rename of every artifact and ``--out`` folder."""
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=tmp_parent))
        yield tmp
        old = None
        if final.exists():
            old = tmp_parent / f".{final.name}.old-{os.getpid()}"
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old is not None:
                os.replace(old, final)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp is not None:
            _remove_uninterrupted(tmp)


def _remove_uninterrupted(path: Path) -> None:
    """``rmtree`` that a SIGTERM/Ctrl-C arriving mid-removal (the CLI turns both into
    ``KeyboardInterrupt``) cannot cut short: the removal is finished, then the interrupt re-raised."""
    pending: KeyboardInterrupt | None = None
    while True:
        try:
            shutil.rmtree(path, ignore_errors=True)
            break
        except KeyboardInterrupt as e:
            pending = e
    if pending is not None:
        raise pending


@dataclass(frozen=True)
class Artifact:
    key: str
    path: Path
    manifest: dict[str, Any]
    cached: bool = False

    @property
    def stage(self) -> str:
        return self.manifest["stage"]

    @property
    def pruned(self) -> bool:
        """Whether its intermediate files were dropped (``ArtifactStore.prune``)."""
        return bool(self.manifest.get("pruned"))


class ArtifactStore:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_cache_root()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / ".tmp").mkdir(exist_ok=True)
            (self.root / ".locks").mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root / ".tmp", delete=True):
                pass
        except OSError as e:
            raise CacheError(
                f"cache folder {self.root} is not writable ({e.strerror or e})",
                "pass --workdir DIR with a writable folder, or set HARP_TRT_CACHE",
            ) from None

    # -- keys ---------------------------------------------------------------------------------
    @staticmethod
    def make_key(stage: str, material: dict[str, Any]) -> str:
        return f"{stage}-{digest_of({'stage': stage, **material})[:16]}"

    def path_of(self, key: str) -> Path:
        return self.root / key

    # -- reading ------------------------------------------------------------------------------
    def get(self, key: str) -> Artifact | None:
        path = self.path_of(key)
        man = path / MANIFEST
        if not man.is_file():
            return None
        return Artifact(key, path, json.loads(man.read_text()), cached=True)

    def open(self, ref: str | os.PathLike) -> Artifact:
        """Open an artifact by key or by folder path."""
        p = Path(ref)
        if not (p / MANIFEST).is_file():
            p = self.path_of(str(ref))
        if not (p / MANIFEST).is_file():
            raise CacheError(f"no artifact {ref!s} (looked in {p})", "run `harp-trt cache ls`")
        return Artifact(p.name, p, json.loads((p / MANIFEST).read_text()), cached=True)

    def list(self) -> list[Artifact]:
        out = []
        for p in sorted(self.root.iterdir()):
            if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file():
                out.append(Artifact(p.name, p, json.loads((p / MANIFEST).read_text()), cached=True))
        return out

    def remove(self, key: str) -> None:
        """Delete one artifact by key. A key is a plain folder name inside the cache: a path (an
        absolute one would otherwise escape ``root``) or a dot-name (.tmp, .locks) is refused."""
        if not key or key.startswith(".") or "/" in key or os.sep in key:
            raise CacheError(f"{key!r} is not an artifact key (a name like calibrate-0123abcd4567ef89, not a path)",
                             "run `harp-trt cache ls` for the keys")
        path = self.path_of(key)
        if not (path / MANIFEST).is_file():
            raise CacheError(f"no artifact {key!r} in {self.root}", "run `harp-trt cache ls`")
        with FileLock(str(self.root / ".locks" / f"{key}.lock")):
            shutil.rmtree(path)

    def prune(self, art: Artifact, files: tuple[str, ...]) -> Artifact:
        """Drop ``files`` (and their ``.data`` external-data twins) of a consumed intermediate
        artifact; its manifest stays, marked ``pruned``, so its key still resolves for the keys
        downstream, and a stage that needs the files rebuilds it (``Stage.execute``)."""
        names = [n for f in files for n in (f, f + ".data") if (art.path / n).exists()]
        with FileLock(str(self.root / ".locks" / f"{art.key}.lock")):
            manifest = {**art.manifest, "pruned": names}
            tmp = art.path / f".{MANIFEST}.tmp"
            tmp.write_text(json.dumps(manifest, indent=2, default=str))
            os.replace(tmp, art.path / MANIFEST)  # marked first: never files missing unmarked
            for n in names:
                (art.path / n).unlink(missing_ok=True)
        log.info("pruned %s: dropped %s", art.key, ", ".join(names))
        return Artifact(art.key, art.path, manifest, cached=art.cached)

    # -- writing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        with FileLock(str(self.root / ".locks" / f"{key}.lock")):
            yield

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        """Yield a fresh temp folder; on clean exit it becomes ``<root>/<key>`` (replacing one a
        writer without the lock left there). Caller holds the lock."""
        with publishing(self.path_of(key), self.root / ".tmp", f"{key}-") as tmp:
            yield tmp
            if not (tmp / MANIFEST).is_file():
                raise CacheError(f"artifact {key} has no {MANIFEST}; refusing to publish it")

    @staticmethod
    def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
        manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **manifest}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
