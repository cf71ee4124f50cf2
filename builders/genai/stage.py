"""``GenaiStage``: an ORT engine folder (``builders/ort``) -> a folder onnxruntime-genai opens with
``og.Model(folder)``: the engine's graph (hard-linked, with its external data), its tokenizer
files, its ``engine.json`` and a ``genai_config.json`` written from the graph's own
``harp_trt.export`` metadata and its inputs, never from guessed dimensions.

Why the graph runs unchanged (checked with onnxruntime-genai 0.18.0, see tests/test_genai_deploy.py):

* our I/O names are genai's ``past_key_values.%d.key|value`` / ``present.%d.key|value`` patterns;
  genai discovers the KV layers from the graph's inputs, also at non-sequential indices, and
  allocates KV only for them, so ``num_hidden_layers`` is the dense count and a HARP graph
  needs nothing more;
* ``search.past_present_share_buffer`` must be true only where every present KV comes out of a
  ``GroupQueryAttention`` (it writes in place into a ``max_length`` buffer); a graph whose present
  KV is a concatenation (opset-23 ``Attention`` kept, e.g. Gemma2's windowed layers) fails with a
  present-shape error under a shared buffer, so it gets false;
* model ``type`` is ``llama``: genai's decoder-only path is the same for every such type, and the
  family's specifics (norm offsets, soft-capping, windows) live inside our graph.

``--last-logits`` writes an edited graph that returns the last position's logits only
(``last_logits.py``) instead of linking the engine's; its weights are still the engine's file.

A folder is written to a temporary sibling and renamed into place only when complete (and, with
``verify``, after genai's greedy tokens matched our ORT session's), so bad input leaves nothing."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping

from harp_trt.engine_spec import ENGINE_JSON, engine_json, engine_model, engine_threads, is_engine, read_engine_spec
from harp_trt.errors import ConfigError, PostconditionError, PreconditionError, VerificationError
from harp_trt.onnx_io import (EXTERNAL_DATA_SUFFIX, MODEL_FILE, TOKENIZER_FILES, folder_adds_bos,
                              kv_layers_of_names, present_name, read_export_meta)
from harp_trt.stage import Stage
from harp_trt.store import MANIFEST, Artifact

from .config import GenaiConfig
from .last_logits import has_logits_to_keep, pin_logits_to_keep

__all__ = ["GenaiStage", "EngineInfo", "inspect_engine", "genai_config_for", "write_genai_folder",
           "deploy_genai", "GENAI_CONFIG", "REPORT", "STAGE"]

log = logging.getLogger(__name__)

STAGE = "genai"
GENAI_CONFIG = "genai_config.json"
REPORT = "harp_genai.json"
_META_FIELDS = ("num_layers", "num_heads", "kv_heads", "head_dim", "hidden_size", "vocab_size", "kv_layers")
_HINT = "pass an ORT engine folder (or its cache key) written by `harp-trt build` (the build-ort artifact)"


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What ``inspect_engine`` read: the folder, engine.json, the export metadata, and the graph's
    facts (KV layers from its inputs, whether every present KV is a GroupQueryAttention output,
    whether it takes position_ids)."""

    path: Path
    spec: dict[str, Any]
    meta: dict[str, Any]
    kv_layers: list[int]
    gqa_kv: bool
    takes_positions: bool
    manifest: dict[str, Any]

    @property
    def onnx(self) -> Path:
        return engine_model(self.path, self.spec)


def _fail(message: str, hint: str | None = _HINT) -> PreconditionError:
    return PreconditionError(STAGE, message, hint)


def inspect_engine(ref: str | os.PathLike, store=None) -> EngineInfo:
    """Read an ORT engine folder (or a cache key in ``store``); ``PreconditionError`` for anything
    that is not one: no folder, no engine.json, another artifact, no harp-trt metadata."""
    p = Path(ref)
    if not p.is_dir() and store is not None:
        try:
            p = store.open(str(ref)).path
        except Exception:  # CacheError: reported below in this stage's words
            pass
    if not p.is_dir():
        raise _fail(f"no artifact folder at {ref}")
    p = p.resolve()
    manifest = json.loads((p / MANIFEST).read_text()) if (p / MANIFEST).is_file() else {}
    if not is_engine(p):
        what = f"a {manifest['stage']!r} artifact" if manifest.get("stage") else "not an ORT engine folder"
        raise _fail(f"{p.name} is {what}: no {ENGINE_JSON}")
    try:
        spec = read_engine_spec(p)
    except ValueError as e:
        raise _fail(str(e), "rebuild the engine") from None
    onnx_path = engine_model(p, spec)
    if not onnx_path.is_file():
        raise _fail(f"engine {p.name} has no {onnx_path.name}", "rebuild the engine")
    meta = read_export_meta(onnx_path, STAGE)  # GraphError on a file that is not ONNX
    if not meta:
        raise _fail(f"{onnx_path.name} in {p.name} carries no harp_trt.export metadata: its dimensions "
                    "cannot be read, and genai_config.json is never written from guesses")
    missing = [k for k in _META_FIELDS if meta.get(k) is None]
    if missing:
        raise _fail(f"the harp_trt.export metadata of {p.name} lacks {', '.join(missing)}", "rebuild the engine")
    kv_layers, gqa_kv, positions = _graph_facts(onnx_path)
    if kv_layers != sorted(int(i) for i in meta["kv_layers"]):
        raise _fail(f"{p.name}: the graph's KV inputs (layers {kv_layers}) disagree with its metadata "
                    f"(layers {meta['kv_layers']})", "rebuild the engine")
    return EngineInfo(p, spec, meta, kv_layers, gqa_kv, positions, manifest)


def _graph_facts(onnx_path: Path) -> tuple[list[int], bool, bool]:
    """(KV layers from the graph's inputs, every present KV produced by GroupQueryAttention,
    takes position_ids), read without loading the weights."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    layers = kv_layers_of_names(inputs)
    producer = {o: n.op_type for n in graph.node for o in n.output}
    presents = [present_name(i, k) for i in layers for k in ("key", "value")]
    gqa = bool(presents) and all(producer.get(n) == "GroupQueryAttention" for n in presents)
    return layers, gqa, "position_ids" in inputs


def _token_ids(folder: Path) -> dict[str, Any]:
    """bos / eos / pad ids from the engine's generation_config.json, then config.json, then the
    tokenizer's own special tokens (tokenizer_config.json's names looked up in tokenizer.json):
    the files the build copied next to the graph. eos may be a list (genai accepts one)."""
    found: dict[str, Any] = {}
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        if f.is_file():
            data = json.loads(f.read_text())
            for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if found.get(k) is None and data.get(k) is not None:
                    found[k] = data[k]
    for k, v in _tokenizer_special_ids(folder).items():
        if found.get(k) is None:
            found[k] = v
    if found.get("eos_token_id") is None:
        raise _fail(f"{folder.name} names no eos_token_id (generation_config.json, config.json, tokenizer files)",
                    "rebuild the engine from a model folder that has config.json")
    eos = found["eos_token_id"]
    first_eos = eos[0] if isinstance(eos, list) else eos
    return {"bos_token_id": found.get("bos_token_id", first_eos), "eos_token_id": eos,
            "pad_token_id": found.get("pad_token_id", first_eos)}


def _tokenizer_special_ids(folder: Path) -> dict[str, int]:
    """``{"eos_token_id": ...}`` for the special tokens tokenizer_config.json names and
    tokenizer.json (added tokens or the model's vocabulary) maps to an id."""
    tc, tj = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (tc.is_file() and tj.is_file()):
        return {}
    names, tok = json.loads(tc.read_text()), json.loads(tj.read_text())
    vocab = (tok.get("model") or {}).get("vocab")
    vocab = dict(vocab) if isinstance(vocab, dict) else {}  # WordLevel / BPE / WordPiece; Unigram has a list
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens") or [] if "content" in t})
    out = {}
    for kind in ("bos", "eos", "pad"):
        name = names.get(f"{kind}_token")
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str) and name in vocab:
            out[f"{kind}_token_id"] = int(vocab[name])
    return out


def genai_config_for(info: EngineInfo, config: GenaiConfig) -> dict[str, Any]:
    """The ``genai_config.json`` body for ``info``: every dimension from the export metadata,
    the KV sharing from the graph's attention ops, the token ids from the engine's config files."""
    meta = info.meta
    limit = meta.get("max_position_embeddings")
    context = config.context_length or limit
    if not context:
        raise _fail(f"{info.path.name}: the metadata has no max_position_embeddings; pass --context-length")
    if limit and context > int(limit):
        raise ConfigError(f"--context-length {context} exceeds the model's max_position_embeddings {limit}",
                          "the graph's rotary tables end there")
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask",
              **({"position_ids": "position_ids"} if info.takes_positions else {}),
              "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    outputs = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    session: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
    threads = engine_threads(info.spec)
    if threads:
        session["intra_op_num_threads"] = threads
    return {
        "model": {
            **_token_ids(info.path), "context_length": int(context), "type": "llama",
            "vocab_size": int(meta["vocab_size"]),
            "decoder": {"session_options": session, "filename": info.onnx.name,
                        "head_size": int(meta["head_dim"]), "hidden_size": int(meta["hidden_size"]),
                        "num_attention_heads": int(meta["num_heads"]),
                        "num_key_value_heads": int(meta["kv_heads"]),
                        "num_hidden_layers": int(meta["num_layers"]),  # the dense count: KV layers come from the inputs
                        "inputs": inputs, "outputs": outputs},
        },
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": int(context),
                   "min_length": 0, "past_present_share_buffer": info.gqa_kv, "early_stopping": True,
                   "length_penalty": 1.0, "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50,
                   "top_p": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0},
    }


def _place(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:  # another filesystem, or links not allowed: copy
            pass
    shutil.copy2(src, dst)


def write_genai_folder(info: EngineInfo, out: Path, config: GenaiConfig) -> dict[str, Any]:
    """Write the genai folder for ``info`` into the existing empty folder ``out``; returns the
    report (also saved as ``harp_genai.json``)."""
    cfg = genai_config_for(info, config)
    graph = info.onnx
    weights = sorted(q for q in info.path.glob(graph.name + EXTERNAL_DATA_SUFFIX + "*") if q.is_file())
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    # an ORT engine's logits_to_keep input (builders/ort/logits_to_keep.py), which genai never feeds,
    # is pinned to a constant in the folder's graph: 1 with --last-logits (the LM head over the last
    # position, what genai reads), else 0 (every position); an engine without it gets the Slice edit
    edit = config.last_logits or has_logits_to_keep(proto)
    for f in [*([] if edit else [graph]), *weights, engine_json(info.path)]:
        _place(f, out / f.name, config.link)
    if edit:   # the graph proto edited, its weights still the engine's external file
        if has_logits_to_keep(proto):
            pin_logits_to_keep(proto, 1 if config.last_logits else 0)
        else:
            from .last_logits import last_position_logits

            last_position_logits(proto)
        onnx.save(proto, str(out / graph.name))
    tokenizer = [n for n in TOKENIZER_FILES if (info.path / n).is_file()]
    for n in tokenizer:
        shutil.copy2(info.path / n, out / n)
    (out / GENAI_CONFIG).write_text(json.dumps(cfg, indent=2))
    meta = info.meta
    kv = info.spec.get("kv") or {}
    body = {"artifact": {"path": str(info.path), "key": info.manifest.get("key")},
            "files": sorted(p.name for p in out.iterdir()), "tokenizer_files": tokenizer,
            "num_layers": int(meta["num_layers"]), "kv_layers": info.kv_layers,
            "pruned_layers": [i for i in range(int(meta["num_layers"])) if i not in info.kv_layers],
            "past_present_share_buffer": info.gqa_kv, "context_length": cfg["model"]["context_length"],
            # og.Tokenizer.encode adds no special token unless told: a client of a model whose tokenizer
            # starts a prompt with BOS calls tokenizer.update_options(add_special_tokens="true")
            "add_special_tokens": folder_adds_bos(out),
            "quant": (info.spec.get("quant") or {}).get("mode", "none"),
            "logits": "last" if config.last_logits else "all",
            "kv_bytes_per_token": kv.get("bytes_per_token"),
            "dense_kv_bytes_per_token": kv.get("dense_bytes_per_token")}
    if config.verify:
        body["verify"] = verify_folder(out, config.verify_tokens, graph)
    (out / REPORT).write_text(json.dumps({"format": "harp-genai/1", **body}, indent=2))
    return body


def verify_folder(folder: Path, n_tokens: int, reference: Path) -> dict[str, Any]:
    """Greedy ``n_tokens`` from ``og.Generator`` on ``folder`` against our ``OrtCausalLM`` on
    ``reference`` (the engine's graph) (``VerificationError`` if they differ); ``{"skipped": reason}``
    without onnxruntime-genai."""
    from .probe import genai_greedy, genai_version

    if genai_version() is None:
        log.warning("onnxruntime-genai is not installed: %s not verified", folder)
        return {"skipped": "onnxruntime-genai is not installed"}
    import numpy as np

    from harp_trt.ort_session import OrtCausalLM

    cfg = json.loads((folder / GENAI_CONFIG).read_text())
    vocab = int(cfg["model"]["vocab_size"])
    prompt = [(37 * k + 11) % vocab for k in range(6)]
    got = genai_greedy(folder, prompt, n_tokens)
    lm = OrtCausalLM(reference, providers=["CPUExecutionProvider"])
    ref = [int(t) for t in lm.generate(np.asarray([prompt]), max_new_tokens=n_tokens)[0, len(prompt):]]
    if got != ref:
        raise VerificationError(STAGE, f"onnxruntime-genai's greedy tokens {got} differ from ONNX Runtime's {ref}",
                                "report this with the engine folder")
    return {"greedy_tokens": n_tokens, "equal": True, "onnxruntime_genai": genai_version()}


class GenaiStage(Stage[GenaiConfig]):
    """inputs: ``{"engine": Artifact}`` (a build-ort artifact). The cached artifact
    ``genai-<key>/`` is the folder ``og.Model`` opens."""

    name: ClassVar[str] = STAGE
    code: ClassVar[tuple[str, ...]] = ("harp_trt.builders.genai", "harp_trt.onnx_io")
    version: ClassVar[int] = 1
    outputs: ClassVar[tuple[str, ...]] = (GENAI_CONFIG, MODEL_FILE, REPORT)

    def key_material(self, config: GenaiConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The base material plus the engine's key (or folder, for an engine outside the cache)."""
        info = self._info(inputs)
        return {**super().key_material(config, inputs), "engine": info.manifest.get("key") or str(info.path)}

    def check_preconditions(self, config: GenaiConfig, inputs: Mapping[str, Any]) -> None:
        genai_config_for(self._info(inputs), config)  # refuse bad settings before writing anything

    @staticmethod
    def _info(inputs: Mapping[str, Any]) -> EngineInfo:
        ref = inputs.get("engine")
        if isinstance(ref, EngineInfo):
            return ref
        if ref is None:
            raise _fail("needs inputs={'engine': Artifact} (an ORT engine)")
        return inspect_engine(getattr(ref, "path", ref))

    def run(self, config: GenaiConfig, inputs: Mapping[str, Any], out_dir) -> dict[str, Any]:
        return {"genai": write_genai_folder(self._info(inputs), Path(out_dir), config)}

    def check_postconditions(self, config: GenaiConfig, inputs: Mapping[str, Any], out_dir) -> None:
        super().check_postconditions(config, inputs, out_dir)
        cfg = json.loads((Path(out_dir) / GENAI_CONFIG).read_text())
        if not (Path(out_dir) / cfg["model"]["decoder"]["filename"]).is_file():
            raise PostconditionError(self.name, f"{GENAI_CONFIG} names a graph the folder does not hold")


def deploy_genai(artifact: str | os.PathLike, out: str | os.PathLike | None, config: GenaiConfig | None = None,
                 force: bool = False, store=None) -> dict[str, Any]:
    """``out`` None: the cached ``genai-<key>/`` artifact in ``store``; else the folder ``out``
    (new or empty unless ``force``), written to a temporary sibling and renamed into place.
    Bad input raises a ``HarpError`` before anything is written."""
    config = config or GenaiConfig()
    config.validate()
    info = inspect_engine(artifact, store)
    stage = GenaiStage()
    if out is None:
        if store is None:
            raise _fail("no --out and no artifact store to cache the folder in", "pass --out DIR or --workdir")
        ref = Artifact(info.manifest["key"], info.path, info.manifest, True) if info.manifest.get("key") else info
        if isinstance(ref, EngineInfo):
            raise _fail(f"{info.path.name} is not a cached artifact; pass --out DIR to write its genai folder")
        art = stage.execute(store, config, {"engine": ref}, force=force)
        return {**art.manifest["genai"], "folder": str(art.path), "cached": art.cached}
    out = Path(out).absolute()
    t0 = time.perf_counter()
    body = stage.write_to(config, {"engine": info}, out, source=info.path, source_kind="engine", force=force)
    log.info("wrote onnxruntime-genai folder %s in %.2f s", out, time.perf_counter() - t0)
    return {**body["genai"], "folder": str(out), "cached": False}


def deploy_summary(r: dict[str, Any], config: GenaiConfig) -> dict[str, Any]:
    """``harp-trt deploy genai``'s result (``--json``, the summary) from ``deploy_genai``'s report."""
    return {"folder": r["folder"], "cached": r["cached"], "artifact": r["artifact"]["path"],
            "kv_layers": r["kv_layers"], "pruned_layers": r["pruned_layers"], "quant": r["quant"],
            "past_present_share_buffer": r["past_present_share_buffer"], "context_length": r["context_length"],
            "logits": r.get("logits", "all"),   # folders written before --last-logits hold every position's
            "verified": bool((r.get("verify") or {}).get("equal"))}
