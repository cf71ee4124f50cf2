"""A written Triton model repository checked as far as it can be without a server: every
``config.pbtxt`` parses as Triton's ``ModelConfig`` and every ensemble's wiring holds (the
stage's postcondition)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harp_trt.errors import PostconditionError
from harp_trt.onnx_io import TOKENIZER_FILES

from .pbtxt import STAGE, parse_model_config

__all__ = ["validate_repository"]


def validate_repository(repo: Path) -> dict[str, Any]:
    """Parse every ``<model>/config.pbtxt`` into ``ModelConfig`` and check the repository is
    loadable as far as it can be without a server: model name = folder name, a version folder
    ``1/`` exists, no ``${...}`` left in any text file, and every ensemble step names a model of the
    repository, maps only tensors that model has, with matching data types and dims, and reads only
    ensemble inputs or outputs of earlier steps. Returns ``{model name: ModelConfig}``."""
    repo = Path(repo)
    configs = {}
    for cfg_path in sorted(repo.glob("*/config.pbtxt")):
        msg = parse_model_config(cfg_path, where=str(cfg_path.relative_to(repo)))
        folder = cfg_path.parent.name
        if msg.name != folder:
            raise PostconditionError(STAGE, f"{folder}/config.pbtxt names the model {msg.name!r}; Triton needs "
                                     f"the folder name {folder!r}")
        if not (cfg_path.parent / "1").is_dir():
            raise PostconditionError(STAGE, f"model {folder} has no version folder 1/")
        if not msg.input or not msg.output:
            raise PostconditionError(STAGE, f"model {folder} declares no inputs or no outputs")
        configs[folder] = msg
    if not configs:
        raise PostconditionError(STAGE, f"{repo} holds no <model>/config.pbtxt")
    for f in repo.rglob("*"):
        if f.is_file() and f.suffix in (".pbtxt", ".py", ".md", ".json", ".sh") and f.stat().st_size < 1 << 22:
            text = f.read_text(errors="replace")
            if "${" in text and f.name not in TOKENIZER_FILES:
                raise PostconditionError(STAGE, f"{f.relative_to(repo)} still holds a template key "
                                         f"{text[text.index('${'):][:40].splitlines()[0]!r}")
    for name, msg in configs.items():
        if msg.platform == "ensemble":
            _check_ensemble(name, msg, configs)
    return configs


def _tensors(msg, group: str) -> dict[str, Any]:
    return {t.name: t for t in getattr(msg, group)}


def _check_ensemble(name: str, ens, configs: dict[str, Any]) -> None:
    def fail(text: str):
        raise PostconditionError(STAGE, f"ensemble {name}: {text}")

    available = dict(_tensors(ens, "input"))  # tensor name -> spec (data_type, dims)
    for i, step in enumerate(ens.ensemble_scheduling.step):
        model = configs.get(step.model_name)
        if model is None:
            fail(f"step {i} runs model {step.model_name!r}, which is not in the repository")
        if model.max_batch_size < ens.max_batch_size:
            fail(f"max_batch_size {ens.max_batch_size} exceeds {step.model_name}'s {model.max_batch_size}")
        m_in, m_out = _tensors(model, "input"), _tensors(model, "output")
        for key, value in step.input_map.items():
            if key not in m_in:
                fail(f"step {step.model_name} maps input {key!r}, which the model does not have")
            if value not in available:
                fail(f"step {step.model_name} reads {value!r} before any step produces it")
            src, dst = available[value], m_in[key]
            if src.data_type != dst.data_type or list(src.dims) != list(dst.dims):
                fail(f"{value!r} ({src.data_type}, {list(src.dims)}) does not match {step.model_name}.{key} "
                     f"({dst.data_type}, {list(dst.dims)})")
        required = {n for n, t in m_in.items() if not t.optional}
        missing = required - set(step.input_map)
        if missing:
            fail(f"step {step.model_name} leaves required input(s) {sorted(missing)} unmapped")
        for key, value in step.output_map.items():
            if key not in m_out:
                fail(f"step {step.model_name} maps output {key!r}, which the model does not have")
            available[value] = m_out[key]
    for out in ens.output:
        if out.name not in available:
            fail(f"output {out.name!r} is produced by no step")
        src = available[out.name]
        if src.data_type != out.data_type or list(src.dims) != list(out.dims):
            fail(f"output {out.name!r} does not match the step output that produces it")
