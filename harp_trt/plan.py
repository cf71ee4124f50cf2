"""``plan.json``: the calibrate stage's decision, the contract every later stage reads.

Only ``model``, ``family``, ``num_layers``, ``layers`` and ``alphas`` are needed downstream;
the rest (scores, perplexities, timings, versions) is the record of how they were chosen."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["Plan", "PLAN_FORMAT", "open_plan"]

PLAN_FORMAT = "harp-plan/1"


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

    @property
    def alpha_map(self) -> dict[int, float]:
        return dict(zip(self.layers, self.alphas))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": PLAN_FORMAT, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("format") != PLAN_FORMAT:
            raise ConfigError(f"not a harp plan (format {d.get('format')!r}, expected {PLAN_FORMAT!r})")
        known = {k: v for k, v in d.items() if k != "format"}
        try:
            return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in known.items()})
        except TypeError as e:
            raise ConfigError(f"malformed plan: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if p.is_dir():
            p = p / "plan.json"
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"no plan at {p}", "pass a calibrate artifact folder or its plan.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan {p} is not valid JSON: {e}") from None


def open_plan(ref: str | Path, store) -> Plan:
    """A plan from a plan.json path, a calibrate artifact folder, or an artifact key in ``store``."""
    p = Path(ref)
    if p.exists():
        return Plan.load(p)
    return Plan.load(store.open(str(ref)).path)
