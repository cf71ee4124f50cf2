"""``plan.json``: the calibrate stage's decision, the contract every later stage reads.

Only ``model``, ``family``, ``num_layers``, ``layers`` and ``alphas`` are needed downstream;
the rest (scores, perplexities, timings, versions) is the record of how they were chosen."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["Plan", "PLAN_FORMAT", "FITTED_FILE", "open_plan"]

PLAN_FORMAT = "harp-plan/1"
FITTED_FILE = "replacement.safetensors"  # fitted maps (calib/fit.py), beside plan.json in the calibrate artifact
# an lmmse map's tensors in a layer, after the layer prefix: FITTED_LINEAR + ".weight" / ".bias" (the
# ``HarpAttention.harp_linear`` module; calib.fit.hf_tensors writes them, the rewrite's fitted_weights reads them)
FITTED_LINEAR = "self_attn.harp_linear"


@dataclass(frozen=True)
class Plan:
    model_ref: str
    model_digest: str
    family: str
    num_layers: int
    strategy: str
    layers: tuple[int, ...]          # pruned layer indices, ascending
    alphas: tuple[float, ...]        # alpha per entry of ``layers``
    scores: tuple[float, ...] = ()   # one per layer, in layer order
    grid: tuple[float, ...] = ()
    ppl: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.layers) != len(self.alphas):
            raise ConfigError(f"plan has {len(self.layers)} layers but {len(self.alphas)} alphas")
        bad = [l for l in self.layers if not 0 <= l < self.num_layers]
        if bad:
            raise ConfigError(f"plan layers {bad} out of range 0..{self.num_layers - 1}")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"plan repeats layers: {list(self.layers)}")
        if any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ConfigError(f"plan alphas must lie in [0, 1], got {list(self.alphas)}")

    def check_model(self, family: str, num_layers: int, stage: str) -> None:
        """PreconditionError (naming ``stage``) unless the model has the plan's family and depth (its
        weights digest is checked by ``harp_trt.onnx_io.check_plan_weights``)."""
        from .errors import PreconditionError

        if self.family != family:
            raise PreconditionError(stage, f"plan is for family {self.family!r} but the model is {family!r}",
                                    "pass the model the plan was calibrated on")
        if self.num_layers != num_layers:
            raise PreconditionError(stage, f"plan has {self.num_layers} layers but the model has {num_layers}",
                                    "pass the model the plan was calibrated on")

    @property
    def alpha_map(self) -> dict[int, float]:
        return dict(zip(self.layers, self.alphas))

    # ---- fitted maps (calibrate --replacement rrr | lmmse, calib/fit.py) ----------------------
    @property
    def replacement(self) -> str:
        """``harp`` (alpha * V.O, the paper) or the fitted method the plan's layers may use."""
        return str((self.extra.get("replacement") or {}).get("method", "harp"))

    @property
    def fitted_layers(self) -> tuple[int, ...]:
        """Pruned layers whose block is a fitted map (their alpha is 1), not HARP's scaled V.O."""
        return tuple(int(l) for l in (self.extra.get("replacement") or {}).get("layers", ()))

    def fitted_tensors(self) -> dict[str, Any]:
        """The fitted layers' checkpoint tensors (names as in the model's safetensors; ``rrr``:
        v_proj / o_proj, ``lmmse``: ``self_attn.harp_linear.*``), read from ``FITTED_FILE`` beside
        the plan.json this plan was loaded from; {} when no layer is fitted."""
        if not self.fitted_layers:
            return {}
        folder = getattr(self, "_folder", None)
        path = Path(folder or ".") / FITTED_FILE
        if folder is None or not path.is_file():
            raise ConfigError(f"plan fits layers {list(self.fitted_layers)} but {path} is missing",
                              "pass the calibrate artifact folder the plan came from, with its " + FITTED_FILE)
        from safetensors.torch import load_file

        return load_file(str(path))

    def refuse_fitted(self, stage: str, refused: tuple[tuple[str, str], ...]) -> None:
        """PreconditionError when the plan's fitted maps are of a method ``stage``'s format cannot
        hold (``refused``: ``((method, why), ...)``, its ``StageCli.refuses_fitted``); so no target
        silently writes HARP's V.O where a fitted map was chosen."""
        from .errors import PreconditionError

        why = dict(refused).get(self.replacement)
        if self.fitted_layers and why is not None:
            raise PreconditionError(stage, f"the plan replaces layers {list(self.fitted_layers)} by a fitted "
                                    f"{self.replacement} map, which {stage} does not carry: {why}",
                                    "calibrate with --replacement rrr (carried by every target) or harp")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": PLAN_FORMAT, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}}

    def save(self, path: Path) -> None:
        """Write plan.json at ``path``; a plan with fitted maps takes its ``FITTED_FILE`` along."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))
        src = getattr(self, "_folder", None)
        if self.fitted_layers and src is not None and Path(src).resolve() != Path(path).parent.resolve():
            import shutil

            shutil.copyfile(Path(src) / FITTED_FILE, Path(path).parent / FITTED_FILE)

    @property
    def search_split(self) -> str:
        """Which documents chose the alphas (``harp_trt.calib.config.SEARCH_SPLITS``): ``halves`` (even
        documents searched, odd ones held out) or ``all`` (every document of the corpus searched,
        held-out perplexity on another named text, as HARP did). Plans written before the split was
        recorded always used ``halves``."""
        return str((self.extra.get("search_split") or {}).get("name", "halves"))

    def reads_search_text(self, corpus_digest: str, split: str) -> bool:
        """Whether documents of ``split`` (calib | heldout | all) of the corpus with this digest
        chose the alphas: the even half (``halves``) or every document (``all``) of the searched
        corpus. Stages that report held-out perplexity refuse such text."""
        record = (self.extra.get("search_split") or {}).get("search") or {}
        if corpus_digest != record.get("corpus_digest", self.extra.get("corpus_digest")):
            return False
        return split != "heldout" or self.search_split == "all"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """A plan from its JSON object; ConfigError naming the first wrong field (its type, a
        missing or unknown key), so a hand-edited or foreign file fails in one line, not deep in a
        stage."""
        if not isinstance(d, dict):
            raise ConfigError(f"not a harp plan: a JSON {type(d).__name__}, expected an object "
                              f"with format {PLAN_FORMAT!r}")
        if d.get("format") != PLAN_FORMAT:
            raise ConfigError(f"not a harp plan (format {d.get('format')!r}, expected {PLAN_FORMAT!r})")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        known = {k: v for k, v in d.items() if k != "format"}
        unknown = sorted(set(known) - set(fields))
        missing = [n for n, f in fields.items() if n not in known and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]  # type: ignore[misc]
        if unknown or missing:
            what = [f"unknown key(s) {', '.join(unknown)}"] * bool(unknown) + \
                   [f"missing key(s) {', '.join(missing)}"] * bool(missing)
            raise ConfigError(f"malformed plan: {'; '.join(what)}", f"a plan has the keys format, {', '.join(fields)}")
        for name, value in known.items():
            _check_type(name, value)
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in known.items()})

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if p.is_dir():
            p = p / "plan.json"
        try:
            plan = cls.from_dict(json.loads(p.read_text(encoding="utf-8")))
            object.__setattr__(plan, "_folder", p.parent)  # where its fitted maps are (fitted_tensors)
            return plan
        except FileNotFoundError:
            raise ConfigError(f"no plan at {p}", "pass a calibrate artifact folder, its key (harp-trt cache ls) "
                              "or its plan.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"plan {p} is not valid JSON: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"plan {p}: {e.message}", e.hint) from None


# JSON type each plan key must have: (test, what to say)
_NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
_TYPES: dict[str, tuple[Any, str]] = {
    "model_ref": (lambda v: isinstance(v, str), "a string"),
    "model_digest": (lambda v: isinstance(v, str), "a string"),
    "family": (lambda v: isinstance(v, str), "a string"),
    "strategy": (lambda v: isinstance(v, str), "a string"),
    "num_layers": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "layers": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
               "a list of layer indices"),
    "alphas": (lambda v: isinstance(v, (list, tuple)) and all(_NUMBER[0](x) for x in v), "a list of numbers"),
    "scores": (lambda v: isinstance(v, (list, tuple)) and all(_NUMBER[0](x) for x in v), "a list of numbers"),
    "grid": (lambda v: isinstance(v, (list, tuple)) and all(_NUMBER[0](x) for x in v), "a list of numbers"),
    "ppl": (lambda v: isinstance(v, dict), "an object"),
    "extra": (lambda v: isinstance(v, dict), "an object"),
}


def _check_type(name: str, value: Any) -> None:
    test, what = _TYPES[name]
    if not test(value):
        raise ConfigError(f"malformed plan: {name!r} must be {what}, got {value!r:.60}")


def open_plan(ref: str | Path, store) -> Plan:
    """A plan from a plan.json path, a calibrate artifact folder, or an artifact key in ``store``.
    A reference that looks like a path (a separator, or ``.json``) is read as one, so a mistyped
    file name says "no plan at", not "no artifact"."""
    p = Path(ref)
    text = str(ref)
    if p.exists() or os.sep in text or "/" in text or text.endswith(".json"):
        return Plan.load(p)
    return Plan.load(store.open(text).path)
