"""Sampling parameters, declared once: the keys of Triton's vLLM-backend ``sampling_parameters`` JSON
that the served model reads (``harp_trt/serving.py``) and ``harp-trt generate``'s flags, generated from
the same fields (``harp_trt.config.option``), with one set of defaults and one validation. Light: the
CLI builds its parser from it without numpy or onnxruntime."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Callable

from .config import option
from .errors import ConfigError

__all__ = ["SamplingParams", "SAMPLING_KEYS"]


def _seed(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} must be an integer, got {text!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = option(16, flag="--max-new-tokens", help="tokens to generate (default %(default)s)")
    temperature: float = option(0.0, help="sampling temperature; 0 is greedy (default %(default)s)")
    top_k: int = option(0, help="keep the k most likely tokens (0: all)")
    top_p: float = option(1.0, help="nucleus sampling mass (default %(default)s)")
    seed: int | None = option(None, parse=_seed, help="sampling seed")
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def checked(self, name: Callable[[str], str] = str) -> "SamplingParams":
        """Itself, or ConfigError naming the first value the sampler would reject or misuse (a
        negative top-k keeps nothing); ``name`` turns a field into what the user wrote (a JSON key,
        a flag)."""
        if self.max_tokens < 1:
            raise ConfigError(f"{name('max_tokens')} must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"{name('temperature')} must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{name('top_p')} must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"{name('top_k')} must be >= 0 (0 keeps every token), got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"{name('seed')} must be >= 0, got {self.seed}")
        return self

    @classmethod
    def from_json(cls, text: str | None) -> "SamplingParams":
        """Parse a ``sampling_parameters`` string; ConfigError names the bad or unknown key."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"sampling_parameters is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("sampling_parameters must be a JSON object")
        unknown = sorted(set(raw) - set(SAMPLING_KEYS))
        if unknown:
            raise ConfigError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                              f"valid: {', '.join(SAMPLING_KEYS)}")
        kinds = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float,
                 "seed": lambda v: None if v is None else int(v), "ignore_eos": bool,
                 "stop_token_ids": lambda v: tuple(int(t) for t in v)}
        try:
            p = cls(**{k: kinds[k](v) for k, v in raw.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sampling_parameters: {e}") from None
        return p.checked()


SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
