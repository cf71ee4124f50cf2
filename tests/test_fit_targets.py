"""A fitted rrr map (calibrate --replacement rrr) in the formats that fold a pruned layer
into one hidden x hidden matrix: llama.cpp's deci GGUF (run by llama.cpp itself) and the
TensorRT-LLM checkpoint / HF DeciLM folder (read back by the DeciLM forward of
``builders/trtllm/reader.py``), each against the PyTorch HARP model with the same map, and each
unlike the HARP model without it (the map is really written)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import save_tiny
from test_fit_rewrite import FITTED_LAYER, _fitted_plan

import llama_cpp  # noqa: F401  (the test extra installs it: a missing runtime fails, never skips)

TOKENS = [3, 17, 64, 90, 5, 33, 120, 7, 41, 41, 2, 99, 16]
F32_TOL = 1e-4  # max |logit diff| / max(1, max |reference logit|), as tests/test_gguf_deploy.py


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny llama folder, its resolved reference and a plan (layer 1 at alpha 0.7, layer 3 a
    random rrr map) saved with its tensors."""
    from harp_trt.models import resolve_model

    root = tmp_path_factory.mktemp("fit-targets")
    folder = save_tiny("llama", root / "m", seed=0, intermediate_size=256)  # DeciLM widths: multiples of 256
    resolved = resolve_model(str(folder), root / "cache")
    return folder, resolved, _fitted_plan(root / "plan", resolved, "llama", intermediate_size=256)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))


def test_gguf_carries_the_fitted_map(fitted, tmp_path):
    from harp_trt.builders.gguf import probe
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import deploy_gguf, reference_logits

    folder, resolved, plan = fitted
    r = deploy_gguf(plan, resolved, tmp_path / "out", GgufConfig(dtype="f32"))
    assert r["verification"]["passed"] and r["fitted_layers"] == [FITTED_LAYER]
    got = probe.logits(tmp_path / "out" / "model.gguf", TOKENS)
    assert _rel(got, reference_logits(folder, plan.alpha_map, TOKENS, "f32", plan.fitted_tensors())) <= F32_TOL
    assert _rel(got, reference_logits(folder, plan.alpha_map, TOKENS, "f32")) > 100 * F32_TOL


@pytest.mark.parametrize("tp", [1, 2])
def test_trtllm_checkpoint_and_hf_decilm_carry_the_fitted_map(fitted, tmp_path, tp):
    from harp_trt.builders.trtllm.checkpoint import write_checkpoint
    from harp_trt.builders.trtllm.hf_format import write_hf_decilm
    from harp_trt.builders.trtllm.reader import read_checkpoint, read_hf_decilm
    from harp_trt.device import Placement
    from harp_trt.layerwise import LayerStack

    folder, _, plan = fitted
    ids = torch.tensor([TOKENS])
    ref = LayerStack.open(folder, Placement("cpu", "float32"))
    ref.apply_plan(plan.alpha_map, plan.fitted_tensors())
    with torch.no_grad():
        want = ref.model(ids).logits
    write_checkpoint(folder, plan, tmp_path / "ckpt", dtype="float32", tp_size=tp)
    got = read_checkpoint(tmp_path / "ckpt")(ids)
    assert (got - want).abs().max().item() <= F32_TOL * max(1.0, want.abs().max().item())
    plain = LayerStack.open(folder, Placement("cpu", "float32"))
    plain.apply_plan(plan.alpha_map)
    with torch.no_grad():
        assert (got - plain.model(ids).logits).abs().max().item() > 100 * F32_TOL
    if tp == 1:
        assert write_hf_decilm(folder, plan, tmp_path / "hf", dtype="float32")["written"]
        assert (read_hf_decilm(tmp_path / "hf")(ids) - want).abs().max().item() <= F32_TOL * max(1.0, want.abs().max().item())


def test_lmmse_is_refused_by_every_writer(fitted, tmp_path):
    """lmmse's hidden x hidden map has a bias none of these formats holds: a typed error, nothing written."""
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import deploy_gguf
    from harp_trt.builders.trtllm.checkpoint import write_checkpoint
    from harp_trt.errors import PreconditionError

    folder, resolved, _ = fitted
    lm = _fitted_plan(tmp_path / "lm", resolved, "llama", method="lmmse")
    with pytest.raises(PreconditionError, match="fitted lmmse map"):
        deploy_gguf(lm, resolved, tmp_path / "g", GgufConfig(dtype="f32"))
    with pytest.raises(PreconditionError, match="fitted lmmse map"):
        write_checkpoint(folder, lm, tmp_path / "c", dtype="float32")
    assert not (tmp_path / "g").exists() and not any(Path(tmp_path / "c").glob("*.safetensors"))
