"""``harp-trt deploy`` (TensorRT-LLM backend) on a tiny local model folder and its plan."""
from __future__ import annotations

import argparse
import json

import pytest

from harp_trt.cli import common_arguments, emit
from harp_trt.cli import deploy
from harp_trt.errors import PreconditionError
from harp_trt.models import weight_digest
from harp_trt.plan import Plan

from conftest import forbid_model_loads, save_tiny


def _args(argv):
    p = argparse.ArgumentParser()
    deploy.add_arguments(p)
    common_arguments(p)
    return p.parse_args(argv)


@pytest.fixture()
def tiny(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "qwen2-tiny")
    plan = Plan(str(folder), weight_digest(folder), "qwen2", 4, "test", (2, 3), (0.8, 0.5))
    plan.save(tmp_path / "plan.json")
    return folder, tmp_path / "plan.json"


def test_deploy_writes_verified_artifact(tiny, tmp_path, capsys, monkeypatch):
    folder, plan = tiny
    args = _args(["trtllm", "--plan", str(plan), "--dtype", "float32", "--tp", "2", "--max-input-len", "32",
                  "--max-seq-len", "64", "--workdir", str(tmp_path / "cache"), "--json"])
    out = deploy.run(args)
    assert out["architecture"] == "Qwen2ForCausalLM" and out["route"] == "window1" and not out["cached"]
    assert out["verify_max_abs_diff"] <= 1e-4 and out["engine_built"] is False
    assert out["kv_bytes_per_token"] == out["kv_bytes_per_token_unpruned"] // 2  # 2 of 4 layers hold the sequence
    assert [r["window"] for r in out["_tables"]["layers"]] == ["full", "full", 1, 1]
    emit(out, as_json=True)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["artifact"] == out["artifact"] and "_tables" not in last
    forbid_model_loads(monkeypatch)  # the stage's input is the resolved model: a hit reads no weights
    assert deploy.run(args)["cached"] is True


def test_deploy_refuses_a_plan_for_other_weights(tiny, tmp_path):
    folder, plan = tiny
    other = save_tiny("qwen2", tmp_path / "other", seed=1)
    with pytest.raises(PreconditionError, match="is not the model the plan was calibrated on"):
        deploy.run(_args(["trtllm", "--plan", str(plan), "--model", str(other), "--workdir", str(tmp_path / "c")]))
