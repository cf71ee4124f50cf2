"""Triton models for a TensorRT-LLM artifact (``TrtllmCheckpointStage``), tensorrtllm-backend layout::

    ensemble/config.pbtxt, ensemble/1/           text_input -> preprocessing -> tensorrt_llm -> postprocessing
    preprocessing/config.pbtxt, 1/model.py       Python backend: tokenize, clamp max_tokens, stop/bad words
    preprocessing/1/tokenizer/
    tensorrt_llm/config.pbtxt, tensorrt_llm/1/   C++ ``tensorrtllm`` backend; the engine is read from
                                                 ``gpt_model_path`` (where build_engine.sh writes it)
    postprocessing/config.pbtxt, 1/model.py      Python backend: detokenize
    postprocessing/1/tokenizer/

The model names and tensor names follow the tensorrtllm_backend ``inflight_batcher_llm`` models, so
its clients and docs apply; the tensor set is the text-generation subset (no multimodal, LoRA,
speculative-decoding or encoder-decoder tensors). Every ``fill_template.py`` key these configs use is
filled from the artifact (engine limits, per-layer attention windows, logits dtype) or from
``TritonRepoConfig``; a key the backend treats as optional and that has no value here is left out
of the file, which the backend reads exactly like an unfilled one (its default, with a warning).
``TEMPLATE_KEYS`` records, per key, the value used or ``None`` for "left out".

HARP: on the ``window1`` route (Qwen2, Gemma2) pruned layers attend over one token; the per-layer
list ``runtime_defaults.max_attention_window`` of the checkpoint becomes the backend's
``max_attention_window_size`` (comma-separated, one entry per layer), so the KV cache manager sizes
those layers to one block. DeciLM (``linear`` route) layers need no windows and the key is left out."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from harp_trt.onnx_io import copy_tokenizer

from .pbtxt import STAGE, Enum, render_pbtxt

__all__ = ["trtllm_model_configs", "write_trtllm_models", "TRTLLM_MODELS", "TEMPLATE_KEYS",
           "EXECUTOR_WORKER_PATH", "LOGITS_DTYPES"]

log = logging.getLogger(__name__)
TOKENIZER_MODELS = "harp_tokenizer_models.py"  # assets/: what preprocessing and postprocessing share

TRTLLM_MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
EXECUTOR_WORKER_PATH = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
LOGITS_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}

# fill_template.py keys of the inflight_batcher_llm templates that these configs use
TEMPLATE_KEYS = (
    "triton_backend", "triton_max_batch_size", "decoupled_mode", "max_queue_delay_microseconds",
    "max_queue_size", "engine_dir", "batching_strategy", "max_beam_width", "max_attention_window_size",
    "batch_scheduler_policy", "kv_cache_free_gpu_mem_fraction", "enable_kv_cache_reuse",
    "exclude_input_in_output", "enable_chunked_context", "normalize_log_probs", "max_tokens_in_paged_kv_cache",
    "logits_datatype", "tokenizer_dir", "add_special_tokens", "skip_special_tokens",
    "preprocessing_instance_count", "postprocessing_instance_count", "xgrammar_tokenizer_info_path",
    "guided_decoding_backend",
)


def _t(name: str, dtype: str, dims: list[int], optional: bool = False, scalar: bool = False,
       ragged: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "data_type": Enum(dtype), "dims": dims}
    if scalar:  # one value per request: the backend wants it without the [1]
        d["reshape"] = {"shape": []}
    if optional:
        d["optional"] = True
    if ragged:
        d["allow_ragged_batch"] = True
    return d


def _params(values: dict[str, str]) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"string_value": v}} for k, v in values.items()]


def _batching(mbs: int, delay: int, queue: int) -> dict[str, Any]:
    return {"preferred_batch_size": [mbs], "max_queue_delay_microseconds": delay,
            "default_queue_policy": {"max_queue_size": queue}}


# (ensemble input, dtype, dims, preprocessing input it feeds or None, tensorrt_llm input or None)
_ENSEMBLE_INPUTS = [
    ("text_input", "TYPE_STRING", [1], "QUERY", None),
    ("max_tokens", "TYPE_INT32", [1], "REQUEST_OUTPUT_LEN", None),
    ("bad_words", "TYPE_STRING", [-1], "BAD_WORDS_DICT", None),
    ("stop_words", "TYPE_STRING", [-1], "STOP_WORDS_DICT", None),
    ("end_id", "TYPE_INT32", [1], "END_ID", None),
    ("pad_id", "TYPE_INT32", [1], "PAD_ID", None),
    ("top_k", "TYPE_INT32", [1], None, "runtime_top_k"),
    ("top_p", "TYPE_FP32", [1], None, "runtime_top_p"),
    ("temperature", "TYPE_FP32", [1], None, "temperature"),
    ("length_penalty", "TYPE_FP32", [1], None, "len_penalty"),
    ("repetition_penalty", "TYPE_FP32", [1], None, "repetition_penalty"),
    ("min_tokens", "TYPE_INT32", [1], None, "min_tokens"),
    ("presence_penalty", "TYPE_FP32", [1], None, "presence_penalty"),
    ("frequency_penalty", "TYPE_FP32", [1], None, "frequency_penalty"),
    ("seed", "TYPE_UINT64", [1], None, "seed"),
    ("beam_width", "TYPE_INT32", [1], None, "beam_width"),
    ("stream", "TYPE_BOOL", [1], None, "streaming"),
    ("exclude_input_in_output", "TYPE_BOOL", [1], None, "exclude_input_in_output"),
    ("return_log_probs", "TYPE_BOOL", [1], None, "return_log_probs"),
]
_REQUIRED_ENSEMBLE_INPUTS = ("text_input", "max_tokens")

# preprocessing output -> (ensemble-internal tensor, tensorrt_llm input)
_PRE_TO_LLM = [
    ("INPUT_ID", "_INPUT_ID", "input_ids"), ("REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN", "input_lengths"),
    ("REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN", "request_output_len"),
    ("BAD_WORDS_IDS", "_BAD_WORDS_IDS", "bad_words_list"), ("STOP_WORDS_IDS", "_STOP_WORDS_IDS", "stop_words_list"),
    ("OUT_END_ID", "_PREPROCESSOR_END_ID", "end_id"), ("OUT_PAD_ID", "_PREPROCESSOR_PAD_ID", "pad_id"),
]


def _ensemble(mbs: int) -> dict[str, Any]:
    inputs = [_t(n, dt, dims, optional=n not in _REQUIRED_ENSEMBLE_INPUTS) for n, dt, dims, _, _ in _ENSEMBLE_INPUTS]
    pre = {"model_name": "preprocessing", "model_version": -1,
           "input_map": [{"key": p, "value": n} for n, _, _, p, _ in _ENSEMBLE_INPUTS if p],
           "output_map": [{"key": o, "value": v} for o, v, _ in _PRE_TO_LLM]}
    llm = {"model_name": "tensorrt_llm", "model_version": -1,
           "input_map": ([{"key": i, "value": v} for _, v, i in _PRE_TO_LLM]
                         + [{"key": m, "value": n} for n, _, _, _, m in _ENSEMBLE_INPUTS if m]),
           "output_map": [{"key": "output_ids", "value": "_TOKENS_BATCH"},
                          {"key": "sequence_length", "value": "_SEQUENCE_LENGTH"},
                          {"key": "cum_log_probs", "value": "cum_log_probs"},
                          {"key": "output_log_probs", "value": "output_log_probs"}]}
    post = {"model_name": "postprocessing", "model_version": -1,
            "input_map": [{"key": "TOKENS_BATCH", "value": "_TOKENS_BATCH"},
                          {"key": "SEQUENCE_LENGTH", "value": "_SEQUENCE_LENGTH"}],
            "output_map": [{"key": "OUTPUT", "value": "text_output"}]}
    return {"name": "ensemble", "platform": "ensemble", "max_batch_size": mbs, "input": inputs,
            "output": [_t("text_output", "TYPE_STRING", [-1]), _t("cum_log_probs", "TYPE_FP32", [-1]),
                       _t("output_log_probs", "TYPE_FP32", [-1, -1])],
            "ensemble_scheduling": {"step": [pre, llm, post]}}


def _preprocessing(mbs: int, delay: int, queue: int, count: int, params: dict[str, str]) -> dict[str, Any]:
    return {
        "name": "preprocessing", "backend": "python", "max_batch_size": mbs,
        "dynamic_batching": _batching(mbs, delay, queue),
        "input": [_t("QUERY", "TYPE_STRING", [1]), _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
                  _t("BAD_WORDS_DICT", "TYPE_STRING", [-1], optional=True),
                  _t("STOP_WORDS_DICT", "TYPE_STRING", [-1], optional=True),
                  _t("END_ID", "TYPE_INT32", [1], optional=True), _t("PAD_ID", "TYPE_INT32", [1], optional=True)],
        "output": [_t("INPUT_ID", "TYPE_INT32", [-1]), _t("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
                   _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]), _t("BAD_WORDS_IDS", "TYPE_INT32", [2, -1]),
                   _t("STOP_WORDS_IDS", "TYPE_INT32", [2, -1]), _t("OUT_END_ID", "TYPE_INT32", [1]),
                   _t("OUT_PAD_ID", "TYPE_INT32", [1])],
        "parameters": _params(params),
        "instance_group": [{"count": count, "kind": Enum("KIND_CPU")}],
    }


def _postprocessing(mbs: int, delay: int, queue: int, count: int, params: dict[str, str]) -> dict[str, Any]:
    return {
        "name": "postprocessing", "backend": "python", "max_batch_size": mbs,
        "dynamic_batching": _batching(mbs, delay, queue),
        "input": [_t("TOKENS_BATCH", "TYPE_INT32", [-1, -1]), _t("SEQUENCE_LENGTH", "TYPE_INT32", [-1])],
        "output": [_t("OUTPUT", "TYPE_STRING", [-1])],
        "parameters": _params(params),
        "instance_group": [{"count": count, "kind": Enum("KIND_CPU")}],
    }


def _tensorrt_llm(mbs: int, delay: int, queue: int, decoupled: bool, logits: str,
                  params: dict[str, str]) -> dict[str, Any]:
    s = dict(optional=True, scalar=True)
    inputs = [
        _t("input_ids", "TYPE_INT32", [-1], ragged=True), _t("input_lengths", "TYPE_INT32", [1], scalar=True),
        _t("request_output_len", "TYPE_INT32", [1], scalar=True),
        _t("end_id", "TYPE_INT32", [1], **s), _t("pad_id", "TYPE_INT32", [1], **s),
        _t("stop_words_list", "TYPE_INT32", [2, -1], optional=True, ragged=True),
        _t("bad_words_list", "TYPE_INT32", [2, -1], optional=True, ragged=True),
        _t("beam_width", "TYPE_INT32", [1], **s), _t("temperature", "TYPE_FP32", [1], **s),
        _t("runtime_top_k", "TYPE_INT32", [1], **s), _t("runtime_top_p", "TYPE_FP32", [1], **s),
        _t("len_penalty", "TYPE_FP32", [1], **s), _t("repetition_penalty", "TYPE_FP32", [1], **s),
        _t("min_tokens", "TYPE_INT32", [1], **s), _t("presence_penalty", "TYPE_FP32", [1], **s),
        _t("frequency_penalty", "TYPE_FP32", [1], **s), _t("seed", "TYPE_UINT64", [1], **s),
        _t("return_log_probs", "TYPE_BOOL", [1], **s), _t("return_context_logits", "TYPE_BOOL", [1], **s),
        _t("return_generation_logits", "TYPE_BOOL", [1], **s),
        _t("exclude_input_in_output", "TYPE_BOOL", [1], **s), _t("stop", "TYPE_BOOL", [1], **s),
        _t("streaming", "TYPE_BOOL", [1], **s),
    ]
    outputs = [
        _t("output_ids", "TYPE_INT32", [-1, -1]), _t("sequence_length", "TYPE_INT32", [-1]),
        _t("cum_log_probs", "TYPE_FP32", [-1]), _t("output_log_probs", "TYPE_FP32", [-1, -1]),
        _t("context_logits", logits, [-1, -1]), _t("generation_logits", logits, [-1, -1, -1]),
        _t("batch_index", "TYPE_INT32", [1]), _t("sequence_index", "TYPE_INT32", [1]),
    ]
    return {
        "name": "tensorrt_llm", "backend": "tensorrtllm", "max_batch_size": mbs,
        "model_transaction_policy": {"decoupled": decoupled},
        "dynamic_batching": _batching(mbs, delay, queue),
        "input": inputs, "output": outputs,
        "#0": "the backend schedules the GPUs itself; this instance only hosts the executor",
        "instance_group": [{"count": 1, "kind": Enum("KIND_CPU")}],
        "parameters": _params(params),
    }


def trtllm_model_configs(manifest: dict[str, Any], ckpt_config: dict[str, Any], cfg, engine_dir: str
                         ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The four model configs (as dicts for :func:`render_pbtxt`) and the template-key values used.

    ``manifest``: the trtllm artifact's manifest; ``ckpt_config``: its ``checkpoint/config.json``;
    ``cfg``: a ``TritonRepoConfig``."""
    build = manifest.get("config") or {}
    mbs = cfg.max_batch_size or int(build.get("max_batch_size", 8))
    windows = (ckpt_config.get("runtime_defaults") or {}).get("max_attention_window")
    logits = LOGITS_DTYPES.get(ckpt_config.get("logits_dtype") or "float32", "TYPE_FP32")
    bool_s = lambda b: "true" if b else "false"  # noqa: E731
    llm_params = {
        "max_beam_width": "1", "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": cfg.batching_strategy, "gpt_model_path": engine_dir,
        "batch_scheduler_policy": cfg.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": repr(float(cfg.kv_cache_free_gpu_mem_fraction)),
        "enable_kv_cache_reuse": bool_s(cfg.enable_kv_cache_reuse),
        "exclude_input_in_output": bool_s(cfg.exclude_input_in_output),
        "enable_chunked_context": "false", "normalize_log_probs": "true",
        "executor_worker_path": EXECUTOR_WORKER_PATH,
        # read with no fallback by the backend (model_instance_state.cc): present, empty = unset
        "tokenizer_dir": "", "xgrammar_tokenizer_info_path": "", "guided_decoding_backend": "",
    }
    if windows:
        # our per-attention-layer list: a window-1 layer is HARP only with it (no sink_token_length:
        # KvCacheConfig::setSinkTokenLength requires > 0)
        llm_params["max_attention_window_size"] = ",".join(str(int(w)) for w in windows)
    pre_params = {"tokenizer_dir": "tokenizer", "add_special_tokens": "true",
                  "max_input_len": str(int(build.get("max_input_len", 0))),
                  "max_seq_len": str(int(build.get("max_seq_len", 0)))}
    post_params = {"tokenizer_dir": "tokenizer", "skip_special_tokens": "true"}
    d, q = cfg.max_queue_delay_microseconds, cfg.max_queue_size
    configs = {
        "ensemble": _ensemble(mbs),
        "preprocessing": _preprocessing(mbs, d, q, cfg.preprocessing_instances, pre_params),
        "tensorrt_llm": _tensorrt_llm(mbs, d, q, cfg.decoupled, logits, llm_params),
        "postprocessing": _postprocessing(mbs, d, q, cfg.postprocessing_instances, post_params),
    }
    values = {
        "triton_backend": "tensorrtllm", "triton_max_batch_size": mbs, "decoupled_mode": cfg.decoupled,
        "max_queue_delay_microseconds": d, "max_queue_size": q, "engine_dir": engine_dir,
        "batching_strategy": cfg.batching_strategy, "max_beam_width": 1,
        "max_attention_window_size": llm_params.get("max_attention_window_size"),
        "batch_scheduler_policy": cfg.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": float(cfg.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": cfg.enable_kv_cache_reuse, "exclude_input_in_output": cfg.exclude_input_in_output,
        "enable_chunked_context": False, "normalize_log_probs": True, "max_tokens_in_paged_kv_cache": None,
        "logits_datatype": logits, "tokenizer_dir": "tokenizer (relative to each Python model's 1/ folder)",
        "add_special_tokens": True, "skip_special_tokens": True,
        "preprocessing_instance_count": cfg.preprocessing_instances,
        "postprocessing_instance_count": cfg.postprocessing_instances,
        "xgrammar_tokenizer_info_path": "", "guided_decoding_backend": "",
    }
    assert set(values) == set(TEMPLATE_KEYS), sorted(set(values) ^ set(TEMPLATE_KEYS))
    return configs, values


def _asset(name: str) -> str:
    return (Path(__file__).parent / "assets" / name).read_text()


def write_trtllm_models(repo: Path, configs: dict[str, dict[str, Any]], tokenizer_src: Path,
                        tokenizer_files: list[str], header: list[str]) -> None:
    """Write the four model folders (configs, Python backend sources, tokenizer copies)."""
    for name, cfg in configs.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(render_pbtxt(cfg, header))
        if name in ("ensemble", "tensorrt_llm"):  # an empty version folder vanishes in a git copy
            (repo / name / "1" / "README.md").write_text(
                f"Version 1 of `{name}`. Triton needs this folder; it is empty by design "
                f"({'the ensemble has no files' if name == 'ensemble' else 'the engine is read from gpt_model_path'}).\n")
    for name, src in (("preprocessing", "preprocessing.py"), ("postprocessing", "postprocessing.py")):
        (repo / name / "1" / "model.py").write_text(_asset(src))
        (repo / name / "1" / TOKENIZER_MODELS).write_text(_asset(TOKENIZER_MODELS))  # model.py imports it
        tok = repo / name / "1" / "tokenizer"
        tok.mkdir()
        copy_tokenizer(tokenizer_src, tok)  # the files of tokenizer_files, made loadable by transformers 4.x
    log.info("wrote Triton TensorRT-LLM models %s", ", ".join(configs))


def check_engine_windows(engine_dir: str, windows: list[int] | None) -> None:
    """A built engine found at ``engine_dir`` must carry the checkpoint's window list: a window-1
    layer without it averages V over the prefix (the runtime raises nothing)."""
    from harp_trt.errors import PreconditionError

    cfg_path = Path(engine_dir) / "config.json"
    if not windows or not cfg_path.is_file():
        return
    cfg = json.loads(cfg_path.read_text())
    pretrained = cfg.get("pretrained_config", cfg)
    got = (pretrained.get("runtime_defaults") or {}).get("max_attention_window")
    if got != windows:
        raise PreconditionError(STAGE, f"engine {engine_dir} has max_attention_window {got}, but this checkpoint's "
                                f"pruned layers need {windows}",
                                "rebuild the engine from this artifact's checkpoint (build_engine.sh)")


def read_checkpoint_config(artifact: Path) -> dict[str, Any]:
    p = artifact / "checkpoint" / "config.json"
    if not p.is_file():
        from harp_trt.errors import PreconditionError

        raise PreconditionError(STAGE, f"TensorRT-LLM artifact {artifact} has no checkpoint/config.json",
                                "re-run `harp-trt deploy trtllm`; the artifact is incomplete")
    return json.loads(p.read_text())
