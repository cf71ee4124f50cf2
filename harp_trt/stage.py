"""The stage contract: one ``run(config, inputs, out_dir)`` per stage, with checked pre- and
postconditions whose errors name the stage (after onnx-ir's ``PassBase``).

``Stage.execute`` adds caching: it derives the artifact key from the stage version, the code
version (the code, comments and docstrings aside, of every repository module the stage can run, and
the installed distributions that code imports, ``harp_trt.codekey``), the config, the upstream
artifact keys and any content digests the stage declares (the model's: ``harp_trt.models.weight_digest``),
returns the cached artifact when the key exists, and otherwise runs the stage into a temp folder
that is renamed on success. ``Stage.write_to`` runs it the same way into
a folder of the caller's choice, outside the cache (``--out``)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

from .codekey import CodeKey, code_key
from .config import StageConfig
from .errors import PostconditionError, PreconditionError
from .extras import available, check
from .store import MANIFEST, Artifact, ArtifactStore, publishing

__all__ = ["Stage", "Hooks", "CompactIntermediates"]

log = logging.getLogger(__name__)
C = TypeVar("C", bound=StageConfig)


@dataclass(frozen=True)
class Hooks:
    """Progress reporting and placement for a pipeline run; never part of a cache key."""

    progress: Any = None
    on_phase: Callable[[str], None] | None = None
    placement: Any = None
    # a stage calls it with an input artifact it has finished reading; the pipeline drops that
    # artifact's intermediate files there and then where no later step reads them
    release: Callable[[Any], None] | None = None


class Stage(Generic[C]):
    name: ClassVar[str]
    version: ClassVar[int] = 1
    outputs: ClassVar[tuple[str, ...]] = ()  # files every artifact of this stage must hold
    # PNGs written only where matplotlib is installed (the ``plots`` extra); an artifact made
    # without them is keyed apart, so installing the extra later writes them
    figures: ClassVar[tuple[str, ...]] = ()
    # where the scan of the stage's code starts besides its own module (``harp_trt.codekey``):
    # for an import no scan can see; the closure itself is computed, never listed
    code: ClassVar[tuple[str, ...]] = ()
    # files a later stage consumes and a rerun does not need (the ONNX weights of export and
    # rewrite): ``run_build(keep_intermediates=False)`` drops them once every reader has run
    intermediate: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def prunable(cls, artifact: Artifact) -> bool:
        """Whether this artifact's ``intermediate`` files may be dropped once consumed."""
        return bool(cls.intermediate)

    @classmethod
    def code_key(cls) -> CodeKey:
        """The repository modules this stage's module can run (transitively: imports in the code
        that runs, function bodies a caller names, lazy registry entries) and the installed
        distributions that code imports (``harp_trt.codekey``); computed once per process."""
        return code_key((cls.__module__, *cls.code))

    @classmethod
    def code_version(cls) -> str:
        """sha256[:16] of ``code_key()``'s code and library versions: part of every key, so an
        artifact written by other code, or by other library versions, is never served from the
        cache (``harp_trt.__version__`` alone would be), while a comment edit serves it still."""
        return cls.code_key().digest

    def key_material(self, config: C, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Everything the artifact depends on. Subclasses add content digests (weights, corpus)."""
        upstream = {k: v.key for k, v in inputs.items() if isinstance(v, Artifact)}
        return {"stage_version": self.version, "code": self.code_version(), "config": config.key_material(),
                "upstream": upstream}

    def requirements(self, config: C) -> tuple[tuple[str, str], ...]:
        """(module, "what needs it") pairs from optional extras that this run imports
        (``harp_trt.extras``): checked before the stage's work, not on a cache hit."""
        return ()

    @staticmethod
    def figures_enabled() -> bool:
        """Whether this process writes the stage's ``figures`` (matplotlib installed)."""
        return available("matplotlib")

    def prepare(self, store: ArtifactStore, config: C, inputs: Mapping[str, Any], hooks: "Hooks") -> dict[str, Any]:
        """Turn the pipeline's references (``model``, ``plan``, upstream artifacts) into this
        stage's inputs. Default: as given; stages whose inputs load data lazily override it."""
        return dict(inputs)

    def check_preconditions(self, config: C, inputs: Mapping[str, Any]) -> None:
        """Raise PreconditionError (naming this stage) if inputs are unusable."""

    def run(self, config: C, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        """Write the artifact's files into ``out_dir`` and return the manifest body."""
        raise NotImplementedError

    def check_postconditions(self, config: C, inputs: Mapping[str, Any], out_dir) -> None:
        expected = self.outputs + (self.figures if self.figures_enabled() else ())
        missing = [f for f in expected if not (out_dir / f).exists()]
        if missing:
            raise PostconditionError(self.name, f"artifact is missing {', '.join(missing)}")

    def produce(self, config: C, inputs: Mapping[str, Any], out_dir: Path) -> dict[str, Any]:
        """``run`` into ``out_dir`` (a temp folder), then the postconditions on what it wrote."""
        body = self.run(config, inputs, out_dir)
        self.check_postconditions(config, inputs, out_dir)
        return body

    def write_to(self, config: C, inputs: Mapping[str, Any], out, *, source: Path | None = None,
                 source_kind: str = "artifact", force: bool = False) -> dict[str, Any]:
        """Run the stage outside the cache into ``out``: a new or empty folder (``force``: replaced)
        outside ``source``, the input's folder. Bad ``out`` or inputs raise PreconditionError before
        anything is written; ``out`` is replaced only once the postconditions pass. Returns the body."""
        out = Path(out).absolute()
        if out.exists() and not out.is_dir():
            raise PreconditionError(self.name, f"--out {out} exists and is not a folder", "pick another --out")
        if out.is_dir() and any(out.iterdir()) and not force:
            raise PreconditionError(self.name, f"--out {out} exists and is not empty",
                                    "pass --force to replace it, or pick another --out")
        if source is not None and (out == source or source in out.parents):
            raise PreconditionError(self.name, f"--out {out} lies inside the {source_kind} {source}",
                                    "pick another --out")
        self.check_preconditions(config, inputs)
        out.parent.mkdir(parents=True, exist_ok=True)
        with publishing(out, out.parent, f".{out.name}.tmp-") as tmp:
            return self.produce(config, inputs, tmp)

    def key(self, store: ArtifactStore, config: C, inputs: Mapping[str, Any]) -> str:
        """The artifact key ``execute`` would use."""
        material = self.key_material(config, inputs)
        if self.figures and not self.figures_enabled():
            material = {**material, "figures": False}
        return store.make_key(self.name, material)

    def execute(self, store: ArtifactStore, config: C, inputs: Mapping[str, Any],
                force: bool = False, allow_pruned: bool = False) -> Artifact:
        """The cached artifact, or a new one. A pruned artifact (its intermediate files dropped)
        counts as a hit only with ``allow_pruned`` (the pipeline, which rebuilds it when a step
        that runs needs its files); otherwise it is rebuilt under the same key."""
        key = self.key(store, config, inputs)

        def usable(hit: Artifact | None) -> bool:
            return hit is not None and (allow_pruned or not hit.pruned)

        if not force and usable(hit := store.get(key)):
            log.info("%s: cache hit %s", self.name, key)
            return hit
        with store.lock(key):
            if not force and usable(hit := store.get(key)):
                return hit
            check(self.requirements(config))
            self.check_preconditions(config, inputs)
            t0 = time.perf_counter()
            with store.writing(key) as tmp:
                body = self.produce(config, inputs, tmp)
                store.write_manifest(tmp, {
                    "stage": self.name, "stage_version": self.version, "key": key,
                    "config": config.to_dict(),
                    "upstream": {k: v.key for k, v in inputs.items() if isinstance(v, Artifact)},
                    "seconds": round(time.perf_counter() - t0, 3),
                    **body,
                })
        art = store.get(key)
        assert art is not None and (art.path / MANIFEST).exists()
        return Artifact(art.key, art.path, art.manifest, cached=False)


class CompactIntermediates:
    """``prunable`` for the stages whose ``intermediate`` files are ONNX weights (export, rewrite),
    listed before ``Stage`` in their bases: only an artifact of the large-model (compact) path,
    ``"storage": "compact"`` in its manifest, drops its weights once consumed; a small fp32 run keeps
    them, as before, for the reruns and benches that read them."""

    @classmethod
    def prunable(cls, artifact: Artifact) -> bool:
        return artifact.manifest.get("storage") == "compact"
