"""The ``tokenizer.*`` keys of a written GGUF, from one of three sources (each a callable that adds
the keys to a ``gguf.GGUFWriter`` and returns what it wrote, for the manifest):

* ``from_gguf``: the model was read from a GGUF file: its ``tokenizer.*`` keys, copied unchanged;
* ``from_hf_bpe``: a Hugging Face byte-level BPE tokenizer (``tokenizer.json`` / ``vocab.json``), read
  by the gguf package's own ``gguf.vocab.BpeVocab`` and ``SpecialVocab`` (merges, special ids, chat
  template); llama.cpp's pre-tokenizer name is not recorded in a Hugging Face folder, so the stage
  writes each candidate (``PRE_CANDIDATES``) and keeps the one whose llama.cpp tokenization of a
  check text equals the Hugging Face tokenizer's, or none (``stage.py``);
* ``no_vocab``: anything else: ``tokenizer.ggml.model = "none"`` with ``{arch}.vocab_size`` tokens,
  which llama.cpp runs on token ids only (``llama_vocab::impl::load``, ``src/llama-vocab.cpp``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

__all__ = ["from_gguf", "from_hf_bpe", "no_vocab", "PRE_CANDIDATES", "Vocab", "tokenizer_keys"]

Vocab = Callable[[Any], dict[str, Any]]
# llama.cpp pre-tokenizer names (``llama_vocab::impl::load``, src/llama-vocab.cpp) tried for a
# Hugging Face byte-level BPE tokenizer, in this order
PRE_CANDIDATES = ("smollm", "llama-bpe", "gpt-2", "qwen2", "default")


# GGUF value types (gguf ``GGUFValueType``; the format spec, ggml docs/gguf.md): struct format per scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def tokenizer_keys(path: str | Path, prefix: str = "tokenizer.") -> dict[str, tuple[Any, Any, Any]]:
    """``{key: (value, GGUFValueType, array sub-type)}`` of the GGUF file's metadata keys under
    ``prefix``. Reads the key/value section sequentially (``gguf.GGUFReader`` builds a numpy view per
    array element: ~10 s for a 49k-token vocabulary on a busy core; this takes well under one)."""
    import struct

    import gguf

    with open(path, "rb") as f:
        data = f.read(64 << 20) if Path(path).stat().st_size > (64 << 20) else f.read()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return data[pos - n:pos].decode("utf-8")

    def value(t: int):
        if t == _STRING:
            return string()
        if t == _ARRAY:
            sub, n = take("<I"), take("<Q")
            return [value(sub) for _ in range(n)], sub
        return take(_SCALARS[t])

    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    take("<I")  # version
    take("<Q")  # tensor count
    out = {}
    for _ in range(take("<Q")):
        key, t = string(), take("<I")
        v = value(t)
        if t == _ARRAY:
            v, sub = v
            out_sub = gguf.GGUFValueType(sub)
        else:
            out_sub = None
        if key.startswith(prefix):
            out[key] = (v, gguf.GGUFValueType(t), out_sub)
    return out


def from_gguf(path: str | Path) -> Vocab:
    def add(writer) -> dict[str, Any]:
        keys = tokenizer_keys(path)
        for key, (value, vtype, sub) in keys.items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        model = keys.get("tokenizer.ggml.model", (None,))[0]
        pre = keys.get("tokenizer.ggml.pre", (None,))[0]
        return {"source": "gguf", "file": Path(path).name, "model": model, "pre": pre, "keys": sorted(keys)}
    return add


def from_hf_bpe(folder: str | Path, n_vocab: int, pre: str) -> Vocab:
    """Raises FileNotFoundError / ValueError (from ``gguf.vocab.BpeVocab``) when the folder has no
    byte-level BPE tokenizer; call it inside ``add`` so that the caller can fall back."""
    import gguf

    bpe = gguf.vocab.BpeVocab(Path(folder))

    def add(writer) -> dict[str, Any]:
        tokens, types = [], []
        for text, _score, ttype in bpe.all_tokens():
            tokens.append(text)
            types.append(ttype)
        for i in range(len(tokens), n_vocab):  # embedding rows past the tokenizer's vocabulary
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens[:n_vocab])
        writer.add_token_types(types[:n_vocab])
        gguf.SpecialVocab(Path(folder), load_merges=True, n_vocab=n_vocab).add_to_gguf(writer)
        return {"source": "hf", "model": "gpt2", "pre": pre, "tokens": len(tokens[:n_vocab])}
    return add


def no_vocab(reason: str) -> Vocab:
    def add(writer) -> dict[str, Any]:
        writer.add_tokenizer_model("none")
        return {"source": "none", "model": "none", "pre": None, "reason": reason}
    return add
