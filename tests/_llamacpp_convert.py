"""Test support: llama.cpp's own converter (``harp_trt.bench._llamacpp_convert``) from the wheelhouse's
``llama-cpp-python`` sdist, unpacked into the test cache once."""
from __future__ import annotations

from pathlib import Path

import wheelhouse

from harp_trt.bench import _llamacpp_convert as llamacpp_convert
from harp_trt.bench._llamacpp_convert import LLAMA3_VOCAB

__all__ = ["fetch_converter", "convert_hf_folder", "LLAMA3_VOCAB"]


def fetch_converter(cache: Path, version: str | None = None) -> Path:
    """The converter of ``llama-cpp-python==version`` (default: the installed one) under ``cache``."""
    version = version or llamacpp_convert._installed_version()
    return llamacpp_convert.unpack_converter(wheelhouse.require(f"llama-cpp-python=={version}"), cache, version)


def convert_hf_folder(folder: Path, out: Path, cache: Path, outtype: str = "f32", **kw) -> dict:
    """``llamacpp_convert.convert_hf_folder`` with the converter from the test cache."""
    return llamacpp_convert.convert_hf_folder(folder, out, fetch_converter(cache), outtype, **kw)
