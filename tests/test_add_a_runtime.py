"""The house's measure: a new runtime is its folder (and its tests and extra). A toy one,
planted in a temporary package, is found by the registry and offered by ``harp-trt deploy`` with its
config's flags, its inputs and its summary, with no line added to the core or the CLI."""
from __future__ import annotations

import json
import sys

import pytest

TOY_CONFIG = '''
import dataclasses
from typing import ClassVar

from harp_trt.config import StageConfig, option
from harp_trt.stage_spec import DeployTarget, StageCli, StageSpec


@dataclasses.dataclass(frozen=True)
class ToyConfig(StageConfig):
    VERSION: ClassVar[int] = 1
    greeting: str = option("hello", help="what the toy runtime writes (default %(default)s)")


STAGE = StageSpec("toyrt", "toyrt.stage:ToyStage", "toyrt.config:ToyConfig", "build", "a toy runtime",
                  StageCli(deploy=DeployTarget(help="a toy deployment", description="write a toy deployment",
                                               source="artifact", deploy="deploy_toy", summary="summary",
                                               out="required", artifact_help="any folder")))
'''
TOY_STAGE = '''
from pathlib import Path

from harp_trt.stage import Stage

from .config import ToyConfig


class ToyStage(Stage[ToyConfig]):
    name = "toyrt"


def deploy_toy(artifact, out, config, *, store=None, force=False):
    Path(out).mkdir(parents=True)
    (Path(out) / "deployment.txt").write_text(f"{config.greeting} {Path(artifact).name}")
    return {"folder": str(out), "greeting": config.greeting}


def summary(report, config):
    return {"folder": report["folder"], "said": report["greeting"]}
'''


@pytest.fixture()
def toy_runtime(tmp_path, monkeypatch):
    """The registry of this checkout plus the planted ``toyrt`` folder (as a runtime under builders/
    would be found: ``find_stages`` over one more root)."""
    import harp_trt.registry as registry

    pkg = tmp_path / "toyrt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(TOY_CONFIG)
    (pkg / "stage.py").write_text(TOY_STAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    stages = registry.Registry("stage", discover=lambda: ((s.name, s) for s in
                                                          registry.find_stages(registry.STAGE_ROOTS + ("toyrt",))))
    monkeypatch.setattr(registry, "STAGES", stages)
    yield tmp_path
    for m in [m for m in sys.modules if m == "toyrt" or m.startswith("toyrt.")]:
        del sys.modules[m]


def test_a_new_runtime_is_its_folder(toy_runtime, capsys):
    from harp_trt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["deploy", "toyrt", "--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    assert "--greeting GREETING" in shown and "--artifact ARTIFACT" in shown and "--out OUT" in shown
    src, out = toy_runtime / "engine", toy_runtime / "deployed"
    src.mkdir()
    assert main(["deploy", "toyrt", "--artifact", str(src), "--out", str(out), "--greeting", "hi", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["said"] == "hi" and result["folder"] == str(out) and "seconds" in result
    assert (out / "deployment.txt").read_text() == "hi engine"
    from harp_trt.cli.deploy import targets

    assert {"toyrt", "gguf", "genai", "triton", "trtllm"} == set(targets())
