#!/usr/bin/env python3
"""Greedy text generation against the ONNX Runtime model of this Triton repository (written by
harp-trt).

The model is stateless: every call sends ``input_ids``, ``attention_mask``, ``position_ids`` and the
KV cache ``past_key_values.{i}.key/value`` of the layers that keep attention, and gets ``logits``
and ``present.{i}.*`` back; the client keeps the cache between calls. Tensor names, types and
shapes come from the server's model metadata, so the same client serves any HARP plan.

    pip install "tritonclient[grpc]" transformers numpy
    python client.py "The capital of France is" --max-tokens 32 [--url localhost:8001]
"""
import argparse
import os
import sys

import numpy as np

DEFAULTS: dict = {}  # filled in by harp-trt: model name, tokenizer folder, url, max_tokens

_NP = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
       "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}


def _empty_past(spec, batch):
    """A zero-length cache tensor for a [batch, kv_heads, past, head_dim] input (-1 = dynamic)."""
    shape = [batch if i == 0 else (0 if d < 0 else d) for i, d in enumerate(spec["shape"])]
    return np.zeros(shape, dtype=_NP[spec["datatype"]])


def greedy_generate(infer, metadata, prompt_ids, max_new_tokens, eos_ids=()):
    """Greedy decoding of one prompt. ``infer(dict name -> array) -> dict name -> array`` runs the
    model once; ``metadata`` is its KServe-v2 metadata (``inputs``/``outputs`` with name, datatype,
    shape). Returns the new token ids (the prompt excluded)."""
    inputs = {m["name"]: m for m in metadata["inputs"]}
    for need in ("input_ids", "attention_mask", "logits"):
        if need not in inputs and need not in {m["name"] for m in metadata["outputs"]}:
            raise ValueError(f"model has no {need!r} tensor; is this a harp-trt ONNX export?")
    dt = {name: _NP[m["datatype"]] for name, m in inputs.items()}
    past = {n: _empty_past(m, 1) for n, m in inputs.items() if n.startswith("past_key_values.")}
    step = list(prompt_ids)
    total = len(step)
    new = []
    for _ in range(max_new_tokens):
        feed = {"input_ids": np.array([step], dtype=dt["input_ids"]),
                "attention_mask": np.ones((1, total), dtype=dt["attention_mask"])}
        if "position_ids" in inputs:
            feed["position_ids"] = np.arange(total - len(step), total, dtype=dt["position_ids"])[None, :]
        if "logits_to_keep" in inputs:   # an ORT engine's: the LM head over the last position only
            feed["logits_to_keep"] = np.array([1], dtype=dt["logits_to_keep"])
        feed.update(past)
        out = infer(feed)
        token = int(np.asarray(out["logits"])[0, -1].argmax())
        past = {"past_key_values." + k[len("present."):]: np.asarray(v)
                for k, v in out.items() if k.startswith("present.")}
        new.append(token)
        if token in eos_ids:
            break
        step = [token]
        total += 1
    return new


def triton_metadata(client, model):
    """Model metadata from a tritonclient gRPC client, shapes as ints (JSON gives int64 as strings)."""
    meta = client.get_model_metadata(model, as_json=True)
    for group in ("inputs", "outputs"):
        for m in meta[group]:
            m["shape"] = [int(d) for d in m["shape"]]
    return meta


def triton_infer(client, model, metadata):
    """An ``infer`` function for :func:`greedy_generate` that calls the Triton server."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    wanted = [grpcclient.InferRequestedOutput(m["name"]) for m in metadata["outputs"]]

    def infer(feed):
        inputs = []
        for name, array in feed.items():
            t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            t.set_data_from_numpy(array)
            inputs.append(t)
        result = client.infer(model, inputs, outputs=wanted)
        return {m["name"]: result.as_numpy(m["name"]) for m in metadata["outputs"]}

    return infer


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default=DEFAULTS.get("url", "localhost:8001"), help="Triton gRPC endpoint")
    p.add_argument("--model", default=DEFAULTS.get("model", "harp"))
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.get("max_tokens", 32))
    p.add_argument("--tokenizer", default=os.path.join(here, DEFAULTS.get("tokenizer", "harp/tokenizer")))
    args = p.parse_args(argv)

    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    client = grpcclient.InferenceServerClient(url=args.url)
    if not client.is_model_ready(args.model):
        sys.exit(f"model {args.model!r} is not ready on {args.url}")
    meta = triton_metadata(client, args.model)
    ids = tok.encode(args.prompt)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    new = greedy_generate(triton_infer(client, args.model, meta), meta, ids, args.max_tokens, eos)
    print(args.prompt + tok.decode(new, skip_special_tokens=True))


if __name__ == "__main__":
    main()
