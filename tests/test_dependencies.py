"""The tested set of dependencies (``constraints.txt``) and the commands that install it.

A fresh clone's suite once failed because pip resolved a new transformers release inside the declared
range: the README's two commands and ``.ci/run`` now install with ``-c constraints.txt``,
and these tests keep that true. ``.ci/newest`` runs the same suite on the newest releases inside the
ranges and sets ``HARP_TRT_UNPINNED=1``: there the versions may differ, the names may not."""
from __future__ import annotations

import importlib.metadata as md
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_PINNED = {"harp-trt", "pip", "setuptools", "wheel"}  # the project itself, the venv's own tools


def _name(n: str) -> str:
    return re.sub(r"[-_.]+", "-", n).lower()


def _constraints() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not name==version"
            out[_name(name)] = version
    return out


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_and_ci_install_the_tested_set():
    lines = _quick_start()
    assert len(lines) == 2, lines  # exactly two commands
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == lines[1]  # .ci/run is the README's test command
    for line in lines:
        assert "pip install -q -c constraints.txt torch==2.13.0 -e '." in line, line
    assert "python tests/wheelhouse.py && python -m pytest" in lines[1]  # assets fetched before the run


def test_every_installed_distribution_is_pinned():
    """Every distribution in this environment is in constraints.txt (a new dependency cannot float),
    at exactly the pinned version unless ``.ci/newest`` installed the newest releases on purpose."""
    pins = _constraints()
    installed = {_name(d.metadata["Name"]): d.version for d in md.distributions()}
    missing = sorted(set(installed) - set(pins) - NOT_PINNED)
    assert not missing, f"installed but not in constraints.txt: {missing}"
    if os.environ.get("HARP_TRT_UNPINNED") == "1":
        return
    wrong = {n: (v, pins[n]) for n, v in installed.items() if n in pins and v.split("+")[0] != pins[n]}
    assert not wrong, f"installed version differs from constraints.txt (installed, pinned): {wrong}"


def test_declared_ranges_hold_the_pins():
    """pyproject.toml's ranges contain the pinned versions (the lower bound of each is a tested
    release: the pin itself or one named in docs/results.md, "Dependencies")."""
    from packaging.requirements import Requirement

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _constraints()
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra
             if not r.startswith("harp-trt")]
    for r in reqs:
        assert _name(r.name) in pins, f"{r.name} is declared but not pinned"
        assert r.specifier.contains(pins[_name(r.name)], prereleases=True), (str(r), pins[_name(r.name)])
