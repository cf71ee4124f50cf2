"""A model of one of ``bench/_shapes.py``'s real shapes with random weights, as a Hugging Face
folder: the real config (``architectures`` as a published checkpoint names it), bf16 safetensors
sharded at 2 GiB and written tensor by tensor (``harp_trt.weights.SafetensorsWriter``: the writer holds
one tensor, so a 7B folder is written in well under its size), optionally a borrowed tokenizer.
Latency and memory depend on shapes, not values, so ``scale_probe.py``, ``long_context.py
--shape`` and the GPU scripts' ``--engine`` time these."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from harp_trt.bench._shapes import SHAPES

SHARD_BYTES = 2 << 30


def write_random_model(shape: str, folder: Path, tokenizer_from: Path | None, seed: int = 0) -> dict:
    """A sharded bf16 safetensors folder with ``shape``'s config; returns {bytes, params, files}."""
    import torch
    from transformers import AutoConfig

    from harp_trt.dims import attention_dims
    from harp_trt.families import family_for_model_type
    from harp_trt.weights import SafetensorsWriter, TensorSpec

    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # ``architectures`` as a published checkpoint names it: llama.cpp's converter reads the model class there
    cfg = AutoConfig.for_model(model_type, **kw, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                               architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]])
    fam = family_for_model_type(model_type)
    heads, kv_heads, hd = attention_dims(cfg)
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    q, kv, inter = heads * hd, kv_heads * hd, cfg.intermediate_size
    specs = [(fam.weight_name("embed"), (cfg.vocab_size, d))]
    for i in range(n):
        shapes = {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "input_ln": (d,), "post_attn_ln": (d,),
                  "gate": (inter, d), "up": (inter, d), "down": (d, inter)}
        if fam.qkv_bias:
            shapes.update(qb=(q,), kb=(kv,), vb=(kv,))
        specs += [(fam.weight_name(role, i), s) for role, s in shapes.items()]
    specs.append((fam.weight_name("final_norm"), (d,)))
    if not cfg.tie_word_embeddings:
        specs.append((fam.weight_name("lm_head"), (cfg.vocab_size, d)))
    shards, size = [[]], 0
    for name, s in specs:
        nbytes = 2 * int(torch.tensor(s).prod())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(TensorSpec(name, torch.bfloat16, tuple(s)))
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for fname, shard in zip(names, shards):
        with SafetensorsWriter(folder / fname, shard) as w:
            for spec in shard:
                if spec.name.endswith("layernorm.weight") or spec.name.endswith("norm.weight"):
                    t = 1.0 + 0.1 * torch.randn(spec.shape, generator=g)
                elif spec.name.endswith(".bias"):
                    t = 0.02 * torch.randn(spec.shape, generator=g)
                else:
                    t = 0.02 * torch.randn(spec.shape, generator=g)
                w.write(spec.name, t.to(torch.bfloat16))
                weight_map[spec.name] = fname
                del t
    total = sum(s.nbytes for shard in shards for s in shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    cfg.save_pretrained(folder)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / f).is_file():
                shutil.copy2(tokenizer_from / f, folder / f)
    params = sum(int(torch.tensor(s.shape).prod()) for shard in shards for s in shard)
    return {"bytes_bf16": total, "params": params, "files": len(names)}


def random_model(shape: str, folder: Path, tokenizer_from: Path | None = None, seed: int = 0) -> Path:
    """``folder`` holding :func:`write_random_model`'s model, written once (into a temporary folder
    beside it, then renamed: an interrupted write leaves nothing that looks finished)."""
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        write_random_model(shape, tmp, tokenizer_from, seed)
        tmp.rename(folder)
    return folder
