"""Sampling parameters declared once (harp_trt/sampling.py): a served request's
``sampling_parameters`` JSON and ``harp-trt generate``'s flags are the same fields, with one set of
defaults and one validation whose message names what the user wrote (the key, or the flag)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from harp_trt.errors import ConfigError
from harp_trt.sampling import SAMPLING_KEYS, SamplingParams


def _generate_params(*flags: str) -> SamplingParams:
    from harp_trt.cli import build_parser
    from harp_trt.cli.generate import check_arguments

    return check_arguments(build_parser().parse_args(["generate", "--artifact", "E", "--prompt", "hi", *flags]))


def test_json_keys_are_the_fields_and_defaults_are_greedy():
    assert SAMPLING_KEYS == tuple(f.name for f in dataclasses.fields(SamplingParams))
    p = SamplingParams.from_json(json.dumps({"max_tokens": 5, "temperature": 0.7, "seed": 3, "stop_token_ids": [2]}))
    assert (p.max_tokens, p.temperature, p.seed, p.stop_token_ids, p.sampling) == (5, 0.7, 3, (2,), True)
    assert SamplingParams.from_json(None) == SamplingParams() and not SamplingParams().sampling


@pytest.mark.parametrize("raw, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"), ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p must lie in (0, 1]"), ({"top_k": -2}, "top_k must be >= 0"),
    ({"seed": -1}, "seed must be >= 0"),   # numpy's default_rng would raise it inside the serving loop
    ({"max_tokenz": 3}, "unknown sampling parameter"), ({"max_tokens": "many"}, "sampling_parameters:")])
def test_json_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams.from_json(json.dumps(raw))


def test_generate_flags_are_the_fields():
    """The flags carry their field (``config_field``), generate keeps its defaults (64 tokens,
    greedy; --sample at temperature 1.0), and a flag's value lands in the same field a JSON key does."""
    from harp_trt.cli import build_parser

    p = next(a for a in build_parser()._actions if a.choices and "generate" in a.choices).choices["generate"]
    fields = {a.option_strings[0]: a.config_field for a in p._actions if getattr(a, "config_field", None)}
    assert fields == {"--max-new-tokens": "SamplingParams.max_tokens", "--temperature": "SamplingParams.temperature",
                      "--top-k": "SamplingParams.top_k", "--top-p": "SamplingParams.top_p", "--seed": "SamplingParams.seed",
                      "--sample": "Session.sample", "--chat": "Session.chat", "--threads": "Session.threads",
                      "--no-stream": "Session.stream"}
    assert _generate_params() == SamplingParams(max_tokens=64)
    assert _generate_params("--temperature", "0.7") == SamplingParams(max_tokens=64)   # greedy without --sample
    assert _generate_params("--sample") == SamplingParams(max_tokens=64, temperature=1.0)
    got = _generate_params("--sample", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3",
                           "--max-new-tokens", "8")
    assert got == SamplingParams.from_json(json.dumps({"max_tokens": 8, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                                       "seed": 3}))
    with pytest.raises(ConfigError, match="--temperature must be > 0 with --sample"):
        _generate_params("--sample", "--temperature", "0")
    with pytest.raises(ConfigError, match="--seed must be an integer"):
        _generate_params("--seed", "x")
