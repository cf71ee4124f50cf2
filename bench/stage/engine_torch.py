"""The PyTorch reference engine: a Hugging Face ``*ForCausalLM`` (dense) and the same weights
patched by ``harp_trt.harp.apply_harp`` (HARP), in one process."""
from __future__ import annotations

import logging
from typing import Any

import torch

from .engines import Engine, EnginePair
from harp_trt.dims import ModelDims

__all__ = ["TorchEngine", "load_torch_pair", "torch_pair_from_models"]

log = logging.getLogger(__name__)


class TorchEngine(Engine):
    """Prefill computes the last position's logits only (``logits_to_keep=1``), as a server does."""

    backend = "torch"
    prefill_logits = "last"

    def __init__(self, model: torch.nn.Module, variant: str):
        self.model = model.eval()
        self.variant = variant

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = self.model(input_ids=ids.to(self.device), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float().cpu(), out.cache

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        out = self.model(input_ids=token.to(self.device), cache=state, use_cache=True)
        return out.logits[:, -1].float().cpu(), out.cache

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids.to(self.device), use_cache=False).logits.float().cpu()

    def cache_bytes(self, state: Any) -> int:
        total = 0
        for layer in getattr(state, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def close(self) -> None:
        self.model = None


def torch_pair_from_models(dense: torch.nn.Module, harp: torch.nn.Module, tokenizer: Any,
                           pruned: dict[int, float], info: dict[str, Any] | None = None) -> EnginePair:
    """Wrap two already-built models (``harp`` must be patched by ``apply_harp``)."""
    return EnginePair("torch", TorchEngine(dense, "dense"), TorchEngine(harp, "harp"), tokenizer,
                      ModelDims.from_config(dense.config), dict(pruned), dict(info or {}))


def load_torch_pair(plan, source, config) -> EnginePair:
    """``source``: the ``ResolvedModel`` whose weights the plan was calibrated on. Loads the
    model twice (dense and HARP) in ``config.dtype``."""
    from harp_trt.harp import apply_harp, install_fitted
    from harp_trt.models import load_model, load_tokenizer

    device = getattr(config, "device", "cpu")
    dense, family = load_model(source, dtype=config.dtype)
    harp, _ = load_model(source, dtype=config.dtype)
    dense.to(device)
    harp.to(device)
    apply_harp(harp, plan.alpha_map, family)
    fitted = plan.fitted_tensors()
    for layer in plan.fitted_layers:  # calibrate --replacement: the plan's fitted maps where it kept them
        install_fitted(harp, layer, fitted, family)
    tok = load_tokenizer(source.folder)
    log.info("torch engines: %s (%s), pruned layers %s", source.ref, config.dtype, list(plan.layers))
    return torch_pair_from_models(dense, harp, tok, plan.alpha_map,
                                  {"model": source.to_dict(), "dtype": config.dtype, "device": device,
                                   "threads": torch.get_num_threads()})
