"""The onnxruntime-genai engine: a dense and a HARP genai folder (``builders/genai``: the ORT
engine's graph plus ``genai_config.json``) run through genai's own ``og.Model`` / ``og.Generator``,
the loop a genai user runs, in one process. Folders open through ``harp_trt.genai_runtime``.

How each bench call maps onto genai 0.18 (checked against ``OrtCausalLM`` on the same graph: equal
logits to 1.2e-7 on the tiny test models):

* ``prefill``: a generator (batch B, ``max_length`` = prompt + ``headroom``), ``append_tokens``
  (one forward over the prompt), ``get_logits`` (the last position);
* ``decode``, batch 1: ``append_tokens`` of the caller's token (one forward); genai allows
  repeated appends at batch 1 only. Past ``max_length`` (lm-eval generation beyond the
  headroom) the generator is rebuilt twice as long from the sequence so far;
* ``decode``, batch > 1: ``generate_next_token``, which picks the greedy token from the pending
  logits and runs its forward. Its pick is the caller's (both take the first maximum) except where
  the caller picked EOS: ``min_length`` = ``max_length`` keeps a timed run from ending, so genai
  masks EOS and continues with the runner-up; only the latency runs decode batches, so no reported
  figure depends on that row's tokens. Any other disagreement raises;
* ``logits``: a generator of exactly the sequence, ``append_tokens``, ``get_output("logits")``
  (our graphs compute every position's logits; a graph that computes only the last one is refused);
* ``cache_bytes``: the ``present.*`` tensors the generator holds (``get_output``), i.e. the KV
  buffers genai allocated: only for the layers the graph has KV for. With
  ``past_present_share_buffer`` they are ``max_length`` positions long from the first forward, so
  ``cache_tokens`` reports that length and the bench divides by it.

``prefill_seconds``, ``decode_tokens_per_s`` and ``generate`` time whole genai calls at batch 1, as a
genai user makes them (``bench/vs_genai.py``, ``bench/prefill_profile.py``): one genai timing engine
for every script."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from harp_trt.dims import ModelDims
from harp_trt.errors import PreconditionError, VerificationError
from harp_trt.genai_runtime import genai_version, import_genai, open_genai_model
from harp_trt.store import Artifact

from .engines import Engine, EnginePair

__all__ = ["GenaiBenchEngine", "load_genai_pair"]

log = logging.getLogger(__name__)

STAGE = "bench"


@dataclass
class _State:
    gen: Any
    batch: int
    max_length: int
    logits: torch.Tensor   # the logits last returned (their argmax is genai's next greedy pick)


class GenaiBenchEngine(Engine):
    backend = "genai"
    prefill_logits = "all"   # the graph computes every position's logits (as OrtEngine), unless it
    # returns the last position's only (``deploy genai --last-logits``, genai's prune_lm_head): see __init__

    def __init__(self, folder: Path, variant: str, threads: int, headroom: int, max_positions: int,
                 provider: str = "cpu", arena: bool = True):
        self.og = import_genai(STAGE)
        self.folder = Path(folder)
        self.variant = variant
        self.headroom = int(headroom)
        cfg = json.loads((self.folder / "genai_config.json").read_text())["model"]
        self.context = min(int(cfg["context_length"]), int(max_positions))
        self.num_layers = int(cfg["decoder"]["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        self.eos = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        self.prefill_logits = _logits_positions(self.folder / cfg["decoder"]["filename"])
        self.model = open_genai_model(self.folder, threads, STAGE, provider, arena)  # "cuda": bench/gpu_*.py
        self._kv_names: list[str] | None = None

    @property
    def max_positions(self) -> int:
        return self.context

    def _generator(self, batch: int, max_length: int, stop_at_eos: bool = False) -> Any:
        if max_length > self.context:
            raise PreconditionError(STAGE, f"genai generator of {max_length} tokens exceeds {self.folder.name}'s "
                                    f"context_length {self.context}", "use shorter --seq-lens / --decode-context")
        params = self.og.GeneratorParams(self.model)
        options = dict(max_length=max_length, batch_size=batch, do_sample=False)
        if not stop_at_eos:   # EOS cannot end a timed run early
            options["min_length"] = max_length
        params.set_search_options(**options)
        return self.og.Generator(self.model, params)

    def _last_logits(self, gen: Any, batch: int) -> torch.Tensor:
        return torch.from_numpy(np.array(gen.get_logits(), dtype=np.float32).reshape(batch, -1))

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        b, s = ids.shape
        length = min(s + self.headroom, self.context)
        gen = self._generator(b, max(length, s))
        gen.append_tokens(ids.numpy().astype(np.int32))
        logits = self._last_logits(gen, b)
        return logits, _State(gen, b, max(length, s), logits)

    def decode(self, token: torch.Tensor, state: _State) -> tuple[torch.Tensor, Any]:
        tok = token.reshape(-1).numpy().astype(np.int32)
        gen = state.gen
        if state.batch == 1:
            if gen.token_count() >= state.max_length:
                state = self._regrow(state)
                gen = state.gen
            gen.append_tokens(tok.reshape(1, 1))
        else:
            if gen.token_count() >= state.max_length:
                raise PreconditionError(STAGE, f"genai generator of batch {state.batch} is full at "
                                        f"{state.max_length} tokens (prefill headroom {self.headroom})")
            gen.generate_next_token()
            picked = np.asarray(gen.get_next_tokens()).reshape(-1)
            wrong = [i for i, (p, t) in enumerate(zip(picked, tok)) if p != t and int(t) not in self.eos]
            if wrong:
                raise VerificationError(STAGE, f"genai's greedy pick {picked.tolist()} differs from the bench's "
                                        f"{tok.tolist()} in rows {wrong} (not an EOS row)")
        state.logits = self._last_logits(gen, state.batch)
        return state.logits, state

    def _regrow(self, state: _State) -> _State:
        """A batch-1 generator twice as long holding the same sequence (one forward over it)."""
        seq = np.asarray(state.gen.get_sequence(0), dtype=np.int32)
        length = min(2 * state.max_length, self.context)
        if length <= len(seq):
            raise PreconditionError(STAGE, f"generation reached {self.folder.name}'s context_length {self.context}")
        gen = self._generator(1, length)
        gen.append_tokens(seq.reshape(1, -1))
        return _State(gen, 1, length, self._last_logits(gen, 1))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        gen = self._generator(b, s)
        gen.append_tokens(ids.numpy().astype(np.int32))
        out = np.asarray(gen.get_output("logits"), dtype=np.float32)
        if out.shape[:2] != (b, s):
            raise PreconditionError(STAGE, f"{self.folder.name}'s graph returns logits of shape {list(out.shape)} "
                                    f"for {b} x {s} tokens: teacher-forced scoring needs every position",
                                    "bench a graph that computes all positions' logits (harp-trt export does)")
        return torch.from_numpy(out)

    def kv_names(self, gen: Any) -> list[str]:
        """The ``present.*`` outputs the generator holds, found by asking genai for every layer's."""
        if self._kv_names is None:
            names = []
            for i in range(self.num_layers):
                for kind in ("key", "value"):
                    try:
                        gen.get_output(f"present.{i}.{kind}")
                    except RuntimeError:  # "Generator output 'present.2.key' was not found."
                        continue
                    names.append(f"present.{i}.{kind}")
            self._kv_names = names
        return self._kv_names

    def kv_layers(self) -> list[int]:
        """Layers genai holds a KV cache for (a one-token generator, asked for its outputs)."""
        gen = self._generator(1, 2)
        gen.append_tokens(np.asarray([[1]], dtype=np.int32))
        return sorted({int(n.split(".")[1]) for n in self.kv_names(gen)})

    def kv_allocation(self, batch: int, max_length: int) -> tuple[int, int | None]:
        """(KV bytes, positions per sequence they cover) genai holds for a generator of ``batch``
        sequences of ``max_length`` after its first forward (one token each; ``cache_bytes`` /
        ``cache_tokens``); the generator is dropped again. With ``past_present_share_buffer`` the
        positions are ``max_length``: genai allocates them ahead."""
        gen = self._generator(batch, max_length)
        gen.append_tokens(np.ones((batch, 1), dtype=np.int32))
        state = _State(gen, batch, max_length, None)   # its logits are not read
        return self.cache_bytes(state), self.cache_tokens(state)

    def cache_bytes(self, state: _State) -> int:
        return int(sum(np.asarray(state.gen.get_output(n)).nbytes for n in self.kv_names(state.gen)))

    def cache_tokens(self, state: _State) -> int | None:
        names = self.kv_names(state.gen)
        return int(np.asarray(state.gen.get_output(names[0])).shape[2]) if names else None

    # ---- whole calls, timed inside (bench/vs_genai.py, bench/prefill_profile.py): batch 1, a fresh
    # greedy generator each, set up untimed; the caller warms up and repeats --------------------------
    def prefill_seconds(self, ids: Sequence[int]) -> float:
        """Seconds from handing over the prompt to having the first token: ``append_tokens`` (one
        forward over the prompt), then ``generate_next_token`` (the greedy pick from those logits)."""
        gen = self._generator(1, len(ids) + 1)
        t0 = time.perf_counter()
        gen.append_tokens(list(ids))
        gen.generate_next_token()
        return time.perf_counter() - t0

    def decode_tokens_per_s(self, prompt_ids: Sequence[int], n_tokens: int) -> float:
        """Greedy decode speed: after the prompt's prefill and first token (untimed), ``n_tokens``
        further ``generate_next_token`` steps, one forward each."""
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        gen = self._generator(1, len(prompt_ids) + n_tokens + 1)
        gen.append_tokens(list(prompt_ids))
        gen.generate_next_token()
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            gen.generate_next_token()
        return n_tokens / (time.perf_counter() - t0)

    def generate(self, prompt_ids: Sequence[int], n_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt_ids``: up to ``n_tokens`` new ids, stopping at EOS."""
        gen = self._generator(1, len(prompt_ids) + n_tokens, stop_at_eos=True)
        gen.append_tokens(list(prompt_ids))
        out: list[int] = []
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out

    def close(self) -> None:
        self.model = None


def _logits_positions(graph: Path) -> str:
    """"last" where the graph's ``logits`` output holds one position, else "all" (read without weights)."""
    import onnx

    out = next((o for o in onnx.load(str(graph), load_external_data=False).graph.output if o.name == "logits"), None)
    dims = out.type.tensor_type.shape.dim if out is not None else []
    return "last" if len(dims) == 3 and dims[1].dim_value == 1 else "all"


def _folder(s: Any) -> Path:
    return s.path if isinstance(s, Artifact) else Path(s)


def load_genai_pair(plan, source, config, arena: bool = True) -> EnginePair:
    """``source``: ``{"dense": folder|Artifact, "harp": folder|Artifact}`` of genai folders. The
    HARP folder's KV layers, as genai holds them, must be the plan's kept layers. ``arena`` False:
    the sessions run without ONNX Runtime's CPU arena, so a long prefill's buffers go back to the
    system when it ends (bench/long_context.py: three batch-4 prefills of 8192 tokens)."""
    from transformers import AutoConfig

    from harp_trt.models import load_tokenizer

    folders = {v: _folder(source[v]) for v in ("dense", "harp")}
    for v, f in folders.items():
        for name in ("genai_config.json", "config.json"):
            if not (f / name).is_file():
                raise PreconditionError(STAGE, f"{v} genai folder {f} has no {name}",
                                        "pass folders written by `harp-trt deploy genai` or build --backend genai")
    cfg = AutoConfig.from_pretrained(folders["dense"], trust_remote_code=False)
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
    headroom = max(config.decode_tokens, config.greedy_tokens) + 1
    engines = {v: GenaiBenchEngine(f, v, config.threads, headroom, max_pos, arena=arena) for v, f in folders.items()}
    kept = engines["harp"].kv_layers()
    want = sorted(set(range(cfg.num_hidden_layers)) - set(plan.layers))
    if kept != want:
        raise PreconditionError(STAGE, f"genai holds KV for layers {kept} of {folders['harp']}; the plan keeps "
                                f"{want}", "rebuild the HARP genai folder from this plan")
    info = {v: {"folder": str(f), "threads": config.threads or None, "onnxruntime_genai": genai_version(),
                "kv_layers": engines[v].kv_layers(), "headroom": headroom,
                "share_buffer": json.loads((f / "genai_config.json").read_text())["search"].get(
                    "past_present_share_buffer")}
            for v, f in folders.items()}
    log.info("genai engines: dense %s, harp %s", folders["dense"], folders["harp"])
    return EnginePair("genai", engines["dense"], engines["harp"], load_tokenizer(folders["dense"]),
                      ModelDims.from_config(cfg), plan.alpha_map, info)
