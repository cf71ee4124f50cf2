"""What the bench reads from a GGUF file's metadata (``gguf.GGUFReader``, tensors not loaded): the
model's dimensions for the counted ideal, its context length, the layers without KV heads (llama.cpp's
``deci`` architecture keeps per-layer ``{arch}.attention.head_count_kv`` arrays; a layer with 0 has no
KV cache), and a tokenizer: the Hugging Face files beside the GGUF where present, else the one
transformers builds from the GGUF's own ``tokenizer.ggml.*`` keys."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harp_trt.dims import ModelDims
from harp_trt.errors import PreconditionError

__all__ = ["gguf_fields", "gguf_dims", "gguf_tokenizer", "matrix_bytes_per_param"]


def gguf_fields(path: Path) -> dict[str, Any]:
    """Every metadata key of ``path`` -> its value (scalars, strings and lists)."""
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType

    reader = GGUFReader(str(path))
    out: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if not f.types:
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            if name.startswith("tokenizer.ggml.") and name != "tokenizer.ggml.model":
                out[name] = len(f.data)  # token lists: only their length is needed here
                continue
            out[name] = [_scalar(f.parts[i], f.types[-1]) for i in f.data]
        else:
            out[name] = _scalar(f.parts[f.data[0]], f.types[0])
    return out


def matrix_bytes_per_param(path: Path) -> float:
    """Bytes per parameter of the file's matrices as stored (``GGUFReader`` tensor infos, nothing
    loaded): every 2-D tensor but the token embedding, whose decode reads one row. A llama.cpp
    quantization mixes types (Q4_0 keeps ``output.weight`` at Q6_K: src/llama-quant.cpp), so the
    byte ideal of a quantized file reads this, not a type's nominal size."""
    from gguf import GGUFReader

    tensors = [t for t in GGUFReader(str(path)).tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    return sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def _scalar(part, kind) -> Any:
    from gguf.constants import GGUFValueType

    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", "replace")
    return part.tolist()[0]


def gguf_dims(path: Path) -> tuple[ModelDims, int, list[int]]:
    """(dimensions, context length, layers without KV heads) of a llama-style GGUF (``llama``,
    ``deci``...): per-layer arrays give the dense (largest) value for the dimensions."""
    f = gguf_fields(path)
    arch = f.get("general.architecture")
    if not arch:
        raise PreconditionError("bench", f"{path} has no general.architecture", "pass a GGUF model file")

    def get(key, default=None):
        return f.get(f"{arch}.{key}", default)

    def top(v):
        return max(v) if isinstance(v, list) else v

    n = int(get("block_count"))
    heads, kv = get("attention.head_count"), get("attention.head_count_kv", get("attention.head_count"))
    kv_list = kv if isinstance(kv, list) else [kv] * n
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // top(heads))
    vocab = int(get("vocab_size") or f.get("tokenizer.ggml.tokens") or 0)
    dims = ModelDims(n, hidden, int(top(heads)), int(top(kv)), head_dim, int(top(get("feed_forward_length"))), vocab)
    return dims, int(get("context_length") or 1 << 30), [i for i, k in enumerate(kv_list) if int(k) == 0]


def gguf_tokenizer(path: Path, model_folder: str | None = None) -> Any:
    """The Hugging Face tokenizer beside the GGUF (``tokenizer.json`` in its folder), else the one
    of ``model_folder`` (the model the GGUF was written from, as its report names it), else the one
    transformers converts from the GGUF's ``tokenizer.ggml.*`` metadata."""
    from harp_trt.models import load_tokenizer

    for folder in (path.parent, Path(model_folder) if model_folder else None):
        if folder is not None and ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
            return load_tokenizer(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers' GGUF reader refuses some tokenizers and architectures
        raise PreconditionError("bench", f"no tokenizer for {path}: no tokenizer.json beside it and transformers "
                                f"cannot read the GGUF's ({str(exc).splitlines()[0][:160]})",
                                "keep the model's tokenizer files next to the GGUF") from exc
