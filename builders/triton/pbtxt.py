"""Triton ``config.pbtxt``: written from plain Python values, checked against Triton's own schema.

Configs are built as nested dicts and rendered to protobuf text format by :func:`render_pbtxt`
(so a generated file can carry comments for the person who edits it later). Every written file is
then parsed with ``google.protobuf.text_format`` into ``tritonclient``'s
``model_config_pb2.ModelConfig`` (:func:`parse_model_config`): a misspelt field, a wrong enum or a
value of the wrong type fails there with a typed error, not at server start.

Rendering rules: ``dict`` -> ``name { ... }``; a list of dicts -> ``name [ {...}, {...} ]``; a list of
scalars -> ``name: [ a, b ]``; :class:`Enum` -> bare symbol (``TYPE_FP32``, ``KIND_GPU``); ``str`` ->
quoted; ``bool`` -> ``true``/``false``. Map fields (``parameters``, ``input_map``) are given as
lists of ``{"key": ..., "value": ...}`` dicts and rendered as repeated entries, which is how text
format spells a protobuf map."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from harp_trt.errors import PostconditionError
from harp_trt.extras import require

__all__ = ["Enum", "render_pbtxt", "parse_model_config", "string_params", "model_metadata",
           "ONNX_TO_TRITON", "TRITON_TO_NUMPY", "STAGE"]

STAGE = "triton"
_NEEDS = "Triton repositories need it (each config.pbtxt is checked against its ModelConfig schema)"

# onnx.TensorProto.DataType value -> Triton DataType symbol
ONNX_TO_TRITON: dict[int, str] = {
    1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16",
    6: "TYPE_INT32", 7: "TYPE_INT64", 8: "TYPE_STRING", 9: "TYPE_BOOL", 10: "TYPE_FP16",
    11: "TYPE_FP64", 12: "TYPE_UINT32", 13: "TYPE_UINT64", 16: "TYPE_BF16",
}
# Triton DataType symbol -> numpy dtype name (what a client sends)
TRITON_TO_NUMPY: dict[str, str] = {
    "TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_FP64": "float64", "TYPE_INT8": "int8",
    "TYPE_INT16": "int16", "TYPE_INT32": "int32", "TYPE_INT64": "int64", "TYPE_UINT8": "uint8",
    "TYPE_UINT16": "uint16", "TYPE_UINT32": "uint32", "TYPE_UINT64": "uint64", "TYPE_BOOL": "bool",
    "TYPE_STRING": "object",
}


class Enum(str):
    """An enum symbol, rendered without quotes."""


def _scalar(v: Any) -> str:
    if isinstance(v, Enum):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string literal is a valid text-format string literal
    raise TypeError(f"cannot render {type(v).__name__} {v!r} in a pbtxt")


def _render(obj: dict[str, Any], indent: int) -> list[str]:
    pad = "  " * indent
    lines: list[str] = []
    for key, v in obj.items():
        if key.startswith("#"):  # a comment line
            lines.append(f"{pad}# {v}")
        elif isinstance(v, dict):
            lines += [f"{pad}{key} {{", *_render(v, indent + 1), f"{pad}}}"]
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            if key in ("parameters", "input_map", "output_map"):  # map fields: repeated entries
                for item in v:
                    lines += [f"{pad}{key} {{", *_render(item, indent + 1), f"{pad}}}"]
            else:
                lines.append(f"{pad}{key} [")
                for i, item in enumerate(v):
                    lines += [f"{pad}  {{", *_render(item, indent + 2),
                              f"{pad}  }}{',' if i < len(v) - 1 else ''}"]
                lines.append(f"{pad}]")
        elif isinstance(v, (list, tuple)):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(x) for x in v)} ]" if v else f"{pad}{key}: [ ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(v)}")
    return lines


def render_pbtxt(config: dict[str, Any], header: Iterable[str] = ()) -> str:
    """Protobuf text format for a ``ModelConfig`` given as nested dicts (see the module doc)."""
    head = [f"# {h}" for h in header]
    return "\n".join(head + _render(config, 0)) + "\n"


def parse_model_config(source: str | Path, where: str | None = None):
    """Parse pbtxt text (or a ``config.pbtxt`` path) into ``model_config_pb2.ModelConfig``.
    Raises ``PostconditionError`` (stage ``triton``) naming the file and the parser's message."""
    from google.protobuf import text_format

    model_config_pb2 = require("tritonclient.grpc.model_config_pb2", _NEEDS)
    if isinstance(source, Path):
        where = where or str(source)
        text = source.read_text()
    else:
        text = source
    if "${" in text:
        raise PostconditionError(STAGE, f"{where or 'config'} still holds a template key "
                                 f"({text[text.index('${'):][:40].splitlines()[0]})",
                                 "every fill_template key must be filled or left out")
    msg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        raise PostconditionError(STAGE, f"{where or 'config'} is not a valid Triton ModelConfig: {e}",
                                 "this is a bug in builders/triton; please report it") from None
    return msg


def string_params(config) -> dict[str, str]:
    """``parameters`` of a parsed ModelConfig as ``{key: string_value}``."""
    return {k: v.string_value for k, v in config.parameters.items()}


def model_metadata(config) -> dict[str, Any]:
    """What Triton's model-metadata endpoint (KServe v2) reports for a parsed ModelConfig: tensor
    names, ``datatype`` without the ``TYPE_`` prefix (``TYPE_STRING`` -> ``BYTES``) and ``shape`` =
    ``dims`` (with a leading -1 when ``max_batch_size`` > 0)."""
    model_config_pb2 = require("tritonclient.grpc.model_config_pb2", _NEEDS)

    def one(t):
        dt = model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_")
        shape = ([-1] if config.max_batch_size > 0 else []) + list(t.dims)
        return {"name": t.name, "datatype": "BYTES" if dt == "STRING" else dt, "shape": shape}

    return {"name": config.name, "inputs": [one(t) for t in config.input],
            "outputs": [one(t) for t in config.output]}
