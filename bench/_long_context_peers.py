"""``bench/long_context.py``'s peers: an engine timed beside the dense and HARP pair in the same rounds.
``--peer``: another tool's model of the same dense weights (onnxruntime-genai's own int4 builder,
llama.cpp's own converter); ``--peer-plan``: the HARP engine of a second plan of the same model
(a fitted ``rrr`` plan beside HARP's alphas)."""
from __future__ import annotations

import os
from pathlib import Path

from harp_trt.errors import ConfigError

__all__ = ["PEERS", "peer_path", "load_peer", "open_peer_plan"]


PEERS = {"genai-int4": "ort", "llamacpp-convert": "llamacpp"}   # --peer -> the runtime it is timed beside


def peer_path(peer: str, resolved, store, args) -> Path:
    """The peer's model of the plan's dense model, built once, cached by model digest (written under a
    temporary name, then renamed). ``genai-int4``: onnxruntime-genai's own builder, int4, the last
    position's logits only (``prune_lm_head``, what a long-prompt user of it picks).
    ``llamacpp-convert``: llama.cpp's own ``convert_hf_to_gguf.py`` (f16; ``bench/_llamacpp_convert.py``),
    then its quantizer to ``--gguf-type``: the dense file a llama.cpp user makes, beside our writer's."""
    peers = Path(store.root) / "long_context_peers"
    if peer == "genai-int4":
        from harp_trt.bench._genai_baseline import build_genai_int4

        folder = peers / f"genai-int4-last-{resolved.digest[:16]}"
        if not (folder / "genai_config.json").is_file():
            tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
            build_genai_int4(resolved.folder, tmp, extra_options={"prune_lm_head": "true"})
            tmp.rename(folder)
        return folder
    from harp_trt.bench._llamacpp_convert import convert_hf_folder, converter_root
    from harp_trt.builders.gguf.probe import quantize

    path = peers / f"llamacpp-convert-{args.gguf_type}-{resolved.digest[:16]}.gguf"
    if not path.is_file():
        peers.mkdir(parents=True, exist_ok=True)
        f16 = path.with_name(path.name + f".f16.tmp{os.getpid()}")
        convert_hf_folder(resolved.folder, f16, converter_root(Path(store.root) / "llamacpp-converter"), "f16",
                          route="none", timeout=4 * 3600)
        if args.gguf_type == "none":
            f16.rename(path)
        else:
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            quantize(f16, tmp, args.gguf_type)
            f16.unlink()
            tmp.rename(path)
    return path


def load_peer(args, resolved, store, max_pos: int, headroom: int):
    """The ``--peer`` engine (``peer_path``), with this run's threads: genai without the CPU arena as
    our genai folders are here; llama.cpp with this run's KV type and flash attention."""
    path = peer_path(args.peer, resolved, store, args)
    if args.peer == "genai-int4":
        from harp_trt.bench.stage.engine_genai import GenaiBenchEngine

        return GenaiBenchEngine(path, "peer", args.threads, headroom, max_pos, arena=False)
    from harp_trt.bench.stage.engine_llamacpp import LlamaCppEngine

    return LlamaCppEngine(path, "peer", args.threads, headroom, max_pos, kv_type=args.kv_type)


def open_peer_plan(args, plan, store):
    """``--peer-plan``'s plan (None without it); ConfigError unless it is of the first plan's model."""
    if not args.peer_plan:
        return None
    from harp_trt.plan import open_plan

    peer = open_plan(args.peer_plan, store)
    if peer.model_digest != plan.model_digest:
        raise ConfigError(f"--peer-plan is a plan of another model ({peer.model_ref}) than --plan's ({plan.model_ref})")
    return peer
