"""llama.cpp's own Hugging Face -> GGUF converter, run on a folder as a user would: the peer the
long-context bench sets beside our GGUFs (``bench/long_context.py --peer llamacpp-convert``: the dense
model as llama.cpp's converter and quantizer make it) and what tests/test_llamacpp_converter.py reads
our DeciLM folders with.

The converter is the one vendored in the ``llama-cpp-python`` sdist of the installed version
(``llama_cpp.__version__``): ``unpack_converter`` takes from that sdist only what the converter runs,
``vendor/llama.cpp/convert_hf_to_gguf.py``, its ``conversion/`` package and ``gguf-py/gguf``, into a
cache folder named by the version alone (a release's files never change), once; ``download_sdist``
fetches the sdist with pip (``pip download --no-deps --no-binary :all:``, PyPI or pip's cache).
``convert_hf_to_gguf.py`` puts ``gguf-py`` first on ``sys.path`` itself (unless ``NO_LOCAL_GGUF``),
and it must: the PyPI ``gguf`` 0.19.0 in our environment carries the same version string but lacks
what this converter uses (``conversion/base.py`` ``ModelBase.prepare_tensors`` fails with "module
'gguf' has no attribute 'LazyChunkedTensor'"), so the runner removes ``NO_LOCAL_GGUF`` and checks
that ``gguf`` was imported from the sdist.

One change, only for DeciLM folders of other than 128256 tokens: ``conversion/deci.py``
``DeciModel.set_vocab`` takes Llama-3's BPE route (``get_vocab_base``) only when ``vocab_size`` is
128256, else ``_set_vocab_llama_hf`` (DeciLM-7B's Llama/SentencePiece route, which finds no
``tokenizer.model`` in a GPT-2-style folder: "Cannot find Llama BPE tokenizer"). For those folders the
runner sets ``DeciModel.set_vocab`` to ``conversion/base.py`` ``TextModel._set_vocab_gpt2``, the
converter's own GPT-2 BPE path (``get_vocab_base`` + ``gguf.SpecialVocab`` with merges), which is
what ``DeciModel.set_vocab`` itself does for 128256 tokens. Other architectures (``route="none"``)
run the converter unchanged. Nothing else is patched: hyperparameters, block configs, tensor names,
Q/K permutation and the written file are the converter's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["unpack_converter", "download_sdist", "converter_root", "convert_hf_folder", "LLAMA3_VOCAB"]

LLAMA3_VOCAB = 128256  # the only vocabulary size conversion/deci.py DeciModel.set_vocab sends to get_vocab_base
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")

# Runs in a fresh interpreter: argv = converter root, vocab route, then convert_hf_to_gguf.py's own
# arguments. It imports the converter module (its main() is guarded by __name__), which puts gguf-py
# on sys.path before gguf is imported.
_RUNNER = r'''
import sys
from pathlib import Path
root, route = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(root))
import convert_hf_to_gguf
import gguf
if not Path(gguf.__file__).resolve().is_relative_to(root.resolve()):
    raise SystemExit(f"gguf imported from {gguf.__file__}, not from the sdist's gguf-py")
if route == "gpt2":
    from conversion.base import TextModel
    from conversion.deci import DeciModel
    DeciModel.set_vocab = TextModel._set_vocab_gpt2
sys.argv = [str(root / "convert_hf_to_gguf.py")] + sys.argv[3:]
convert_hf_to_gguf.main()
'''


def _installed_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def download_sdist(dest: Path, version: str | None = None) -> Path:
    """The ``llama-cpp-python==version`` sdist (default: the installed version) in ``dest``, downloaded
    with pip unless it is there."""
    version = version or _installed_version()
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (Path(dest) / name).is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", str(dest), f"llama-cpp-python=={version}"], check=True, stdin=subprocess.DEVNULL)
    return Path(dest) / name


def unpack_converter(sdist: Path, cache: Path, version: str | None = None) -> Path:
    """The folder holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` of the
    ``llama-cpp-python`` sdist ``sdist`` (of ``version``, default: the installed one), unpacked once
    under ``cache`` (written under a temporary name and renamed, so a half-unpacked tree is never served)."""
    version = version or _installed_version()
    dest = Path(cache) / f"llamacpp-converter-{version}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".llamacpp-sdist-") as tmp:
        prefix = f"{Path(sdist).name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        unpacked = Path(tmp) / "tree"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name.removeprefix(prefix)
                if m.name.startswith(prefix) and m.isfile() and rel.startswith(_WANTED) and "__pycache__" not in rel:
                    m.name = rel
                    members.append(m)
            tar.extractall(unpacked, members=members, filter="data")
        if not (unpacked / "convert_hf_to_gguf.py").is_file():
            raise FileNotFoundError(f"{Path(sdist).name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        try:
            unpacked.rename(dest)
        except OSError:  # another process unpacked it first
            if not (dest / "convert_hf_to_gguf.py").is_file():
                raise
    return dest


def converter_root(cache: Path) -> Path:
    """The installed version's converter under ``cache``: unpacked there before, or from its sdist
    (``download_sdist`` into ``cache``)."""
    dest = Path(cache) / f"llamacpp-converter-{_installed_version()}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    return unpack_converter(download_sdist(Path(cache)), cache)


def convert_hf_folder(folder: Path, out: Path, root: Path, outtype: str = "f32", *, route: str | None = None,
                      vocab_only: bool = False, timeout: float = 600) -> dict:
    """Convert the HF folder ``folder`` into the GGUF file ``out`` with the converter unpacked at
    ``root`` (``unpack_converter``). ``route``: the vocabulary path of a DeciLM folder, ``"deci"`` (the
    converter unchanged) or ``"gpt2"``, by default ``"deci"`` for 128256 tokens, else ``"gpt2"``; ``"none"``
    for any other architecture (the converter unchanged). Returns ``{"gguf": out, "vocab_route": route,
    "log": converter output}``; raises ``RuntimeError`` with the converter's last lines when it fails."""
    if route is None:
        vocab = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size", LLAMA3_VOCAB)
        route = "deci" if vocab == LLAMA3_VOCAB else "gpt2"
    if route not in ("deci", "gpt2", "none"):
        raise ValueError(f"route must be 'deci', 'gpt2' or 'none', got {route!r}")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    cmd = [sys.executable, "-c", _RUNNER, str(root), route, str(folder), "--outfile", str(out), "--outtype", outtype]
    cmd += ["--vocab-only"] if vocab_only else []
    # stdin closed: transformers' trust_remote_code prompt (the folder has auto_map) must not wait
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not Path(out).is_file():
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed on {folder} (exit {proc.returncode}):\n{tail}")
    return {"gguf": Path(out), "vocab_route": route, "log": log}
