"""harp-trt generate: run an ORT engine folder (engine.json + model.onnx + tokenizer) on a prompt.

Streams the text as it is generated (to stdout, or to stderr with --json) and returns the figures:
text, tokens, seconds, tokens_per_s (new tokens over wall time, prefill included)."""
from __future__ import annotations

import argparse
import sys

NAME = "generate"
HELP = "generate text with a built ORT engine (greedy or sampled), streaming it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--artifact", required=True, help="engine folder (holds engine.json) or its cache key")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default %(default)s)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: engine.json's)")
    p.add_argument("--no-stream", action="store_true", help="print nothing while generating")


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


def check_arguments(args) -> None:
    """ConfigError for a value the sampler or ORT would reject later (or silently misuse: a
    negative top-k keeps nothing), before the engine loads."""
    import math

    from ..errors import ConfigError

    if not args.prompt.strip():
        raise ConfigError("--prompt is empty", "pass the text to continue, e.g. --prompt 'The capital of France is'")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or (args.sample and args.temperature <= 0):
        raise ConfigError(f"--temperature must be > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 keeps every token), got {args.top_k}")
    if args.threads is not None and args.threads < 0:
        raise ConfigError(f"--threads must be >= 0 (0: ORT's default), got {args.threads}")
    if args.seed is not None and args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")


def run(args) -> dict:
    from transformers import AutoTokenizer

    from ..errors import ConfigError, ModelError
    from ..ort_session import OrtCausalLM

    check_arguments(args)
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
        ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError("the prompt tokenizes to nothing", "pass a non-empty --prompt")
    stops = {t for t in _as_list(tok.eos_token_id)}
    stops |= set(_generation_eos(folder))  # generation_config.json holds the model's eos ids
    out_stream = sys.stderr if args.json else sys.stdout
    new: list[int] = []
    shown = [""]

    def stream(step_tokens):
        new.append(int(step_tokens[0]))
        if args.no_stream:
            return
        text = tok.decode(new, skip_special_tokens=True)
        if text.startswith(shown[0]):
            out_stream.write(text[len(shown[0]):])
            out_stream.flush()
            shown[0] = text

    import numpy as np

    seq, fig = lm.timed_generate(np.array([ids], np.int64), max_new_tokens=args.max_new_tokens,
                                 do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=args.seed, stop_token_ids=stops or None,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                                 streamer=stream)
    if not args.no_stream:
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
