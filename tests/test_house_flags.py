"""The house rule for flags (ARCHITECTURE.md, "The house"): every CLI flag is generated from a config
field (``harp_trt.config.option``) or is listed here as not one, and maps back to its field."""
from __future__ import annotations

import argparse

import pytest


# Flags that set no config field, per command, and why. Everything else a command offers must be
# generated from a field's option() (its action carries ``config_field``): the stage configs, where
# PyTorch runs (harp_trt.device.PlacementRequest), what build runs (cli/build.Run), the bench's gates
# (bench/stage/config.Gates), the sampling (SamplingParams) and generate's session (cli/generate.Session).
_INPUTS = {"--model", "--plan", "--artifact", "--onnx", "--dense-engine", "--harp-engine", "--prompt"}  # what runs
_ALPHAS = {"--alpha-order", "--paper-alphas", "--naive"}   # how the alphas are given or searched: turned into
# the plan's alphas before the config exists (--naive: the reference search, which gives the same plan)
NOT_CONFIG = {
    "build": {"--model", "--force"} | _ALPHAS,          # --force STAGE: which cached artifacts to redo
    "calibrate": {"--model", "--force"} | _ALPHAS,      # --force: redo a cached artifact
    "sweep": {"--model"} | _ALPHAS,                     # calibrate's flags (refused: the sweep searches)
    "score": {"--model", "--save"},                     # --save: where the table goes
    "eval": {"--plan", "--model"},
    "rewrite": {"--model", "--plan", "--onnx", "--force"},
    "cache": set(),
    "bench": {"--plan", "--artifact", "--model", "--dense-engine", "--harp-engine", "--force"},
    "generate": {"--artifact", "--prompt"},
}
assert all(flags - {"--force", "--save"} <= _INPUTS | _ALPHAS for flags in NOT_CONFIG.values())


def _deploy_inputs() -> dict[str, set[str]]:
    """``deploy TARGET``'s flags that set no field: the inputs its ``DeployTarget`` declares."""
    from harp_trt.cli.deploy import targets

    return {f"deploy {name}": ({"--plan", "--model"} if t.source == "plan" else {"--artifact"})
            | ({"--out"} if t.out != "none" else set()) | {"--force"} for name, t in targets().items()}


NOT_CONFIG.update(_deploy_inputs())
_EVERY_COMMAND = {"-h", "--help", "--workdir", "--json", "-v", "--verbose"}


def _commands():
    """(command name, its parser) for every command and deploy target."""
    from harp_trt.cli import build_parser

    def subparsers(p):
        return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})

    for name, p in subparsers(build_parser()).items():
        targets = subparsers(p)
        yield from ((f"{name} {t}", tp) for t, tp in targets.items()) if targets else [(name, p)]


def test_every_flag_is_a_config_field_or_listed():
    seen, fields = set(), set()
    for name, p in _commands():
        seen.add(name)
        for a in p._actions:
            field = getattr(a, "config_field", None)
            flags = set(a.option_strings) - _EVERY_COMMAND
            if field:
                fields.add(field)
                assert not flags & NOT_CONFIG[name], (name, a.option_strings, "listed but generated")
            elif flags:
                assert flags <= NOT_CONFIG[name], (name, sorted(flags - NOT_CONFIG[name]))
    assert seen == set(NOT_CONFIG)
    assert {"CalibrateConfig.layers", "OrtBuildConfig.quant_symmetric", "TritonRepoConfig.max_input_len",
            "BenchConfig.seq_lens", "TrtllmCheckpointConfig.tp_size", "GenaiConfig.link", "GgufConfig.gguf_type",
            "SamplingParams.temperature"} <= fields


def test_every_declared_option_is_offered():
    """A field that declares option() is a flag of some command (no dead declarations)."""
    import dataclasses

    from harp_trt.config import cli_option
    from harp_trt.registry import STAGES

    offered = {getattr(a, "config_field", None) for _, p in _commands() for a in p._actions}
    declared = {f"{c.__name__}.{f.name}" for c in {STAGES.get(n).config_class() for n in STAGES.names()}
                for f in dataclasses.fields(c) if cli_option(f)}
    assert declared and declared <= offered, sorted(declared - offered)


@pytest.mark.parametrize("argv, value", [
    (["deploy", "triton", "--artifact", "a", "--out", "o", "--copy", "--include-input", "--prompt-limit", "7"],
     {"link": False, "exclude_input_in_output": False, "max_input_len": 7}),
    (["deploy", "trtllm", "--plan", "p", "--no-hf", "--tp", "2"], {"hf_format": False, "tp_size": 2}),
    (["bench", "--plan", "p", "--engine", "ort", "--seq-lens", "8,16", "--tasks", "none", "--no-latency"],
     {"engine": "ort", "seq_lens": (8, 16), "tasks": (), "latency": False}),
])
def test_flags_map_back_to_fields(argv, value):
    """Parsed flags -> field values, negated flags and comma lists included."""
    from harp_trt.cli import build_parser
    from harp_trt.cli._options import values_from_args
    from harp_trt.registry import STAGES

    stage = {"deploy": argv[1], "bench": "bench"}[argv[0]]
    got = values_from_args(STAGES.get(stage).config_class(), build_parser().parse_args(argv))
    assert {k: got[k] for k in value} == value


def test_bench_engine_choices_are_the_registry():
    from harp_trt.bench.stage.config import ENGINES

    (bench,) = [p for name, p in _commands() if name == "bench"]
    (engine,) = [a for a in bench._actions if "--engine" in a.option_strings]
    assert list(engine.choices) == ENGINES.names() and engine.config_field == "BenchConfig.engine"


def _cli_string_uses(names: set[str]) -> list[str]:
    """``file:line name`` for every string constant in harp_trt/cli/ equal to one of ``names``."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return [f"{f.name}:{n.lineno} {n.value}" for f in sorted((root / "harp_trt" / "cli").glob("*.py"))
            for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Constant) and n.value in names]


def test_deploy_targets_come_from_their_stages():
    """``harp-trt deploy``'s targets, their inputs and their summaries are declared by the stages
    (``StageCli.deploy`` in each light config module); the CLI spells no target's name."""
    from harp_trt.cli.deploy import targets
    from harp_trt.registry import STAGES

    found = targets()
    assert set(found) == {"trtllm", "triton", "genai", "gguf"}
    assert all(STAGES.get(stage).cli.deploy is target for stage, target in found.items())
    assert _cli_string_uses(set(found)) == []
    assert _cli_string_uses({"gguf"}) == [] and _cli_string_uses({"deploy"})  # the scan sees a name
