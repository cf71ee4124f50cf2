"""The ONNX I/O contract, defined once: export, rewrite, every builder and the bench import it.

* tensors: inputs ``input_ids`` [B, S], ``attention_mask`` [B, P+S], ``position_ids`` [B, S] and,
  per layer i that keeps attention, ``past_key_values.{i}.key|value`` [B, kv_heads, P, head_dim];
  outputs ``logits`` [B, S, V] and ``present.{i}.key|value`` [B, kv_heads, P+S, head_dim]
  (the names optimum-onnx's ``OnnxConfigWithPast.add_past_key_values`` also writes). A HARP graph
  has no KV tensors for its pruned layers.
* metadata: ``harp_trt.export`` (JSON: model type, layer counts, heads, head_dim, KV layers, HARP
  alphas, the weights' digest) and, on rewritten graphs, ``harp_trt.plan``.
* files: ``model.onnx``; initializers go to ``model.onnx.data`` once their total passes
  ``EXTERNAL_DATA_THRESHOLD`` (protobuf cannot serialise a message over 2 GiB); the tokenizer
  files in ``TOKENIZER_FILES`` sit next to every graph and engine, so later stages need no model folder.
* identity: ``file_digest`` hashes a graph with its external data by content; ``check_plan_weights``
  is the one check that a plan was calibrated on the weights a stage is about to use.

Light on purpose: importing this module imports neither onnx nor torch."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from .errors import GraphError, ModelError, PreconditionError

__all__ = ["LOGITS_TO_KEEP", "LOGITS_KEEP_NONE", "LOGITS_TO_KEEP_META_KEY", "tokenizer_digest", "EXPORT_META_KEY", "PLAN_META_KEY", "MODEL_FILE", "EXTERNAL_DATA_SUFFIX", "PROTOBUF_LIMIT",
           "EXTERNAL_DATA_THRESHOLD", "TOKENIZER_FILES", "VOCAB_FILES", "KvName", "past_name",
           "present_name", "input_names", "output_names", "parse_kv_name", "parse_any_kv_name", "kv_layers_of_names",
           "copy_tokenizer", "tokenizer_files", "make_tokenizer_portable", "PORTABLE_TOKENIZER_CLASS",
           "LEGACY_SPECIAL_TOKENS_KEY", "file_digest",
           "read_export_meta", "check_plan_weights", "LOGITS", "LM_HEAD_ELEMENTWISE", "LM_HEAD_MAX_WALK",
           "LmHeadWalk", "walk_to_lm_head"]

EXPORT_META_KEY = "harp_trt.export"
PLAN_META_KEY = "harp_trt.plan"
# the ORT engine's input that keeps the last k positions' logits (0 = all):
# builders/ort/logits_to_keep.py writes it, harp_trt/ort_session.py feeds it, a genai folder pins it
LOGITS_TO_KEEP = "logits_to_keep"
# a logits_to_keep value that keeps no position (the Slice starts past any axis): a chunked prefill
# feeds it to every chunk but the last, whose logits nobody reads. Engines that take it say so in
# this model metadata key (built before it, a w8a8 head's Reshape read an empty axis as "copy")
LOGITS_KEEP_NONE = -(2 ** 62)
LOGITS_TO_KEEP_META_KEY = "harp_trt.logits_to_keep"
LOGITS = "logits"
# ops the LM head's output may pass through on its way to ``logits`` (one data input each:
# casts, Gemma2's final soft-capping Div, Tanh, Mul)
LM_HEAD_ELEMENTWISE = frozenset({"Cast", "Mul", "Div", "Add", "Sub", "Tanh"})
LM_HEAD_MAX_WALK = 8
MODEL_FILE = "model.onnx"
EXTERNAL_DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data
PROTOBUF_LIMIT = 2 ** 31        # bytes: the largest protobuf message
# total initializer bytes above which weights leave model.onnx: under the protobuf limit with
# room for the graph itself (nodes, metadata)
EXTERNAL_DATA_THRESHOLD = 2_000_000_000

# copied next to every graph/engine so later stages (generate, Triton) need no model folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json", "config.json")
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a tokenizer

_KV = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")
# the spellings other exporters use for the same tensors (``past_key_values_3_key``, ``past_key_3``)
_KV_ANY = re.compile(r"^(?:(past_key_values|present)[._](\d+)[._](key|value)|(past|present)_(key|value)_(\d+))$")


class KvName(NamedTuple):
    direction: str  # "past" (input) or "present" (output)
    layer: int
    kind: str       # "key" or "value"


def past_name(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}"


def input_names(kv_layers: Iterable[int]) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids"] + [
        past_name(i, t) for i in kv_layers for t in ("key", "value")]


def output_names(kv_layers: Iterable[int]) -> list[str]:
    return ["logits"] + [present_name(i, t) for i in kv_layers for t in ("key", "value")]


def parse_kv_name(name: str | None) -> KvName | None:
    """``"past_key_values.3.value"`` -> ``KvName("past", 3, "value")``; None for any other name."""
    m = _KV.match(name or "")
    if m is None:
        return None
    return KvName("past" if m.group(1) == "past_key_values" else "present", int(m.group(2)), m.group(3))


def parse_any_kv_name(name: str | None) -> KvName | None:
    """Like ``parse_kv_name``, also accepting the spellings of graphs other exporters wrote
    (``past_key_values_3_key``, ``present_value_3``): the rewrite reads those graphs too."""
    if (k := parse_kv_name(name)) is not None:
        return k
    m = _KV_ANY.match(name or "")
    if m is None:
        return None
    if m.group(1):
        return KvName("past" if m.group(1) == "past_key_values" else "present", int(m.group(2)), m.group(3))
    return KvName(m.group(4), int(m.group(6)), m.group(5))


def kv_layers_of_names(names: Iterable[str], direction: str = "past") -> list[int]:
    """Sorted layers that have a ``key`` tensor among ``names`` (graph inputs or outputs)."""
    return sorted({k.layer for n in names if (k := parse_kv_name(n)) and k.direction == direction
                   and k.kind == "key"})


# What transformers 5 writes into ``tokenizer_config.json`` that the consumers' transformers 4.x cannot
# read, rewritten so that both read the same tokenizer. The consumers pin 4.x: TensorRT-LLM 1.2
# (requirements.txt: transformers==4.57.1) and the Triton TensorRT-LLM image's preprocessing /
# postprocessing models (AutoTokenizer.from_pretrained). tests/test_tokenizer_portable.py loads every
# shipped folder under 4.56.2, 4.57.1 and 5 and compares ids, special ids and chat-template output.
#
# 1. ``tokenizer_class``: 4.x cannot import the 5.x names ("Tokenizer class TokenizersBackend does not
#    exist"); the 4.x class that reads the same ``tokenizer.json`` into the same ids replaces them.
PORTABLE_TOKENIZER_CLASS = {"TokenizersBackend": "PreTrainedTokenizerFast"}
# 2. added special tokens: 5.x saves them as a list under ``extra_special_tokens``
#    (``PreTrainedTokenizerBase.save_pretrained``). In 4.x that key means something else, a dict of
#    named model-specific tokens: ``PreTrainedTokenizerBase.__init__`` hands it to
#    ``SpecialTokensMixin._set_model_specific_special_tokens``, which calls ``.keys()`` on it
#    ("'list' object has no attribute 'keys'"; 4.56.2 and 4.57.1, tokenization_utils_base.py; where
#    protobuf is missing, 4.x reports an ImportError from its slow-tokenizer fallback instead), so
#    every chat tokenizer (``<|im_start|>`` / ``<|im_end|>``) fails to load. The list goes back under its 4.x name,
#    ``additional_special_tokens``, which 5.x still reads and renames on load
#    (``PreTrainedTokenizerBase.__init__`` / ``_from_pretrained``: "Convert deprecated
#    additional_special_tokens to extra_special_tokens"). A dict stays: both versions read that form.
LEGACY_SPECIAL_TOKENS_KEY = "additional_special_tokens"


def _portable_config(cfg: dict[str, Any], has_tokenizer_json: bool) -> dict[str, Any]:
    """``cfg`` (a ``tokenizer_config.json``) as transformers 4.x and 5 both load it: the class only
    where ``tokenizer.json`` holds the whole pipeline, the special-token list whatever the class (a
    5.x-saved ``Qwen2Tokenizer`` carries it too)."""
    out = dict(cfg)
    new = PORTABLE_TOKENIZER_CLASS.get(out.get("tokenizer_class"))
    if new is not None and has_tokenizer_json:
        out["tokenizer_class"] = new
    if isinstance(out.get("extra_special_tokens"), list):
        # 5.x reads only this list when both keys are present, so it replaces any older list
        out[LEGACY_SPECIAL_TOKENS_KEY] = out.pop("extra_special_tokens")
    return out


def make_tokenizer_portable(folder: Path) -> bool:
    """Rewrite ``folder``'s ``tokenizer_config.json`` so that transformers 4.x and 5 both load it
    into the same tokenizer (the class, ``PORTABLE_TOKENIZER_CLASS``; the added special tokens,
    ``LEGACY_SPECIAL_TOKENS_KEY``). Returns whether the file changed."""
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    if not cfg_path.is_file():
        return False
    cfg = json.loads(cfg_path.read_text())
    new = _portable_config(cfg, (folder / "tokenizer.json").is_file())
    if new == cfg:
        return False
    cfg_path.write_text(json.dumps(new, indent=2, ensure_ascii=False) + "\n")
    return True


def tokenizer_files(folder: Path) -> list[str]:
    """The ``TOKENIZER_FILES`` in ``folder``, or none when no ``VOCAB_FILES`` is among them (no
    tokenizer can be built from the rest)."""
    files = [f for f in TOKENIZER_FILES if (Path(folder) / f).is_file()]
    return files if set(VOCAB_FILES) & set(files) else []


def folder_adds_bos(folder: Path) -> bool | None:
    """Whether the tokenizer in ``folder`` starts a prompt with BOS (``harp_trt.data.adds_bos``);
    None when the folder holds no tokenizer (no ``VOCAB_FILES``), ``ModelError`` when its files
    do not load."""
    if not tokenizer_files(folder):
        return None
    from transformers import AutoTokenizer

    from .data import adds_bos

    try:
        return adds_bos(AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False))
    except (OSError, ValueError) as e:
        raise ModelError(f"the tokenizer files in {folder} do not load: {str(e).splitlines()[0][:200]}",
                         "rebuild from an artifact that holds the model's tokenizer files") from None


def copy_tokenizer(sources: Path | Iterable[Path], dst: Path, skip: Iterable[str] = ()) -> list[str]:
    """Copy ``TOKENIZER_FILES`` (minus ``skip``) into ``dst``, each from the first source folder
    that has it, then make the copy loadable by transformers 4.x and 5 alike
    (:func:`make_tokenizer_portable`). Returns the names copied."""
    folders = [Path(sources)] if isinstance(sources, (str, Path)) else [Path(s) for s in sources]
    skipped = set(skip)
    copied = []
    for name in TOKENIZER_FILES:
        if name in skipped:
            continue
        for folder in folders:
            if (folder / name).is_file():
                shutil.copy2(folder / name, Path(dst) / name)
                copied.append(name)
                break
    make_tokenizer_portable(Path(dst))
    return copied


def tokenizer_digest(folder: Path) -> str:
    """sha256 over a model folder's tokenizer files (``TOKENIZER_FILES``, by name and content): an
    artifact that carries the tokenizer depends on it, and the weights' digest does not cover it."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (Path(folder) / name).is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256((Path(folder) / name).read_bytes()).digest())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 over an ONNX file and its external-data files (by content and name, not path)."""
    h = hashlib.sha256()
    path = Path(path)
    files = [path] + sorted(p for p in path.parent.glob(path.name + EXTERNAL_DATA_SUFFIX + "*") if p.is_file())
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


class LmHeadWalk(NamedTuple):
    """What ``walk_to_lm_head`` found: the LM-head node (None where it found none), the element-wise
    nodes from it to ``logits``, and, where the walk stopped at a node that is neither, that node
    and its number of data inputs."""
    head: Any
    chain: list[Any]
    blocker: Any = None
    data_inputs: int = 0


def walk_to_lm_head(logits: Any, producer: Callable[[Any], Any], data_inputs: Callable[[Any], list[Any]],
                    head_ops: Iterable[str], *, default_domain_only: bool = False) -> LmHeadWalk:
    """The one walk from the ``logits`` output up to the LM head, for any graph representation (an
    ``onnx`` proto's names or an ``onnx_ir`` graph's values): from ``logits`` through at most
    ``LM_HEAD_MAX_WALK`` nodes, each an ``LM_HEAD_ELEMENTWISE`` op with one data input, to a node
    whose op is in ``head_ops``. ``producer(value)`` is the node writing a value (None at a graph
    input), ``data_inputs(node)`` its inputs that are not constants; ``default_domain_only`` accepts
    only nodes of the default ONNX domain (a graph before ORT's contrib ops)."""
    head_ops = frozenset(head_ops)
    value, chain = logits, []
    for _ in range(LM_HEAD_MAX_WALK):
        node = producer(value)
        if node is None:
            break
        in_domain = not default_domain_only or node.domain == ""
        if node.op_type in head_ops and in_domain:
            return LmHeadWalk(node, chain)
        data = data_inputs(node)
        if node.op_type not in LM_HEAD_ELEMENTWISE or not in_domain or len(data) != 1:
            return LmHeadWalk(None, chain, node, len(data))
        chain.append(node)
        value = data[0]
    return LmHeadWalk(None, chain)


def read_export_meta(onnx_path: Path, stage: str = "export") -> dict[str, Any]:
    """The ``harp_trt.export`` metadata of a graph, without loading its weights; ``{}`` for a graph
    harp-trt did not write. A file that is not ONNX raises ``GraphError`` naming ``stage``."""
    import onnx

    try:
        m = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends: not a model at all
        raise GraphError(stage, f"{onnx_path} is not a readable ONNX model ({type(e).__name__})",
                         "re-run the stage that wrote it; the file may be truncated") from None
    for p in m.metadata_props:
        if p.key == EXPORT_META_KEY:
            try:
                return json.loads(p.value)
            except ValueError:
                return {}
    return {}


def check_plan_weights(plan_digest: str, weights_digest: str | None, stage: str, what: str = "the model",
                       hint: str | None = None) -> None:
    """Refuse to combine a plan with weights it was not calibrated on. ``weights_digest`` None
    (a graph that records no digest) passes: the caller checks what the graph does record."""
    if weights_digest and weights_digest != plan_digest:
        raise PreconditionError(stage, f"{what} (digest {weights_digest[:12]}...) is not the model the plan "
                                       f"was calibrated on (digest {plan_digest[:12]}...): the digest covers the "
                                       f"weights, config, tokenizer, chat template and generation config",
                                hint or "pass --model with the plan's model, or calibrate this model first (a plan "
                                        "written before harp-trt's digest covered the tokenizer needs calibrating again)")
