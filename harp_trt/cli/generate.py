"""harp-trt generate: run an ORT engine folder (engine.json + model.onnx + tokenizer) on a prompt.

Streams the text as it is generated (to stdout, or to stderr with --json) and returns the figures:
text, tokens, seconds, tokens_per_s (new tokens over wall time, prefill included)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from ..config import option
from ..sampling import SamplingParams
from ._options import add_config_arguments, cli_fields, flag_of, values_from_args

NAME = "generate"
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "seed")  # SamplingParams' fields a user sets
HELP = "generate text with a built ORT engine (greedy or sampled), streaming it"


@dataclass(frozen=True)
class Session:
    """How one ``harp-trt generate`` runs, beside what it samples (``SamplingParams``)."""

    sample: bool = option(False, help="sample instead of greedy decoding, at --temperature (1.0 when not given)")
    chat: bool = option(False, help="wrap the prompt in the tokenizer's chat template")
    threads: int | None = option(None, help="ORT intra-op threads (0 or unset: engine.json's, else ORT's default)")
    stream: bool = option(True, negate=True, flag="--no-stream", help="print nothing while generating")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--artifact", required=True, help="engine folder (holds engine.json) or its cache key")
    p.add_argument("--prompt", required=True, help="prompt text")
    add_config_arguments(p, Session, ("sample",))
    # the sampling flags are SamplingParams' fields (harp_trt/sampling.py), as a served request's keys are
    add_config_arguments(p, SamplingParams, SAMPLING_FLAGS, overrides={
        "max_tokens": {"default": 64},
        "temperature": {"default": None, "help": "sampling temperature with --sample (default 1.0)"}})
    add_config_arguments(p, Session, ("chat", "threads", "stream"))


def _engine_dir(ref: str, workdir):
    from pathlib import Path

    from ..engine_spec import is_engine
    from ..errors import CacheError, GraphError
    from ..store import ArtifactStore

    p = Path(ref).expanduser()
    if is_engine(p):
        return p
    if p.exists():
        raise GraphError("generate", f"{p} has no engine.json", "pass an engine folder built by the ORT builder")
    try:
        art = ArtifactStore(workdir).open(ref)
    except CacheError:
        raise GraphError("generate", f"no engine folder or cached artifact {ref!r}",
                         "build one (harp_trt.builders.ort) and pass its folder, or see `harp-trt cache ls`") from None
    if not is_engine(art.path):
        raise GraphError("generate", f"artifact {art.key} is a {art.manifest.get('stage')} artifact, not an engine")
    return art.path


def check_arguments(args) -> SamplingParams:
    """The sampling parameters, or ConfigError for a value the sampler or ORT would reject later
    (or silently misuse: a negative top-k keeps nothing), before the engine loads."""
    from ..errors import ConfigError

    if not args.prompt.strip():
        raise ConfigError("--prompt is empty", "pass the text to continue, e.g. --prompt 'The capital of France is'")
    if args.threads is not None and args.threads < 0:
        raise ConfigError(f"--threads must be >= 0 (0: engine.json's), got {args.threads}")
    return sampling_from_args(args)


def sampling_from_args(args) -> SamplingParams:
    """The flags' SamplingParams, checked (ConfigError names the flag). Greedy unless ``--sample``,
    whose temperature is 1.0 when not given; a temperature of 0 cannot sample."""
    from ..errors import ConfigError

    values = values_from_args(SamplingParams, args, SAMPLING_FLAGS)
    if args.sample:
        values.setdefault("temperature", 1.0)
        if values["temperature"] == 0:
            raise ConfigError("--temperature must be > 0 with --sample, got 0", "leave out --sample to decode greedily")
    flags = {f.name: flag_of(f, o) for f, o in cli_fields(SamplingParams, SAMPLING_FLAGS)}
    params = SamplingParams(**values).checked(flags.get)   # a --temperature without --sample is checked, unused
    return params if args.sample else dataclasses.replace(params, temperature=0.0)


def run(args) -> dict:
    from transformers import AutoTokenizer

    from ..data import encode_prompt
    from ..errors import ConfigError, ModelError
    from ..ort_session import OrtCausalLM

    params = check_arguments(args)
    folder = _engine_dir(args.artifact, args.workdir)
    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelError(f"engine {folder} has no usable tokenizer: {str(e).splitlines()[0][:200]}",
                         "rebuild the engine from an artifact that holds the tokenizer files") from None
    lm = OrtCausalLM.from_engine(folder, intra_op_threads=args.threads)
    if args.chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)
    else:
        ids = encode_prompt(tok, args.prompt)  # BOS first where the model's tokenizer adds one
    if not ids:
        raise ConfigError("the prompt tokenizes to nothing", "pass a non-empty --prompt")
    stops = {t for t in _as_list(tok.eos_token_id)}
    stops |= set(_generation_eos(folder))  # generation_config.json holds the model's eos ids
    out_stream = sys.stderr if args.json else sys.stdout
    new: list[int] = []
    shown = [""]

    def stream(step_tokens):
        new.append(int(step_tokens[0]))
        if not args.stream:
            return
        text = tok.decode(new, skip_special_tokens=True)
        if text.startswith(shown[0]):
            out_stream.write(text[len(shown[0]):])
            out_stream.flush()
            shown[0] = text

    import numpy as np

    seq, fig = lm.timed_generate(np.array([ids], np.int64), max_new_tokens=params.max_tokens,
                                 do_sample=params.sampling, temperature=params.temperature or 1.0,
                                 top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                                 stop_token_ids=stops or None,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                                 streamer=stream)
    if args.stream:
        out_stream.write("\n")
    text = tok.decode(new, skip_special_tokens=True)
    return {"text": text, "prompt_tokens": len(ids), "tokens": fig["new_tokens"],
            "seconds": round(fig["seconds"], 4), "prefill_s": round(fig["prefill_s"], 4),
            "tokens_per_s": round(fig["tokens_per_s"], 2),
            "decode_tokens_per_s": round((fig["new_tokens"] - 1) / fig["decode_s"], 2) if fig["decode_s"] > 0 else None,
            "engine": str(folder), "kv_layers": len(lm.kv_layers), "num_layers": lm.num_layers,
            "kv_bytes_per_token": lm.kv_bytes_per_token(), "providers": lm.session.get_providers()}


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _generation_eos(folder) -> list[int]:
    import json

    f = folder / "generation_config.json"
    if not f.is_file():
        return []
    try:
        return _as_list(json.loads(f.read_text()).get("eos_token_id"))
    except (ValueError, TypeError):
        return []
