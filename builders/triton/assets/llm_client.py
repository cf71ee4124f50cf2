#!/usr/bin/env python3
"""Stream a reply from this repository's text-in/text-out model (written by harp-trt) over gRPC:
``text_input`` + ``sampling_parameters`` in, ``text_output`` pieces out (Triton vLLM-backend I/O).

    pip install "tritonclient[grpc]" numpy
    python client.py "The capital of France is" --max-tokens 32 [--url localhost:8001]
"""
import argparse
import json
import queue
import sys

import numpy as np

DEFAULTS: dict = {}  # filled in by harp-trt: model, url, max_tokens


def request_inputs(prompt, params, stream=True):
    """gRPC inputs for one request."""
    import tritonclient.grpc as grpcclient

    arrays = {"text_input": (np.array([prompt.encode("utf-8")], dtype=object), "BYTES"),
              "stream": (np.array([stream], dtype=bool), "BOOL"),
              "sampling_parameters": (np.array([json.dumps(params).encode("utf-8")], dtype=object), "BYTES"),
              "exclude_input_in_output": (np.array([True], dtype=bool), "BOOL")}
    out = []
    for name, (a, dtype) in arrays.items():
        t = grpcclient.InferInput(name, list(a.shape), dtype)
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def stream_text(url, model, prompt, params, on_piece=None, timeout=600.0):
    """Send one streaming request; return the whole reply (raises on an error response)."""
    import tritonclient.grpc as grpcclient

    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    pieces = []
    try:
        client.async_stream_infer(model, request_inputs(prompt, params), enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            final = result.get_response().parameters.get("triton_final_response")
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                piece = out.reshape(-1)[0].decode("utf-8")
                pieces.append(piece)
                if on_piece:
                    on_piece(piece)
            if final is not None and final.bool_param:
                return "".join(pieces)
    finally:
        client.stop_stream()
        client.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--max-tokens", type=int, default=DEFAULTS.get("max_tokens", 32))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--url", default=DEFAULTS.get("url", "localhost:8001"))
    ap.add_argument("--model", default=DEFAULTS.get("model", "harp"))
    args = ap.parse_args(argv)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    stream_text(args.url, args.model, args.prompt, params,
                on_piece=lambda p: (sys.stdout.write(p), sys.stdout.flush()))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
