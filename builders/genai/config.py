"""``GenaiConfig``: how the onnxruntime-genai folder is written. Light on purpose (no onnx, no
onnxruntime-genai): the CLI builds its flags from the fields' ``option`` declarations."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from harp_trt.config import StageConfig, option
from harp_trt.stage_spec import DeployTarget, StageCli, StageSpec

__all__ = ["GenaiConfig", "CLI"]


@dataclasses.dataclass(frozen=True)
class GenaiConfig(StageConfig):
    """``context_length``: the longest sequence (prompt + new tokens) genai accepts and the
    ``search.max_length`` default; 0 = the model's ``max_position_embeddings`` (it may not exceed
    it: the graph's rotary tables end there). ``link``: hard-link the graph and its weights from
    the engine instead of copying where the filesystem allows. ``verify``: after writing, open the
    folder with ``og.Model`` (where onnxruntime-genai is installed) and check its greedy tokens
    against our ORT session on the same graph for ``verify_tokens`` steps. ``last_logits``: the folder's
    graph returns the last position's logits only (``last_logits.py``; genai's builder calls it
    ``prune_lm_head``): a long prompt's prefill skips the LM head over every other position and its
    ``[B, S, V]`` output, but the folder no longer serves teacher-forced scoring (perplexity, lm-eval).
    Off by default, as in genai's builder: the folder serves every use."""

    VERSION: ClassVar[int] = 1
    context_length: int = option(0, help="longest prompt + new tokens, 0 = the model's max_position_embeddings "
                                         "(default %(default)s)")
    link: bool = option(True, flag="--copy", negate=True, help="copy the graph instead of hard-linking it")
    verify: bool = option(True, flag="--no-verify", negate=True, help=(
        "skip the check that og.Generator's greedy tokens equal ONNX Runtime's on the graph"))
    last_logits: bool = option(False, flag="--last-logits", help=(
        "the graph returns only the last position's logits (genai's prune_lm_head): less memory and "
        "compute at long prompts; the folder then cannot score text (perplexity, lm-eval)"))
    verify_tokens: int = 8

    def validate(self) -> None:
        self.check_ints(("context_length",), 0)
        self.check_ints(("verify_tokens",), 1)


CLI = StageCli(deploy=DeployTarget(
    help="onnxruntime-genai folder (og.Model) for an ORT engine",
    description="write a folder onnxruntime-genai opens with og.Model: the engine's graph, tokenizer files and a "
                "genai_config.json read from its metadata",
    source="artifact", deploy="deploy_genai", summary="deploy_summary",
    artifact_help="ORT engine folder (build-ort artifact) or its cache key",
    out_help="folder to write (new or empty); default: the cached genai-<key> artifact in --workdir",
    force_help="replace --out if it is not empty / rebuild the cached folder"))

STAGE = StageSpec("genai", "harp_trt.builders.genai.stage:GenaiStage", "harp_trt.builders.genai.config:GenaiConfig", "build",
                  "onnxruntime-genai folder (og.Model) around an engine", CLI)
