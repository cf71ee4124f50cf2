#!/usr/bin/env python3
"""Send a prompt to the ``ensemble`` model of this Triton repository (TensorRT-LLM, written by
harp-trt) and print the reply: ``text_input`` + ``max_tokens`` in, ``text_output`` out. When the
``tensorrt_llm`` model is decoupled the reply is streamed over a gRPC stream.

    pip install "tritonclient[grpc]" numpy
    python client.py "The capital of France is" --max-tokens 32 [--url localhost:8001]
"""
import argparse
import queue
import sys

import numpy as np

DEFAULTS: dict = {}  # filled in by harp-trt: url, max_tokens, decoupled


def request_arrays(prompt, max_tokens, stream=False, temperature=None):
    """Ensemble inputs for one prompt (batch of 1; the ensemble has max_batch_size > 0)."""
    arrays = {"text_input": np.array([[prompt.encode("utf-8")]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    if stream:
        arrays["stream"] = np.array([[True]], dtype=bool)
    if temperature is not None:
        arrays["temperature"] = np.array([[temperature]], dtype=np.float32)
    return arrays


def _inputs(arrays):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, a in arrays.items():
        t = grpcclient.InferInput(name, list(a.shape), "BYTES" if a.dtype == object else np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def _text(result):
    return b"".join(np.asarray(result.as_numpy("text_output")).reshape(-1)[:1]).decode("utf-8", "replace")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default=DEFAULTS.get("url", "localhost:8001"), help="Triton gRPC endpoint")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.get("max_tokens", 32))
    p.add_argument("--temperature", type=float, default=None)
    args = p.parse_args(argv)
    decoupled = bool(DEFAULTS.get("decoupled", False))

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=args.url)
    if not client.is_model_ready(args.model):
        sys.exit(f"model {args.model!r} is not ready on {args.url}")
    arrays = request_arrays(args.prompt, args.max_tokens, stream=decoupled, temperature=args.temperature)
    if not decoupled:
        print(args.prompt + _text(client.infer(args.model, _inputs(arrays))))
        return
    replies = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    client.async_stream_infer(args.model, _inputs(arrays), enable_empty_final_response=True)
    sys.stdout.write(args.prompt)
    while True:
        result, error = replies.get()
        if error is not None:
            client.stop_stream()
            sys.exit(f"\nerror: {error}")
        final = result.get_response().parameters.get("triton_final_response")
        if result.as_numpy("text_output") is not None:
            sys.stdout.write(_text(result))
            sys.stdout.flush()
        if final is not None and final.bool_param:
            break
    client.stop_stream()
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
