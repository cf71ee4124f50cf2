"""A causal LM seen as ``embed -> layer 0 .. layer L-1 -> head``, run one layer at a time over every
calibration window (layer-outer order), with its decoder layers either resident or loaded on
demand from the safetensors files.

Everything PyTorch-side that needs forward passes (layer scoring, perplexity, Algorithm 1, the
reference for checkpoint verification) goes through ``LayerStack``, so the three placements give
the same numbers:

* in memory: the Hugging Face model on one device (``--device``);
* device map: the model spread over GPUs (and CPU) by accelerate (``--device-map auto``);
* sequential: a model skeleton on the meta device whose embedding, final norm and head are loaded
  once, and whose decoder layers are read from disk, run on every window and freed again (the
  layer-sequential pipeline of llm-compressor). Peak memory: one layer plus activations.

The per-layer call arguments (attention masks, rotary embeddings, ...) are captured from the
model's own forward pass by stand-ins that replace the decoder layers for one window, so no
family's mask logic is rewritten here."""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from .device import Placement, choose_sequential, torch_dtype
from .families import FamilySpec, family_of
from .ppl import model_ids, window_nll

__all__ = ["LayerStack", "Captured"]

log = logging.getLogger(__name__)


class _Stop(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for decoder layer ``i`` during capture: records its call, passes h through."""

    def __init__(self, i: int, last: int, original: nn.Module, sink: "Captured", record_kwargs: bool):
        super().__init__()
        self.i, self.last, self.sink, self.record = i, last, sink, record_kwargs
        for attr in ("attention_type", "layer_type", "is_sliding"):  # read by some decoders
            if hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))
        self.self_attn = original.self_attn  # read by HARP's cache hook (pruned or not)

    def forward(self, hidden_states, *args, **kwargs):
        if self.record:
            self.sink.kwargs[self.i] = dict(kwargs)
        if self.i == 0:
            self.sink.h0.append(hidden_states)
        if self.i == self.last:
            raise _Stop
        return hidden_states


@dataclass
class Captured:
    """Inputs of layer 0 per window, and each layer's call kwargs (identical for every window:
    one window per forward, equal lengths, no padding)."""

    h0: list[torch.Tensor]
    kwargs: dict[int, dict[str, Any]]


def _hf_param_name(module: nn.Module, local: str) -> str:
    """The checkpoint name of a parameter of a (possibly HARP-patched) module: wrappers that mark
    a child as transparent (``ScaledNorm.norm``) do not appear in Hugging Face names."""
    parts, out, m = local.split("."), [], module
    for p in parts:
        skip = getattr(m, "transparent_child", None) == p
        m = getattr(m, p)
        if not skip:
            out.append(p)
    return ".".join(out)


@dataclass(eq=False, repr=False)
class LayerStack:
    """See the module docstring. Build with :meth:`open` (from a model folder) or :meth:`wrap`
    (around an already loaded model)."""

    model: nn.Module
    family: FamilySpec
    device: torch.device
    dtype: torch.dtype
    sequential: bool = False
    reader: Any = None
    placement: Placement | None = None
    stream_embeddings: bool = False
    round_to: torch.dtype | None = None
    loads: int = field(default=0, init=False)  # layers read from disk (sequential mode)
    overlay: dict = field(default_factory=dict, init=False)  # checkpoint name -> tensor read instead (fitted maps)
    _replaced: dict = field(default_factory=dict, init=False)  # resident: checkpoint name -> the tensor a map overwrote

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def wrap(cls, model: nn.Module, family: FamilySpec | None = None) -> "LayerStack":
        p = next(model.parameters())
        return cls(model, family or family_of(model.config), p.device, p.dtype)

    @classmethod
    def open(cls, folder: str | Path, placement: Placement, stream_embeddings: bool = False,
             round_to: torch.dtype | None = None) -> "LayerStack":
        """Load the model in ``folder`` as the placement says (resident or sequential).

        Sequential only: ``stream_embeddings`` keeps the embedding table and LM head on disk too
        (rows are read for the tokens at hand, the head in row chunks): a reference that holds one
        layer and nothing else. ``round_to`` rounds every weight to that dtype before computing in
        ``placement.dtype`` (a reference for a checkpoint written in ``round_to``)."""
        from transformers import AutoConfig

        from .errors import ModelError
        from .memory import tune_allocator
        from .weights import WeightReader

        tune_allocator()
        folder = Path(folder)
        try:
            cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        except (ValueError, OSError) as e:
            raise ModelError(f"cannot read config of {folder}: {e}") from None
        family = family_of(cfg)
        reader = WeightReader(folder)
        dtype = torch_dtype(placement.dtype)
        sequential = choose_sequential(placement, reader.nbytes(dtype))
        if (stream_embeddings or round_to is not None) and not sequential:
            raise ValueError("stream_embeddings / round_to need the sequential placement")
        if not sequential:
            from .models import load_model_folder

            model = load_model_folder(folder, placement.dtype, device_map=placement.device_map)
            if placement.device_map is None:
                model.to(placement.torch_device())
            stack = cls(model, family, placement.torch_device(), dtype, placement=placement)
            log.info("model resident (%s)", placement.describe(False))
            return stack
        stack = cls(_skeleton(cfg, family, dtype), family, placement.torch_device(), dtype, sequential=True,
                    reader=reader, placement=placement, stream_embeddings=stream_embeddings, round_to=round_to)
        stack._load_outside_layers()
        log.info("model sequential (%s): %.2f GB of weights, one layer resident",
                 placement.describe(True), reader.nbytes(dtype) / 1e9)
        return stack

    def _load_outside_layers(self) -> None:
        """Embedding, final norm, head (and buffers) on the device; decoder layers stay on meta."""
        from accelerate.utils import set_module_tensor_to_device

        prefix = self.family.layers_module_path + "."
        streamed = {self.family.weight_name("embed"), self.family.lm_head_name} if self.stream_embeddings else set()
        for name, _ in list(self.model.named_parameters()):
            if name.startswith(prefix) or name in streamed:
                continue
            hf = _hf_param_name(self.model, name)
            if hf not in self.reader and name == self.family.lm_head_name:
                continue  # tied to the embedding: re-tied below
            set_module_tensor_to_device(self.model, name, self.device, value=self._read(hf))
        for name, buf in list(self.model.named_buffers()):
            if not name.startswith(prefix) and buf.device != self.device:
                set_module_tensor_to_device(self.model, name, self.device)
        out, inp = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if out is not None and out.weight.device.type == "meta" and not self.stream_embeddings:
            out.weight = inp.weight

    def apply_plan(self, alphas, fitted: dict | None = None) -> None:
        """The plan's HARP model: ``alphas`` (layer -> alpha, ``Plan.alpha_map``) by
        ``harp_trt.harp.apply_harp``, and the fitted maps (``Plan.fitted_tensors``) in their layers."""
        from .harp import apply_harp

        apply_harp(self.model, dict(alphas), self.family)
        for layer in _fitted_layers(fitted or {}, self.family):
            self.install_fitted(layer, {k: v for k, v in fitted.items()
                                        if k.startswith(self.family.layer_prefix.format(i=layer))})

    def install_fitted(self, layer: int, tensors: dict) -> None:
        """Use a fitted map in pruned layer ``layer`` (``harp_trt.harp.install_fitted``); a
        sequential stack reads its tensors from ``overlay`` whenever the layer is loaded. The
        weights a map overwrites are kept, so :meth:`remove_fitted` gives HARP's V.O back."""
        from .harp import install_fitted

        if not self.sequential:
            params = dict(self.family.layers(self.model)[layer].named_parameters())
            local = self.family.layer_prefix.format(i=layer)
            for name in tensors:
                p = params.get(name[len(local):]) if name.startswith(local) else None
                if p is not None and name not in self._replaced:
                    self._replaced[name] = p.detach().clone()
        self.overlay.update(tensors)
        install_fitted(self.model, layer, tensors, self.family)

    def remove_fitted(self, layer: int) -> None:
        """Undo :meth:`install_fitted` in ``layer``: its own V/O weights back, no fitted Linear."""
        from .harp import install_fitted

        local = self.family.layer_prefix.format(i=layer)
        for name in [k for k in self.overlay if k.startswith(local)]:
            del self.overlay[name]
        attn = self.family.layers(self.model)[layer].self_attn
        if getattr(attn, "harp_linear", None) is not None:
            attn.harp_linear = None
        saved = {k: self._replaced.pop(k) for k in [k for k in self._replaced if k.startswith(local)]}
        if saved:
            install_fitted(self.model, layer, saved, self.family)

    def _read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if name in self.overlay:
            t = self.overlay[name]
            t = (t if rows is None else t[rows[0]: rows[1]]).to(self.round_to or self.dtype)
            return t.to(self.device, self.dtype)
        t = self.reader.get(name, self.round_to or self.dtype, rows=rows)
        return t.to(self.device, self.dtype)

    # ---- layers -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.family.layers(self.model))

    @contextlib.contextmanager
    def layer(self, i: int) -> Iterator[nn.Module]:
        """Decoder layer ``i``, resident for the duration of the block."""
        layer = self.family.layers(self.model)[i]
        if not self.sequential:
            yield layer
            return
        from accelerate.utils import set_module_tensor_to_device

        base = self.family.layer_prefix.format(i=i)
        for name, _ in list(layer.named_parameters()):
            set_module_tensor_to_device(layer, name, self.device, value=self._read(base + _hf_param_name(layer, name)))
        for name, buf in list(layer.named_buffers()):
            if buf.device != self.device:
                set_module_tensor_to_device(layer, name, self.device)
        self.loads += 1
        try:
            yield layer
        finally:
            layer.to("meta")

    def input_device(self) -> torch.device:
        w = self.model.get_input_embeddings().weight
        return self.device if w.device.type == "meta" else w.device

    @contextlib.contextmanager
    def _embedding_rows(self, ids: torch.Tensor) -> Iterator[torch.Tensor]:
        """Streamed embeddings: the table holds just the rows of ``ids``; yields remapped ids."""
        if not self.stream_embeddings:
            yield ids
            return
        emb = self.model.get_input_embeddings()
        uniq, local = torch.unique(ids, return_inverse=True)
        name = self.family.weight_name("embed")
        rows = torch.cat([self._read(name, (int(r), int(r) + 1)) for r in uniq])
        meta, pad = emb.weight, emb.padding_idx
        emb.weight, emb.padding_idx = nn.Parameter(rows, requires_grad=False), None  # pad index: training only
        try:
            yield local
        finally:
            emb.weight, emb.padding_idx = meta, pad

    # ---- forward pieces ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, windows: torch.Tensor) -> Captured:
        """Run the model's own prelude (embedding, masks, rotary) on every window."""
        layers = self.family.layers(self.model)
        n = len(layers)
        got = Captured([], {})
        originals = list(layers)
        dev = self.input_device()
        try:
            for w in range(windows.shape[0]):
                for i in range(n):
                    layers[i] = _Catcher(i, n - 1, originals[i], got, record_kwargs=(w == 0))
                with self._embedding_rows(model_ids(windows[w: w + 1])) as ids:
                    try:
                        self.model(input_ids=ids.to(dev), use_cache=False)
                    except _Stop:
                        pass
        finally:
            for i, m in enumerate(originals):
                layers[i] = m
        return got

    @staticmethod
    def call(layer: nn.Module, h: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        out = layer(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @torch.inference_mode()
    def walk(self, h: list[torch.Tensor], cap: Captured, start: int = 0,
             stop: int | None = None) -> Iterator[tuple[int, nn.Module, list[torch.Tensor], list[torch.Tensor]]]:
        """Run layers ``start..stop-1`` in order over every state in ``h``; after each layer yield
        ``(index, layer, inputs, outputs)`` while the layer is still resident."""
        stop = self.num_layers if stop is None else stop
        for i in range(start, stop):
            with self.layer(i) as layer:
                out = [self.call(layer, x, cap.kwargs[i]) for x in h]
                yield i, layer, h, out
            h = out

    def run(self, h: list[torch.Tensor], cap: Captured, start: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        out = h
        for _, _, _, out in self.walk(h, cap, start, stop):
            pass
        return out

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if not self.stream_embeddings:
            return self.family.logits(self.model, h)
        x = self.family.final_norm(self.model, h)
        name = self.family.lm_head_name if self.family.lm_head_name in self.reader else self.family.weight_name("embed")
        vocab, hidden = self.reader.spec(name).shape
        step = max(1, (64 << 20) // (4 * hidden))  # head rows per read: ~64 MB in fp32
        parts = [x @ self._read(name, (r, min(r + step, vocab))).T for r in range(0, vocab, step)]
        return self.family.softcap(self.model, torch.cat(parts, -1))

    @torch.inference_mode()
    def nll(self, h: list[torch.Tensor], windows: torch.Tensor) -> tuple[float, int]:
        """Summed NLL and token count of the final hidden states ``h`` (one per window)."""
        total, count = 0.0, 0
        for w, x in enumerate(h):
            logits = self.logits(x)
            s, n = window_nll(logits, windows[w: w + 1].to(logits.device))
            total, count = total + s, count + n
        return total, count

    @torch.inference_mode()
    def nll_each(self, x: torch.Tensor, window: torch.Tensor, budget_bytes: int = 768 << 20) -> tuple[torch.Tensor, int]:
        """Summed NLL (float64, one per batch row) and the token count of final hidden states
        ``x [B, S, D]`` that all read the same ``window [1, S]`` (the candidates of one window).
        Rows go through the head in chunks whose logits fit in ``budget_bytes`` (at most 768 MiB)."""
        ids = window.reshape(1, -1).to(x.device)
        labels = ids[0, 1:]
        scored = labels >= 0
        target = labels.where(scored, -100)
        b, s = x.shape[0], x.shape[1]
        vocab = int(self.model.config.vocab_size)
        per_row = max(1, s * vocab * 4)
        chunk = max(1, min(b, min(768 << 20, budget_bytes) // per_row))
        out = []
        for c0 in range(0, b, chunk):
            logits = self.logits(x[c0: c0 + chunk, :-1]).float()  # the last position predicts nothing
            n = logits.shape[0]
            lp = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.repeat(n), reduction="none",
                                                   ignore_index=-100)
            out.append(lp.view(n, -1).double().sum(1))
            del logits, lp
        return torch.cat(out).cpu(), int(scored.sum())

    def perplexity(self, windows: torch.Tensor) -> float:
        cap = self.capture(windows)
        total, count = self.nll(self.run(cap.h0, cap), windows)
        return math.exp(total / count)


def _fitted_layers(tensors: dict, family: FamilySpec) -> list[int]:
    """The layer indices that checkpoint names in ``tensors`` belong to."""
    head, _, tail = family.layer_prefix.partition("{i}")
    return sorted({int(k[len(head):].split(".", 1)[0]) for k in tensors if k.startswith(head)})


def _skeleton(cfg, family: FamilySpec, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter on the meta device (buffers stay real: rotary tables)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=family.attn_implementation)
    return model.eval()
