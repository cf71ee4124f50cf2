"""Rows of docs/trtllm-contract.md whose wording is itself the finding: what a row cites must be the
source that shows the requirement (tb-batching), and what a row lists must be what the code passes
(triton-launch). The table's general checks (every row cites a source, a test and code that exist)
are in test_trtllm_contract.py."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(rid: str) -> list[str]:
    for line in (ROOT / "docs" / "trtllm-contract.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] == rid:
            return cells
    raise AssertionError(f"no row {rid!r} in docs/trtllm-contract.md")


def test_tb_batching_row_cites_where_v1_fails():
    """``BatchingType`` still defines ``kSTATIC`` and the backend still maps ``V1`` to it, so neither
    shows V1 is gone (the row cited only those before): it must cite the executor that throws on it
    (``Executor::Impl::createModel``) and the factory that builds in-flight models only, and quote
    the error."""
    _, requirement, source, _, _ = _row("tb-batching")
    assert "Executor::Impl::createModel" in source and "executorImpl.cpp" in source
    assert "TrtGptModelFactory::create" in source and "types.h" not in source
    assert "Static batching type is deprecated" in requirement and "kSTATIC" in requirement


def test_triton_launch_row_names_every_flag_the_readme_passes():
    """The row and the code agree: every flag and environment variable ``launch_command`` gives the
    server, for one rank and for several, is named in the row, beside the launcher functions it cites."""
    from harp_trt.builders.triton.readme import launch_command

    _, requirement, source, _, _ = _row("triton-launch")
    for world in (1, 2):
        cmd, env = launch_command(world)
        for arg in cmd:
            assert arg.split("=")[0] in requirement or arg in requirement, (world, arg)
        assert all(f"{k}={v}" in requirement for k, v in env.items()), env
    for name in ("launch_triton_server.py", "get_cmd", "add_multi_model_config", "getParallelConfigFromParams"):
        assert name in source, name
